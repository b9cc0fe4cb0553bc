"""The KV events hub (``routing.kvhub``), in process: vLLM's own publisher, the hub reading it once, and
workers' ``KvRouting``s fed by the hub. A worker fed by the hub holds exactly the view of one that
reads the events itself (blocks per replica, the names prompts are looked up by), whether it
subscribed before the events or after them; connections that break the hub's rules are closed and the
others keep their feed; without a hub a worker reads the events itself."""

from __future__ import annotations

import asyncio
import time

import pytest
from derender.routing import kvhub
from derender.routing.kvfeed import Feed, FeedSpec, Standing
from derender.routing.kvroute import KvRouting
from derender.routing.prefix import BlockHasher
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from stack import until

REPLICAS = ("10.0.0.1:8000", "10.0.0.2:8000")


def stored(hashes: list[int], ids: list[int], parent: int | None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=ids, block_size=16, lora_id=None,
                       medium="GPU", lora_name=None)


def batches(hasher: BlockHasher, seed: int) -> list[KVEventBatch]:
    """A conversation's blocks stored in two runs (the second chained to the first), and one evicted."""
    from derender.routing.kvindex import external

    ids = [(seed * 7919 + i) % 150000 for i in range(16 * 6)]
    chain = [external(h) for h in hasher.chain(ids)]
    return [
        KVEventBatch(ts=time.time(), events=[stored(chain[:3], ids[:48], None)]),
        KVEventBatch(ts=time.time(), events=[stored(chain[3:], ids[48:], chain[2])]),
        KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[chain[5]], medium="GPU")]),
    ]


def view(kv: KvRouting) -> tuple:
    """What a worker routes by: each replica's blocks, by the keys a prompt finds them by."""
    index = kv.index
    return {r: sorted(b for b, owners in index.holders.items() if owners & bit) for r, bit in index.bits.items()}


@pytest.fixture()
def where(tmp_path):
    return tmp_path


def specs(where) -> list[FeedSpec]:
    return [FeedSpec(r, f"ipc://{where}/pub{i}", f"ipc://{where}/replay{i}", "kv") for i, r in enumerate(REPLICAS)]


async def serving_hub() -> tuple[kvhub.Hub, asyncio.Task, str]:
    """A hub on this loop, on its socket as ``derender serve`` makes it."""
    path, sock = kvhub.listen()
    hub = kvhub.Hub()
    return hub, asyncio.get_running_loop().create_task(hub.serve(sock)), path


def test_workers_fed_by_the_hub_hold_the_view_of_a_worker_that_reads_the_events_itself(where):
    """One worker subscribes before the events, one after (it gets the hub's copy, then the live
    batches); both equal a ``KvRouting`` reading the replicas itself, and the hub read each batch once."""

    async def run():
        hasher = BlockHasher()
        pubs = [ZmqEventPublisher(0, endpoint=s.endpoint, replay_endpoint=s.replay, topic="kv") for s in specs(where)]
        hub, serving, path = await serving_hub()
        early = KvRouting(hasher, specs(where), hub=path)
        late = KvRouting(hasher, specs(where), hub=path)
        alone = KvRouting(hasher, specs(where))
        try:
            early.start()
            alone.start()
            await until(lambda: len(hub.feeds) == 2, "the hub's feeds")
            await asyncio.sleep(0.5)  # subscribed (a batch lost before that is replayed all the same)
            sent = 0
            for seed in range(6):
                for pub in pubs:
                    for batch in batches(hasher, seed + 10 * pubs.index(pub)):
                        pub.publish(batch)
                        sent += 1
                if seed == 2:
                    await until(lambda s=sent: sum(f.next_seq or 0 for f in hub.feeds.values()) == s, "the hub")
                    late.start()
            await until(lambda: sum(f.next_seq or 0 for f in hub.feeds.values()) == sent, "the hub, every batch")
            await until(lambda: sum(f.next_seq or 0 for f in alone.feeds.values() if isinstance(f, Feed)) == sent,
                        "the worker reading alone")
            await until(lambda: view(early) == view(alone) and view(late) == view(alone), "the same view")
            held = view(alone)
            assert all(len(blocks) == 6 * 5 for blocks in held.values()), held  # 6 conversations x 5 blocks
            ids = [(3 * 7919 + i) % 150000 for i in range(16 * 6)]
            for kv in (early, late):
                assert kv.chain(ids, None, None, ()) == alone.chain(ids, None, None, ())
                assert kv.matches(kv.chain(ids, None, None, ())) == {REPLICAS[0]: 5}  # the sixth evicted
                assert all(isinstance(s, Standing) for s in kv.feeds.values())  # fed by the hub, no feed of its own
            assert len(hub.feeds) == 2  # the second worker's subscriptions share the first's feeds
        finally:
            for kv in (early, late, alone):
                await kv.stop()
            serving.cancel()
            for feed in hub.feeds.values():
                await feed.stop()
            for pub in pubs:
                pub.shutdown()

    asyncio.run(run())


