"""Flow control (issue 45): while the producers are full, requests wait in the filter, by priority band
and fairly across API keys, bounded, and answered 429 (in each client's shape) when they cannot wait.

Real processes: simulators that schedule as vLLM does (``--max-num-seqs``: at most that many sequences
run, the rest wait in arrival order, ``/metrics`` with vLLM's gauges), the filter with
``--replica-capacity``, Envoy in front. What ran in which order is read from the simulator's own
scheduler (``/sim/stats``: requests started, ever; the most running at once) and the bodies it got."""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import openai
import pytest
from stack import (
    Proc,
    free_port,
    http_get,
    http_post,
    metric_total,
    start_envoy,
    start_filter,
    start_sim,
    until,
    wait_for,
)

CAPACITY = 8
METRICS_PORT = free_port()


def served(qwen3_dir: str, *flags: str) -> list[str]:
    return ["--model", qwen3_dir, "--served-model-name", "qwen3", "--max-model-len", "4096", "--workers", "1", *flags]


def stats(sim_url: str) -> dict:
    return json.loads(http_get(sim_url + "/sim/stats")[1])["scheduler"]


def received(sim_url: str) -> int:
    """Generate requests the simulator has received, ever."""
    return json.loads(http_get(sim_url + "/sim/stats")[1])["received"]


def arrivals(sim_url: str) -> list[tuple[int, str]]:
    """(arrival number, prompt text) of the simulator's last 400 generate requests."""
    from tokenizers import Tokenizer

    from derender.ops import assets

    global TOKENIZER
    if TOKENIZER is None:
        TOKENIZER = Tokenizer.from_file(str(assets.fetch("qwen3") / "tokenizer.json"))
    return [(n, TOKENIZER.decode(body["token_ids"])) for n, body in json.loads(http_get(sim_url + "/sim/numbered")[1])]


def arrival(sim_url: str, marker: str) -> int:
    """The arrival number of the last request whose prompt holds ``marker``."""
    return max(n for n, text in arrivals(sim_url) if marker in text)


TOKENIZER = None


def own(i: int) -> dict[str, str]:
    """A key of its own: the requests that fill the producer take the slots kept for keys with nothing
    in flight too (``--key-reserve``)."""
    return {"authorization": f"Bearer fill-{i}"}


def chat(text: str, **more) -> dict:
    return {"model": "qwen3", "messages": [{"role": "user", "content": text}], "max_tokens": 200, **more}


class Fleet:
    def __init__(self, qwen3_dir: str, sims: int = 1, sim_flags: tuple[str, ...] = (), flags: tuple[str, ...] = ()):
        self.procs: list[Proc] = []
        self.sims = []
        for _ in range(sims):
            proc, url = start_sim(qwen3_dir, *sim_flags)
            self.procs.append(proc)
            self.sims.append(url)
        self.filter, self.port = start_filter(served(qwen3_dir, *flags), ",".join(self.sims))
        self.procs.append(self.filter)
        envoy, self.base = start_envoy(self.port, self.sims[0], *self.sims[1:])
        self.procs.append(envoy)

    def config(self, **knobs) -> None:
        for url in self.sims:
            assert http_post(url + "/sim/config", knobs)[0] == 200

    def release(self) -> None:
        for url in self.sims:
            http_post(url + "/sim/release", {})

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture(scope="module")
def fleet(qwen3_dir):
    f = Fleet(qwen3_dir, sim_flags=("--max-num-seqs", str(CAPACITY), "--delay", "0.05"),
              flags=("--replica-capacity", str(CAPACITY), "--queue-size", "200", "--queue-timeout", "3",
                     "--saturation-interval", "0.1", "--metrics-port", str(METRICS_PORT)))
    yield f
    f.stop()


@pytest.fixture()
def knobs(fleet):
    fleet.config(hold_after=None, delay=0.05)
    yield fleet
    fleet.config(hold_after=None, delay=0.05)
    fleet.release()
    wait_for(lambda: stats(fleet.sims[0])["running"] == 0, "the simulator idle", 30)


