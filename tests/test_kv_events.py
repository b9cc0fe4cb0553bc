"""Routing from the producers' own KV cache events (issue 44): the simulator publishes as
``vllm serve --kv-events-config`` does (vLLM's publisher, types and hashes), and the filter, reading
those events, sends a prompt to the replica that holds it, whatever the consistent hash would say.
Where a request went is read from the simulators' counters and the filter's request log."""

from __future__ import annotations

import json
import re

import msgspec
import pytest
import zmq
from derender.ops import envoy_config
from derender.routing.kvindex import external
from derender.routing.prefix import BlockHasher
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from stack import (Proc, free_port, http_get, http_post, metric_total, start_cluster_envoy, start_filter, start_sim,
                   wait_for)

DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def events_config(pub: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                       "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"})


def start_publishing_sim(model_dir: str, cache_blocks: int = 4096, *more: str) -> tuple[Proc, str, int, int]:
    pub, replay = free_port(), free_port()
    proc, url = start_sim(model_dir, "--prefix-cache-blocks", str(cache_blocks), "--enable-prompt-tokens-details",
                          "--kv-events-config", events_config(pub, replay), *more)
    return proc, url, pub, replay


def replayed(replay: int, start: int = 0) -> list[tuple[int, KVEventBatch]]:
    """Every batch the publisher still holds from ``start``, asked of its replay socket as vLLM's
    subscribers ask (a DEALER; the answers end with seq -1)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    out = []
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        while dealer.poll(5000):
            _, topic, seq, payload = dealer.recv_multipart()
            seq_n = int.from_bytes(seq, "big", signed=True)
            if seq_n == -1:
                return out
            assert topic == b"kv"
            out.append((seq_n, DECODER.decode(payload)))
    finally:
        dealer.close(linger=0)
    raise AssertionError("the replay did not end")


def generate(url: str, ids: list[int], **more) -> dict:
    status, body = http_post(url + "/inference/v1/generate",
                             {"token_ids": ids, "sampling_params": {"max_tokens": 1}, **more}, timeout=30)
    assert status == 200, body
    return json.loads(body)


def test_the_simulator_publishes_vllms_events_with_the_filters_block_hashes(qwen3_dir):
    proc, url, _, replay = start_publishing_sim(qwen3_dir, 6, "--lora-modules", "my-lora=/adapters/sql")
    try:
        hasher = BlockHasher()  # vLLM's hash_block_tokens, sha256, vLLM's NONE_HASH
        first = list(range(1000, 1000 + 16 * 4 + 5))  # four full blocks and a partial one
        generate(url, first, cache_salt="tenant-a")
        batches = wait_for(lambda: len(b := replayed(replay)) >= 2 and b, "the first request's events")
        assert [seq for seq, _ in batches] == list(range(len(batches)))
        assert [type(e) for e in batches[0][1].events] == [AllBlocksCleared]  # a fresh start
        [stored] = batches[1][1].events
        assert isinstance(stored, BlockStored)
        chain = hasher.chain(first, "tenant-a")
        assert stored.block_hashes == [external(h) for h in chain]
        assert stored.parent_block_hash is None and stored.block_size == 16 and stored.token_ids == first[:64]
        assert stored.medium == "GPU" and stored.lora_name is None
        assert stored.extra_keys == [("tenant-a",), None, None, None]  # the salt on the first block, untagged

        # A prompt sharing the first two blocks (no salt: its chain differs from the start) and a
        # cache of six blocks: its four new blocks evict the oldest two of the first prompt's.
        second = first[:32] + list(range(5000, 5032))
        generate(url, second)
        batches = wait_for(lambda: len(b := replayed(replay)) >= 3 and b, "the second request's events")
        events = batches[2][1].events
        stored2 = [e for e in events if isinstance(e, BlockStored)]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert [h for e in stored2 for h in e.block_hashes] == [external(h) for h in hasher.chain(second)]
        assert removed == [external(h) for h in chain[:2]]

        # A LoRA adapter's request: its blocks keyed by the adapter's name and path, as vLLM keys them.
        generate(url, second, model="my-lora")
        batches = wait_for(lambda: len(b := replayed(replay)) >= 4 and b, "the adapter's request's events")
        lora_stored = [e for e in batches[3][1].events if isinstance(e, BlockStored)]
        assert [h for e in lora_stored for h in e.block_hashes] == [
            external(h) for h in hasher.chain(second, lora=("my-lora", "/adapters/sql"))
        ]
        assert {(e.lora_name, e.lora_id) for e in lora_stored} == {("my-lora", 1)}
        assert lora_stored[0].extra_keys == [("my-lora",)] * 4

        # vLLM's POST /reset_prefix_cache (as a restart empties the cache): all forgotten, AllBlocksCleared.
        generate(url, second)  # cached again, whole
        assert generate(url, second)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        before = len(replayed(replay))
        status, body = http_post(url + "/reset_prefix_cache", {})
        assert status == 200 and json.loads(body) == {"success": True}
        batches = wait_for(lambda: len(b := replayed(replay)) > before and b, "the reset's event")
        assert [[type(e) for e in batch.events] for _, batch in batches[before:]] == [[AllBlocksCleared]]
        assert generate(url, second)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        proc.stop()


def test_the_simulators_image_and_salt_keys_are_the_filters(tmp_path):
    """Images (content hash, placeholder offset and length) and a cache salt: the simulator's chain is
    the filter's, block for block (the filter's is vLLM's, tests/test_prefix_routing.py)."""
    from derender.sim.kvevents import KvEvents

    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/p"})
    events = KvEvents(config)
    try:
        ids = list(range(3000, 3000 + 16 * 6))
        media = [("a" * 64, 10, 20), ("b" * 64, 40, 30)]  # one across blocks 0-1, one across 2-4
        sim = [h for h, _, _ in events.chain(ids, "salt", media)]
        assert sim == BlockHasher().chain(ids, "salt", media=media)
    finally:
        events.shutdown()