def test_connections_that_break_the_rules_are_closed_and_the_others_keep_their_feed(where, monkeypatch):
    """Garbage, an oversized frame, silence, and a worker that never reads: each closed by the hub; a
    worker beside them gets every batch."""
    monkeypatch.setattr(kvhub, "SUBSCRIBE_S", 0.5)
    monkeypatch.setattr(kvhub, "MAX_UNREAD", 64 << 10)

    async def run():
        hasher = BlockHasher()
        spec = specs(where)[0]
        pub = ZmqEventPublisher(0, endpoint=spec.endpoint, replay_endpoint=spec.replay, topic="kv")
        hub, serving, path = await serving_hub()
        good = KvRouting(hasher, [spec], hub=path)
        try:
            good.start()
            await until(lambda: len(hub.feeds) == 1, "the hub's feed")
            closed: list[bytes] = []

            async def peer(data: bytes, read: bool = True) -> asyncio.StreamReader:
                reader, writer = await asyncio.open_unix_connection(path)
                writer.write(data)
                if read:
                    closed.append(await asyncio.wait_for(reader.read(), 5))  # the hub closes it
                return reader

            garbage = b"\x00\x00\x00\x05" + b"\xff" * 5
            oversized = (kvhub.MAX_SUBSCRIBE + 1).to_bytes(4, "big")
            wrong = kvhub.frame([("r", 1, None, "", 16)])  # not a subscription's shape
            subscription = kvhub.frame([(spec.replica, spec.endpoint, spec.replay, spec.topic, 16)])
            bad_load = subscription + kvhub.frame({spec.replica: "many"})
            big_load = subscription + (kvhub.MAX_LOAD + 1).to_bytes(4, "big")
            await asyncio.gather(peer(garbage), peer(oversized), peer(wrong), peer(b"\x00\x00"),  # that one: silent
                                 peer(bad_load), peer(big_load))
            # each read to its end: closed (the first four before any frame; the last two after the
            # hub's copy of the replica, sent once they subscribed)
            assert len(closed) == 6 and closed.count(b"") >= 4
            assert sum(len(subs) for subs in hub.subscribers.values()) == 1 and len(hub.loads) == 1
            # A worker that subscribes and never reads: past MAX_UNREAD bytes waiting, disconnected.
            slow_reader = await peer(subscription, read=False)
            big = [(1 << 40) + i for i in range(200)]
            for k in range(400):
                pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                    block_hashes=[big[k % 200] + k * 1000], parent_block_hash=None, token_ids=[k] * 16, block_size=16,
                    lora_id=None, medium="GPU", lora_name=None)]))
                if k % 50 == 0:
                    await asyncio.sleep(0.01)
            await until(lambda: sum(f.next_seq or 0 for f in hub.feeds.values()) == 400, "every batch at the hub")
            await until(lambda: all(s.closed for subs in hub.subscribers.values() for s in subs[1:]) or
                        sum(len(subs) for subs in hub.subscribers.values()) == 1, "the slow worker dropped")
            assert sum(len(subs) for subs in hub.subscribers.values()) == 1
            await until(lambda: len(good.index) == 400, "the good worker's every block")
            assert isinstance(good.feeds[spec.replica], Standing)  # still fed by the hub
            data = await asyncio.wait_for(slow_reader.read(), 5)  # what it got before the hub closed it
            assert len(data) < 64 << 20
        finally:
            await good.stop()
            serving.cancel()
            for feed in hub.feeds.values():
                await feed.stop()
            pub.shutdown()

    asyncio.run(run())