async def first_chunk(client: httpx.AsyncClient, body: dict, key: str) -> float:
    """Seconds to the stream's first chunk with content; the rest is read to the end."""
    began = time.monotonic()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                             headers={"authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if first is None and '"content"' in line:
                first = time.monotonic() - began
    assert first is not None
    return first


def test_one_keys_flood_does_not_hold_back_another_keys_chats(knobs):
    """Key A floods: 200 streams, each sent again as it ends or is refused (7 run, the eighth slot kept
    for keys with nothing in flight; the rest wait in the filter); key B sends chats one at a time. Each
    of B's chats reaches the producer before any more of A's, where first come, first served would keep
    it behind the whole queue of A's; the queue holds at most half its size (200) of one key's requests
    and refuses A's past that at once.

    A's running streams are held after their eighth event (B's five-token chats end before theirs), so
    none of them ends while B's chats are measured: an A stream ending in that time would send the next
    queued A on, rightly, while B's request is still on its way to the filter, and the count would
    measure how long that way is on a busy machine, not the filter's order."""
    fleet = knobs
    fleet.config(hold_after=8)
    sim = fleet.sims[0]

    async def flooding(client: httpx.AsyncClient, i: int, stop: asyncio.Event) -> None:
        body = chat("flood " + "word " * (10 + 7 * i % 40))
        while not stop.is_set():
            try:
                await first_chunk(client, body, "key-a")
            except AssertionError:  # refused (its share of the queue full, or waited too long): again
                await asyncio.sleep(1.0)

    def light(marker: str) -> tuple[int, float]:
        """One of B's chats: how many of A's reached the producer between its sending and its own
        arrival there, and its time to first chunk."""
        before = received(sim)
        began = time.monotonic()
        with httpx.Client(base_url=fleet.base, timeout=60) as client, client.stream(
            "POST", "/v1/chat/completions", json=chat(marker, max_tokens=5, stream=True),
            headers={"authorization": "Bearer key-b"},
        ) as r:
            assert r.status_code == 200
            took = None
            for line in r.iter_lines():
                if took is None and line.startswith("data:"):
                    took = time.monotonic() - began
        assert took is not None
        return arrival(sim, marker) - before - 1, took

    async def run() -> tuple[list[int], list[float], list[int]]:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(base_url=fleet.base, timeout=120, limits=limits) as client:
            stop = asyncio.Event()
            flood = [asyncio.create_task(flooding(client, i, stop)) for i in range(200)]
            try:
                await until(lambda: stats(sim)["running"] == CAPACITY - 1, "the producer full but for the reserve")
                await asyncio.sleep(1.0)  # the rest of the flood in the filter's queue
                assert stats(sim)["running"] == CAPACITY - 1  # one key never takes the last slot
                ahead, ttft = [], []
                for i in range(5):  # on a thread of its own: the flood's loop does not delay B's requests
                    b, t = await asyncio.to_thread(light, f"light-{i}")
                    ahead.append(b)
                    ttft.append(t)
                over = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat("over"),
                                                          headers={"authorization": "Bearer key-a"})
                                              for _ in range(20)))
                return ahead, ttft, [r.status_code for r in over]
            finally:
                stop.set()
                for task in flood:
                    task.cancel()
                await asyncio.gather(*flood, return_exceptions=True)

    ahead, ttft, over = asyncio.run(run())
    assert ahead == [0] * 5, (ahead, ttft)  # the slot kept for keys with nothing in flight (--key-reserve)
    assert 429 in over  # past A's share of the queue: refused at once
    assert stats(sim)["peak"] <= CAPACITY