class Fleet:
    """Three publishing simulators; Envoy + a filter with ``--routing kv-events`` (one or more pairs)."""

    def __init__(self, model_dir: str, sims: list[tuple[Proc, str, int, int]]) -> None:
        self.model_dir = model_dir
        self.sims = sims
        self.procs: list[Proc] = []
        self.bases: list[str] = []
        self.filters: list[Proc] = []
        self.metrics: list[int] = []
        self.workers: list[int] = []
        self.last_id: dict[str, str] = {}  # the last chat request's id, by the gateway it went through

    def add_gateway(self, workers: int = 1) -> str:
        urls = [url for _, url, _, _ in self.sims]
        events = ",".join(f"tcp://127.0.0.1:{pub}" for _, _, pub, _ in self.sims)
        replays = ",".join(f"tcp://127.0.0.1:{replay}" for _, _, _, replay in self.sims)
        metrics_port = free_port()
        flt, port = start_filter(["--model", self.model_dir, "--served-model-name", "qwen3", "--routing", "kv-events",
                                  "--kv-events", events, "--kv-events-replay", replays, "--kv-events-topic", "kv",
                                  "--workers", str(workers), "--metrics-port", str(metrics_port)], ",".join(urls))
        self.metrics.append(metrics_port)
        self.workers.append(workers)
        self.procs.append(flt)
        self.filters.append(flt)
        cluster = envoy_config.producer_cluster("producer", urls, "kv-events")
        envoy, base, admin = start_cluster_envoy(port, cluster, "kv-events")
        self.procs.append(envoy)

        def healthy() -> int:
            body = http_get(f"http://127.0.0.1:{admin}/clusters")[1].decode()
            return sum(1 for line in body.splitlines() if line.startswith("producer::") and line.endswith("healthy"))

        wait_for(lambda: healthy() == len(self.sims), "every replica healthy in Envoy", 30)
        self.bases.append(base)
        return base

    def caught_up(self) -> None:
        """Every filter has read every batch the simulators published (live or replayed)."""
        published = sum(json.loads(http_get(url + "/sim/stats")[1])["kv_event_batches"] for _, url, _, _ in self.sims)

        def read(port: int) -> float:
            return metric_total(f"http://127.0.0.1:{port}/metrics", "derender_kv_index_batches_total")

        # each worker's index takes every batch (the process's hub reads it once and relays it)
        for port, workers in zip(self.metrics, self.workers, strict=True):
            wait_for(lambda p=port, w=workers: read(p) >= published * w, "every worker's view of every batch")

    def received(self) -> list[int]:
        return [json.loads(http_get(url + "/sim/stats")[1])["received"] for _, url, _, _ in self.sims]

    def chat(self, base: str, messages: list[dict]) -> int:
        """The replica that served one chat request (by the simulators' counters)."""
        before = self.received()
        status, body = http_post(base + "/v1/chat/completions",
                                 {"model": "qwen3", "messages": messages, "max_tokens": 8}, timeout=60)
        assert status == 200, body
        self.last_id[base] = json.loads(body)["id"]
        after = self.received()
        [served] = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b == a + 1]
        return served

    def route_of(self, flt: Proc, base: str) -> dict:
        """The log line of the last request sent to ``base`` (served by ``flt``): written when its ext_proc
        stream ends, which can come after the client has its answer, and after later requests' lines."""
        wanted = self.last_id[base]
        return wait_for(lambda: next((r for r in self.routes(flt) if r.get("request_id") == wanted), None),
                        f"the log line of {wanted}")  # fmt: skip

    def last_prompt(self, replica: int) -> list[int]:
        return json.loads(http_get(self.sims[replica][1] + "/sim/requests")[1])[-1]["token_ids"]

    def routes(self, flt: Proc) -> list[dict]:
        return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in flt.log.read_text().splitlines() if " route=" in line]

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        for p, *_ in self.sims:
            p.stop()