def test_each_worker_counts_the_other_workers_requests_in_flight_as_their_hub_reports_them(where):
    """kv-events' load bound counts a process's requests in flight, not one worker's: each worker
    reports its own to the hub, which sends each the sum of the others'; a worker gone counts no more."""
    from derender.routing.balance import Balancer, PrefixKey

    async def run():
        hasher = BlockHasher()
        hub, serving, path = await serving_hub()
        workers = [KvRouting(hasher, specs(where), hub=path) for _ in range(3)]
        balancers = [Balancer("kv-events", PrefixKey(hasher, ()), 1.25, kv) for kv in workers]
        try:
            for kv in workers:
                kv.start()
            await until(lambda: len(hub.loads) == 3, "three workers")
            balancers[0].in_flight[REPLICAS[0]] += 4
            balancers[1].in_flight[REPLICAS[0]] += 1
            balancers[1].in_flight[REPLICAS[1]] += 2
            await until(lambda: balancers[2].others == {REPLICAS[0]: 5, REPLICAS[1]: 2}, "the others' sum")
            await until(lambda: balancers[0].others == {REPLICAS[0]: 1, REPLICAS[1]: 2}, "the others' sum")
            # The bound now sees 7 requests in flight where worker 2 alone has none: one more on the
            # first replica would be 6 of 8 over 2 replicas, past 1.25 x the mean (5, rounded up).
            assert balancers[2]._over_bound(REPLICAS[0]) and not balancers[2]._over_bound(REPLICAS[1])
            await workers[1].stop()  # a worker gone: its requests count no more
            await until(lambda: balancers[2].others == {REPLICAS[0]: 4, REPLICAS[1]: 0}, "one worker's load")
        finally:
            for kv in workers:
                await kv.stop()
            serving.cancel()
            for feed in hub.feeds.values():
                await feed.stop()

    asyncio.run(run())


def test_without_its_hub_a_worker_reads_the_events_itself(where):
    """The hub cannot be reached (or its connection ends): the worker's own feeds learn the replica's
    history from its replay socket, and routing goes on from the events."""

    async def run():
        hasher = BlockHasher()
        spec = specs(where)[0]
        pub = ZmqEventPublisher(0, endpoint=spec.endpoint, replay_endpoint=spec.replay, topic="kv")
        for batch in batches(hasher, 1):
            pub.publish(batch)
        hub, serving, path = await serving_hub()
        kv = KvRouting(hasher, [spec], hub=path)
        try:
            kv.start()
            await until(lambda: len(kv.index) == 5, "the replica's blocks through the hub")
            serving.cancel()  # the hub goes; the connections it had end with it
            for feed in hub.feeds.values():
                await feed.stop()
            for subs in hub.subscribers.values():
                for s in subs:
                    s.close()
            await until(lambda: isinstance(kv.feeds[spec.replica], Feed), "the worker's own feed")
            for batch in batches(hasher, 2):
                pub.publish(batch)
            await until(lambda: len(kv.index) == 10, "both conversations' blocks, by its own feed")
            ids = [(2 * 7919 + i) % 150000 for i in range(16 * 6)]
            assert kv.matches(kv.chain(ids, None, None, ())) == {spec.replica: 5}
        finally:
            await kv.stop()
            pub.shutdown()
        nowhere = KvRouting(hasher, [spec], hub=str(where / "no-hub.sock"))
        nowhere.start()
        await until(lambda: isinstance(nowhere.feeds[spec.replica], Feed), "its own feed, with no hub to reach")
        await nowhere.stop()

    asyncio.run(run())