def test_a_higher_band_is_served_first(knobs):
    """Eight answers fill the producer and are held there; three requests that asked for a lower band
    (vLLM's ``priority`` 5) wait, then one of band 0; once all four wait in the filter's queue the
    answers go on, ending one at a time: the first room goes to band 0."""
    fleet = knobs
    fleet.config(delay=0.02, hold_after=1)
    waiting = f"http://127.0.0.1:{METRICS_PORT}/metrics"

    async def run() -> None:
        async with httpx.AsyncClient(base_url=fleet.base, timeout=60) as client:
            fill = [asyncio.create_task(client.post("/v1/chat/completions", json=chat("fill " + "word " * (20 + 10 * i)),
                                                    headers=own(i)))
                    for i in range(CAPACITY)]
            await asyncio.sleep(0)
            await until(lambda: stats(fleet.sims[0])["running"] == CAPACITY, "the producer full")
            late = []
            for i in range(3):
                late.append(asyncio.create_task(client.post("/v1/chat/completions", json=chat(f"batch-{i}", priority=5))))
                await asyncio.sleep(0.1)
            late.append(asyncio.create_task(client.post("/v1/chat/completions", json=chat("urgent-0"))))
            # what the order depends on: all four waiting before any room opens (not how fast they got here)
            await until(lambda: metric_total(waiting, "derender_queue_waiting_requests") == 4, "the four queued")
            fleet.config(hold_after=None)
            while not all(t.done() for t in fill):  # any held late in its first event goes on too
                fleet.release()
                await asyncio.sleep(0.1)
            answers = await asyncio.gather(*fill, *late)
            assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]

    asyncio.run(run())
    order = [m for _, text in arrivals(fleet.sims[0]) for m in ("batch-0", "batch-1", "batch-2", "urgent-0") if m in text]
    assert order[0] == "urgent-0", order


def test_a_client_that_leaves_while_queued_reaches_no_producer(knobs):
    fleet = knobs
    fleet.config(hold_after=1)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=fleet.base, timeout=60) as client:
            held = [asyncio.create_task(first_chunk(client, chat(f"held {i}"), f"held-{i}")) for i in range(CAPACITY)]
            await asyncio.sleep(0)
            await until(lambda: stats(fleet.sims[0])["running"] == CAPACITY, "the producer full")
            gone = asyncio.create_task(client.post("/v1/chat/completions", json=chat("gone-marker")))
            await asyncio.sleep(0.5)  # queued in the filter
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            await asyncio.sleep(0.5)
            fleet.config(hold_after=None)
            fleet.release()
            await asyncio.gather(*held)
            after = await client.post("/v1/chat/completions", json=chat("after-marker"))
            assert after.status_code == 200

    asyncio.run(run())
    texts = [text for _, text in arrivals(fleet.sims[0])]
    assert any("after-marker" in t for t in texts)
    assert not any("gone-marker" in t for t in texts)


def test_derender_queue_show_prints_what_waits(knobs):
    """While the producer is full (held), three requests wait: ``derender queue show`` reads the
    filter's metrics and says so, by band and key; the metrics count what became of them."""
    import subprocess
    import sys

    fleet = knobs
    fleet.config(hold_after=1)

    async def run() -> str:
        async with httpx.AsyncClient(base_url=fleet.base, timeout=60) as client:
            held = [asyncio.create_task(client.post("/v1/chat/completions", json=chat(f"held {i}", stream=True),
                                                    headers=own(i)))
                    for i in range(CAPACITY)]
            await until(lambda: stats(fleet.sims[0])["running"] == CAPACITY, "the producer full")
            waiting = [asyncio.create_task(client.post("/v1/chat/completions", json=chat(f"waits {i}"),
                                                       headers={"x-vllm-priority": "3"})) for i in range(3)]
            await asyncio.sleep(0.5)
            shown = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "derender.cli", "queue", "show", "--metrics",
                                 f"http://127.0.0.1:{METRICS_PORT}/metrics"], capture_output=True, text=True, timeout=60)
            fleet.config(hold_after=None)
            while not all(t.done() for t in held + waiting):
                fleet.release()
                await asyncio.sleep(0.1)
            assert shown.returncode == 0, shown.stderr
            return shown.stdout

    out = asyncio.run(run())
    assert "band 3  key anonymous: 3" in out, out
    assert "backend producer: load 8 of capacity 8" in out, out


def test_envoy_waits_for_a_queued_request_past_its_message_timeout(knobs):
    """Envoy gives the filter message_timeout (here 1 s) to answer each ext_proc message; a request
    that waits 2 s for room is still served: the filter asks Envoy to wait (override_message_timeout,
    within the config's max_message_timeout)."""
    fleet = knobs
    fleet.config(hold_after=1)
    envoy, base = start_envoy(fleet.port, fleet.sims[0], MESSAGE_TIMEOUT="1s")

    async def run() -> tuple[int, float]:
        async with httpx.AsyncClient(timeout=60) as client:
            held = [asyncio.create_task(client.post(fleet.base + "/v1/chat/completions",
                                                    json=chat(f"held {i}", stream=True), headers=own(i)))
                    for i in range(CAPACITY)]
            await until(lambda: stats(fleet.sims[0])["running"] == CAPACITY, "the producer full")
            began = time.monotonic()
            patient = asyncio.create_task(client.post(base + "/v1/chat/completions", json=chat("patient")))
            await asyncio.sleep(2.0)
            fleet.config(hold_after=None)
            while not all(t.done() for t in [*held, patient]):
                fleet.release()
                await asyncio.sleep(0.1)
            return patient.result().status_code, time.monotonic() - began

    try:
        status, took = asyncio.run(run())
    finally:
        envoy.stop()
    assert status == 200 and took >= 2.0