@pytest.fixture(scope="module")
def fleet(qwen3_dir):
    fleet = Fleet(qwen3_dir, [])
    try:
        for _ in range(3):
            fleet.sims.append(start_publishing_sim(qwen3_dir, cache_blocks=64))
        fleet.add_gateway()
        yield fleet
    finally:
        fleet.stop()


def question(n: int) -> list[dict]:
    return [{"role": "system", "content": "You answer questions about the weather. " * 6},
            {"role": "user", "content": f"Question {n}: " + "what is the weather like in Paris today? " * 12}]


def test_a_prompt_goes_to_the_replica_whose_events_say_it_holds_it(fleet):
    base = fleet.bases[0]
    messages = question(1)
    first = fleet.chat(base, messages)  # nothing known: the consistent hash places it
    prompt = fleet.last_prompt(first)
    # Another gateway's traffic puts the same prompt on a second replica, and the first one evicts it
    # (its cache holds 64 blocks): only the second replica's events say it holds the prompt.
    other = (first + 1) % 3
    generate(fleet.sims[other][1], prompt)
    generate(fleet.sims[first][1], list(range(20000, 20000 + 16 * 70)))
    flt = fleet.filters[0]
    fleet.caught_up()  # the events cross a ZMQ socket to the filter's worker
    again = fleet.chat(base, messages)
    assert again == other, (first, other, again)
    route = wait_for(lambda: len(r := fleet.routes(flt)) >= 2 and r[-1], "the second request's log line")
    assert route["route"] == "match" and int(route["matched_blocks"]) == len(prompt) // 16, route
    assert route["replica"] == f"127.0.0.1:{fleet.sims[other][1].rsplit(':', 1)[1]}", route
    # The prediction, beside what the replica found cached (its usage, --enable-prompt-tokens-details).
    predicted = metric_total(f"http://127.0.0.1:{fleet.metrics[0]}/metrics",
                             "derender_routed_predicted_cached_tokens_total", route="match")
    assert predicted == (len(prompt) // 16) * 16
    text = http_get(f"http://127.0.0.1:{fleet.metrics[0]}/metrics")[1].decode()
    lag = [line for line in text.splitlines() if line.startswith("derender_kv_events_lag_seconds{")]
    assert len(lag) == 3 and all(0 <= float(line.rsplit(" ", 1)[1]) < 60 for line in lag), lag


def test_two_filter_processes_fed_the_same_events_choose_alike(fleet):
    """A second filter, started later with two workers (each its own process and subscription), reads
    the same events (the history from the replay socket): every process sends a prompt to the one
    replica holding it, which the hash would not pick."""
    second = fleet.bases[1] if len(fleet.bases) > 1 else fleet.add_gateway(workers=2)
    first = fleet.bases[0]
    for n in range(10, 13):
        messages = question(n)
        placed = fleet.chat(first, messages)  # where the hash puts it
        prompt = fleet.last_prompt(placed)
        elsewhere = (placed + 2) % 3
        generate(fleet.sims[elsewhere][1], prompt)
        generate(fleet.sims[placed][1], list(range(40000 + n * 2000, 40000 + n * 2000 + 16 * 70)))  # evicted there
        fleet.caught_up()
        assert fleet.chat(first, messages) == elsewhere, n
        assert fleet.chat(second, messages) == elsewhere, n
    for flt, base in zip(fleet.filters, (first, second)):
        route = fleet.route_of(flt, base)
        assert route["route"] == "match", route
    # Envoy's one connection reaches one of the second filter's workers; the other holds the same view.
    fleet.caught_up()
    text = http_get(f"http://127.0.0.1:{fleet.metrics[1]}/metrics")[1].decode()
    sizes = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("derender_kv_index_blocks{")]
    assert len(sizes) == 2 and sizes[0] == sizes[1] > 0, sizes


