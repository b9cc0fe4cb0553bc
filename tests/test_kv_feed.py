"""A replica's KV events as the filter reads them (``routing.kvfeed``), in process, against vLLM's own
publisher (``ZmqEventPublisher``) and against publishers that break the rules: a gap filled from the
replay socket, a restart, malformed, oversized and flooding publishers, a replica gone silent, the
index's bound. The worker's loop keeps its pace through every one of them."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
from derender.ops import kvmetrics, metrics  # noqa: F401 (kvmetrics: its series in the registry)
from derender.routing.kvfeed import Feed, FeedSpec
from derender.routing.kvindex import KvIndex
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from stack import until

REPLICA = "10.0.0.1:8000"


def stored(*hashes: int) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                                                            token_ids=[1] * 16 * len(hashes), block_size=16,
                                                            lora_id=None, medium="GPU", lora_name=None)])


def removed(*hashes: int) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=list(hashes), medium="GPU")])


def counted(outcome: str, why: str = "") -> float:
    labels = {"replica": REPLICA, "outcome": outcome, "why": why}
    return metrics.REGISTRY.get_sample_value("derender_kv_events_batches_total", labels) or 0.0


@pytest.fixture()
def sockets(tmp_path):
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


def test_a_gap_is_filled_from_the_replay_socket_and_a_restart_forgets(sockets):
    pub_at, replay_at = sockets

    async def run():
        publisher = ZmqEventPublisher(0, endpoint=pub_at, replay_endpoint=replay_at, topic="kv")
        index = KvIndex()
        feed = Feed(FeedSpec(REPLICA, pub_at, replay_at, "kv"), index)
        try:
            for h in range(1, 6):  # published before anyone subscribed: lost on the PUB socket
                publisher.publish(stored(h))
            publisher.publish(removed(2))
            await asyncio.sleep(0.3)
            feed.start()
            # Live batches from seq 6 on, until one arrives (the subscription takes a moment): the
            # first that does brings batches 0-5 from the replay socket.
            k = 6
            while not any(h >= 6 for h in index.holders):
                publisher.publish(stored(k))
                k += 1
                await asyncio.sleep(0.05)
            await until(lambda: feed.next_seq == k, "every live batch")
            assert set(index.holders) == {1, 3, 4, 5, *range(6, k)}
        finally:
            publisher.shutdown()
        # The replica restarts: its sequence numbers begin again; what it held is forgotten.
        publisher = ZmqEventPublisher(0, endpoint=pub_at, replay_endpoint=replay_at, topic="kv")
        try:
            publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
            k = 42
            while 42 not in index.holders:  # until the subscriber is back: seq 0 and 1 by replay if missed
                publisher.publish(stored(k))
                k += 1
                await asyncio.sleep(0.05)
            await until(lambda: feed.next_seq == k - 41, "every batch of the restarted replica")
            assert set(index.holders) == set(range(42, k))
        finally:
            await feed.stop()
            publisher.shutdown()

    asyncio.run(run())


def test_broken_publishers_are_dropped_and_the_loop_keeps_its_pace(sockets):
    pub_at, _ = sockets

    async def run():
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        pub.bind(pub_at)
        index = KvIndex()
        feed = Feed(FeedSpec(REPLICA, pub_at, None, "kv"), index, max_bytes=4096, max_rate=500)
        ticks: list[float] = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        clock = asyncio.get_running_loop().create_task(ticker())
        malformed, flood = counted("dropped", "malformed"), counted("dropped", "flood")
        try:
            feed.start()
            encode = msgspec.msgpack.Encoder().encode
            while 0 not in index.holders:  # until the subscription is made
                pub.send_multipart((b"kv", (0).to_bytes(8, "big"), encode(stored(0))))
                await asyncio.sleep(0.05)
            pub.send_multipart((b"kv", (1).to_bytes(8, "big")))  # two frames
            pub.send_multipart((b"kv", (1).to_bytes(8, "big"), b"\x93not a batch"))
            pub.send_multipart((b"kv", b"\x01", encode(stored(9))))  # a short sequence number
            pub.send_multipart((b"kv", (1).to_bytes(8, "big"), encode(stored(1))))
            await until(lambda: 1 in index.holders, "the valid batch after the broken ones")
            assert counted("dropped", "malformed") - malformed == 3
            # Oversized: ZMQ drops the message and the connection (MAXMSGSIZE); a new one is made.
            disconnected = counted("dropped", "disconnected")
            pub.send_multipart((b"kv", (2).to_bytes(8, "big"), encode(stored(*range(100, 2000)))))
            await until(lambda: counted("dropped", "disconnected") > disconnected, "the dropped connection")
            seq = 3
            while 2 not in index.holders:
                pub.send_multipart((b"kv", seq.to_bytes(8, "big"), encode(stored(2))))
                seq += 1
                await asyncio.sleep(0.05)
            assert 100 not in index.holders
            # A flood: past 500 batches a second the replica leaves the index, its feed rests.
            gaps_before = len(ticks)
            for seq in range(seq, seq + 3000):
                pub.send_multipart((b"kv", seq.to_bytes(8, "big"), encode(stored(seq + 10_000))))
            await until(lambda: not feed.in_index, "the flood noticed")
            assert counted("dropped", "flood") - flood == 1
            assert not index.holders, "the flooding replica's blocks stay known"
            await asyncio.sleep(0.3)
            assert len(ticks) > gaps_before
            late = max(b - a for a, b in zip(ticks[gaps_before:], ticks[gaps_before + 1 :], strict=False))
            assert late < 0.5, f"the loop stalled {late:.2f} s"
        finally:
            clock.cancel()
            await feed.stop()
            pub.close(linger=0)

    asyncio.run(run())


def test_a_replica_that_serves_and_publishes_nothing_leaves_the_index_until_it_publishes():
    index = KvIndex()
    feed = Feed(FeedSpec(REPLICA, "ipc:///nowhere", None), index, stale_s=5)
    index.stored(REPLICA, [1, 2, 3])
    now = time.monotonic()
    feed.check(now + 100)  # idle: publishing nothing is no sign of anything
    assert feed.in_index and index.match([1, 2, 3], now) == {REPLICA: 3}
    feed.expect(now)  # a request with new blocks went there
    feed.check(now + 4)
    assert feed.in_index
    feed.check(now + 6)
    assert not feed.in_index and index.match([1, 2, 3], now) == {}
    feed._apply(msgspec.msgpack.Encoder().encode(stored(7)), "received")  # its events come again
    assert feed.in_index and index.match([7], now) == {REPLICA: 1}


def test_the_index_is_bounded_and_predictions_expire():
    index = KvIndex(max_blocks=100, predict_s=2.0)
    index.stored("a", range(100))
    index.stored("b", range(50, 60))
    assert len(index) <= 100 and 0 not in index.holders  # the oldest tenth forgotten
    assert index.match(list(range(50, 60)), 0.0) == {"a": 10, "b": 10}
    index.predict("c", [500, 501], now=10.0)
    assert index.match([500, 501, 502], 11.0) == {"c": 2}
    assert index.match([500, 501], 12.5) == {}  # past its 2 s
    index.predict("c", [600], now=20.0)
    index.removed("c", [600])  # evicted: no longer predicted either
    assert index.match([600], 20.5) == {}
    index.cleared("a")
    assert index.match(list(range(50, 60)), 0.0) == {"b": 10}


def test_a_prompt_is_named_from_the_events_tokens_as_vllm_hashes_it():
    """Plain prompts find the blocks replicas stored by Python's chain of the events' own tokens (no
    sha256 on the request path): the index keys them by those names, a removal by vLLM's hash finds
    its name. A salted prompt is hashed vLLM's way, as its blocks are keyed."""
    from derender.routing.kvindex import external
    from derender.routing.kvroute import KvRouting
    from derender.routing.prefix import BlockHasher

    hasher = BlockHasher()
    kv = KvRouting(hasher, [FeedSpec(REPLICA, "ipc:///nowhere")])
    ids = list(range(7000, 7000 + 16 * 6 + 3))
    vllm = [external(h) for h in hasher.chain(ids)]
    assert len(kv.chain(ids, None, None, ())) == 6 and kv.matches(kv.chain(ids, None, None, ())) == {}  # nowhere yet
    for start, end in ((0, 2), (2, 5)):  # two events, the second chained to the first's last block
        kv.apply(REPLICA, [BlockStored(block_hashes=vllm[start:end], parent_block_hash=vllm[start - 1] if start else None,
                                       token_ids=ids[start * 16 : end * 16], block_size=16, lora_id=None,
                                       medium="GPU", lora_name=None)])
    chain = kv.chain(ids, None, None, ())
    assert kv.matches(chain) == {REPLICA: 5}  # the sixth block: stored nowhere
    assert kv.chain(ids[:40], None, None, ()) == chain[:2]
    other = ids[:16] + [1] * 16 + ids[32:]  # a block changed: the chain breaks there
    assert kv.chain(other, None, None, ())[:1] == chain[:1] and kv.matches(kv.chain(other, None, None, ())) == {
        REPLICA: 1}
    kv.started(REPLICA, chain, 5, 6)  # a request for the whole prompt reached it: the sixth predicted
    assert kv.matches(chain) == {REPLICA: 6}
    kv.index.predicted.clear()
    kv.apply(REPLICA, [BlockRemoved(block_hashes=[vllm[3]], medium="GPU")])  # by vLLM's hash: its name goes
    assert kv.matches(kv.chain(ids, None, None, ())) == {REPLICA: 3}
    salted = [external(h) for h in hasher.chain(ids, "salt")]
    assert kv.chain(ids, "salt", None, ()) == salted
    kv.apply(REPLICA, [BlockStored(block_hashes=salted[:2], parent_block_hash=None, token_ids=ids[:32],
                                   block_size=16, lora_id=None, medium="GPU", lora_name=None,
                                   extra_keys=[("salt",), None])])
    assert kv.matches(kv.chain(ids, "salt", None, ())) == {REPLICA: 2}