def test_a_request_that_waits_too_long_gets_429_in_its_clients_shape(knobs):
    """The producer full and held: the official SDKs' requests wait --queue-timeout (3 s), then get a
    429 they read as a rate limit, with Retry-After."""
    fleet = knobs
    fleet.config(hold_after=1)

    async def fill() -> list[asyncio.Task]:
        client = httpx.AsyncClient(base_url=fleet.base, timeout=60)
        tasks = [asyncio.create_task(client.post("/v1/chat/completions", json=chat(f"held {i}", stream=True),
                                                    headers=own(i)))
                 for i in range(CAPACITY)]
        await asyncio.sleep(0)
        return tasks

    async def run() -> None:
        tasks = await fill()
        await until(lambda: stats(fleet.sims[0])["running"] == CAPACITY, "the producer full")
        oai = openai.OpenAI(base_url=fleet.base + "/v1", api_key="k", max_retries=0, timeout=30)
        began = time.monotonic()
        with pytest.raises(openai.RateLimitError) as refused:
            await asyncio.to_thread(oai.chat.completions.create, model="qwen3",
                                    messages=[{"role": "user", "content": "too late"}])
        assert 2.5 < time.monotonic() - began < 15
        assert refused.value.response.headers.get("retry-after", "").isdigit()
        assert refused.value.body["type"] == "rate_limit_exceeded"  # OpenAI's error object
        ant = anthropic.Anthropic(base_url=fleet.base, api_key="k", max_retries=0, timeout=30)
        with pytest.raises(anthropic.RateLimitError) as refused_a:
            await asyncio.to_thread(ant.messages.create, model="qwen3", max_tokens=10,
                                    messages=[{"role": "user", "content": "too late"}])
        assert refused_a.value.body["type"] == "error" and refused_a.value.body["error"]["type"] == "rate_limit_error"
        fleet.config(hold_after=None)
        fleet.release()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


def test_the_simulator_schedules_as_vllm_and_reports_vllms_gauges(qwen3_dir):
    proc, url = start_sim(qwen3_dir, "--max-num-seqs", "2", "--delay", "0.05")
    try:
        http_post(url + "/sim/config", {"hold_after": 1})

        async def run() -> str:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 5}, "stream": True}
                tasks = [asyncio.create_task(client.post("/inference/v1/generate", json=body)) for _ in range(5)]
                await asyncio.sleep(0.5)
                page = (await client.get("/metrics")).text
                while not all(t.done() for t in tasks):  # each held as it starts: released in turn
                    http_post(url + "/sim/release", {})
                    await asyncio.sleep(0.1)
                assert all(t.result().status_code == 200 for t in tasks)
                return page

        page = asyncio.run(run())
        from derender.routing.saturation import parse

        assert parse(page.encode()) == (2.0, 3.0)
        assert "# TYPE vllm:num_requests_waiting gauge" in page and 'model_name="' in page
        assert stats(url)["peak"] == 2 and stats(url)["started"] == 5
    finally:
        proc.stop()