def test_one_hub_per_filter_process_reads_each_batch_once_and_without_it_the_workers_read_them(fleet):
    """A filter process of two workers has one reader of the events (its hub, a process of its own):
    it reads each batch once and both workers' indexes take every batch. With the hub killed, each
    worker reads the events itself (the history from the replay sockets) and routing by the events
    goes on."""
    import os
    import signal

    second = fleet.bases[1] if len(fleet.bases) > 1 else fleet.add_gateway(workers=2)
    flt, port = fleet.filters[1], fleet.metrics[1]
    fleet.caught_up()
    published = sum(json.loads(http_get(url + "/sim/stats")[1])["kv_event_batches"] for _, url, _, _ in fleet.sims)

    def read() -> float:  # batches read from the replicas' sockets, in every process of the filter
        return sum(metric_total(f"http://127.0.0.1:{port}/metrics", "derender_kv_events_batches_total", outcome=o)
                   for o in ("received", "replayed"))

    assert read() == published  # by the hub alone, once
    assert metric_total(f"http://127.0.0.1:{port}/metrics", "derender_kv_index_batches_total") >= 2 * published
    hub = int(re.search(r"kv-events hub \(pid (\d+)\)", flt.log.read_text()).group(1))
    os.kill(hub, signal.SIGKILL)
    wait_for(lambda: flt.log.read_text().count("this worker reads the producers' events itself") == 2,
             "both workers on their own feeds")
    before = read()
    # Their own feeds have read the history (each worker all of it), and what comes next.
    messages = question(30)
    placed = fleet.chat(second, messages)
    prompt = fleet.last_prompt(placed)
    elsewhere = (placed + 1) % 3
    generate(fleet.sims[elsewhere][1], prompt)
    generate(fleet.sims[placed][1], list(range(90000, 90000 + 16 * 70)))  # evicted there
    published = sum(json.loads(http_get(url + "/sim/stats")[1])["kv_event_batches"] for _, url, _, _ in fleet.sims)
    wait_for(lambda: read() >= before + 2 * published, "each worker's own feeds, every batch")
    assert fleet.chat(second, messages) == elsewhere
    route = fleet.route_of(flt, second)
    assert route["route"] == "match", route