def test_two_filter_processes_share_the_producers_limit(qwen3_dir):
    """Two filters (one worker each, their own Envoy) in front of one producer whose own limit is far
    above the capacity: the first fills the capacity (its requests held); once the producer's /metrics
    has been read, the second filter's requests wait, where counting only its own it would have sent
    them; released, everything is answered and the producer never ran more than the capacity."""
    capacity = 4
    sim, sim_url = start_sim(qwen3_dir, "--max-num-seqs", "64", "--delay", "0.02")
    procs: list[Proc] = [sim]
    try:
        bases = []
        for _ in range(2):
            flt, port = start_filter(served(qwen3_dir, "--replica-capacity", str(capacity), "--saturation-interval",
                                            "0.05", "--queue-timeout", "60", "--key-reserve", "0"), sim_url)
            envoy, base = start_envoy(port, sim_url)
            procs += [flt, envoy]
            bases.append(base)
        http_post(sim_url + "/sim/config", {"hold_after": 1})

        async def run() -> list[int]:
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=100)) as client:
                first = [asyncio.create_task(client.post(bases[0] + "/v1/chat/completions", json=chat(f"first {i}")))
                         for i in range(capacity)]
                await until(lambda: stats(sim_url)["running"] == capacity, "the first filter's requests running")
                await asyncio.sleep(0.3)  # the producer's /metrics read by both filters
                second = [asyncio.create_task(client.post(bases[1] + "/v1/chat/completions", json=chat(f"second {i}")))
                          for i in range(3)]
                await asyncio.sleep(1.0)
                running = stats(sim_url)["running"]
                http_post(sim_url + "/sim/config", {"hold_after": None})
                while not all(t.done() for t in first + second):
                    http_post(sim_url + "/sim/release", {})
                    await asyncio.sleep(0.1)
                assert running == capacity  # the second filter's requests waited in it
                return [t.result().status_code for t in first + second]

        assert asyncio.run(run()) == [200] * (capacity + 3)
        assert stats(sim_url)["peak"] == capacity, stats(sim_url)
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_within_a_band_keys_take_turns_by_weight_and_bands_go_in_order():
    """The queue's order on its own (``routing.flow.Queue``): a key of weight 2 gets two turns for every
    one of a key of weight 1 while both wait, a key back after a pause is not owed the turns it missed,
    a lower band number goes first, and one key may hold at most half the queue."""
    from derender.routing.flow import Queue, Waiter

    async def run() -> None:
        queue = Queue(max_queued=100, max_bytes=1 << 20)
        for i in range(30):
            queue.push(Waiter("heavy", 0, 2.0, 10))
        for i in range(15):
            queue.push(Waiter("light", 0, 1.0, 10))
        order = [queue.pop().key for _ in range(30)]
        assert order.count("heavy") == 20 and order.count("light") == 10
        assert all(order[i : i + 3].count("heavy") == 2 for i in range(0, 30, 3))
        while queue.count:
            queue.pop()
        for _ in range(10):
            queue.push(Waiter("steady", 0, 1.0, 10))
        for _ in range(5):
            queue.pop()  # steady alone for a while: its turns run on
        queue.push(Waiter("returning", 0, 1.0, 10))
        queue.push(Waiter("returning", 0, 1.0, 10))
        nxt = [queue.pop().key for _ in range(4)]
        assert nxt == ["returning", "steady", "returning", "steady"]  # next at once, then turn about, no burst
        queue.push(Waiter("late-but-urgent", -1, 1.0, 10))
        assert queue.pop().key == "late-but-urgent"
        while queue.count:
            queue.pop()
        assert sum(queue.fits("one", 10) and (queue.push(Waiter("one", 0, 1.0, 10)) or True) for _ in range(80)) == 50
        assert queue.fits("another", 10) and not queue.fits("one", 10)

    asyncio.run(run())


def test_a_keys_priority_and_weight_come_from_the_budget_file():
    from derender.ops.quota.config import QuotaConfigError, parse

    config = parse({"redis": "redis://127.0.0.1:1/0", "keys": [
        {"name": "chat", "key": "k1", "priority": -1, "weight": 4},
        {"name": "batch", "key": "k2", "priority": 10}]}, "keys.yaml")
    chat_key, batch_key = sorted(config.keys.values(), key=lambda k: k.name)[::-1]
    assert (chat_key.name, chat_key.priority, chat_key.weight) == ("chat", -1, 4.0)
    assert (batch_key.priority, batch_key.weight) == (10, 1.0)
    for bad in ({"priority": 1.5}, {"weight": 0}, {"weight": -1}, {"priority": 5000}):
        with pytest.raises(QuotaConfigError):
            parse({"redis": "redis://127.0.0.1:1/0", "keys": [{"name": "x", "key": "k", **bad}]}, "keys.yaml")
