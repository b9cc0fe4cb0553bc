"""A bounded soak on loopback: many concurrent streams for a while, through the real Envoy.

``DERENDER_SOAK_STREAMS`` streams (default 1000) run at the same time for
``DERENDER_SOAK_SECONDS`` (default 90): each slot starts a new stream as soon
as its last one ends, so the concurrency holds for the whole period. The
producer is the simulator in echo mode, pacing each event
(``DERENDER_SOAK_DELAY`` s, default 1.5) so the box is busy but not saturated
(two shared cores run the client, Envoy, the filter and the simulator).
Every stream must end with ``[DONE]``, finish_reason "stop" and exactly the
text of its own prompt (the tokenizer's round trip); none may stall; the
producer must have seen nearly all of them in flight at once; every filter
worker must have had its share (the kernel spreads Envoy's ext_proc
connections, 16 streams each at most, over them); the filter's and Envoy's memory must come back near
where they were after a warm-up round.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import psutil
import pytest
import yaml
from stack import Stack

STREAMS = int(os.environ.get("DERENDER_SOAK_STREAMS", "1000"))
SECONDS = float(os.environ.get("DERENDER_SOAK_SECONDS", "90"))
DELAY = float(os.environ.get("DERENDER_SOAK_DELAY", "1.5"))
STALL = 60.0  # a stream that gets nothing for this long is stuck
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda 🤖 你好 café".split()


@pytest.fixture(scope="module")
def soak_stack(qwen3_dir):
    # Two workers from the start (--workers auto would start one): the soak checks load spreads over them.
    s = Stack(qwen3_dir, ["--served-model-name", "qwen3", "--max-model-len", "4096", "--workers", "2"],
              ["--mode", "echo"]).start()
    yield s
    s.stop()


def footprint(pid: int) -> int:
    """RSS summed over a process tree (the filter's supervisor and its forked workers).

    RSS, not USS or PSS: the workers share the model with the supervisor copy-on-write,
    and pages that turn private when touched move USS/PSS without any new memory;
    RSS moves only with what the processes allocate or free.
    """
    root = psutil.Process(pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


@dataclass
class Tally:
    streams: int = 0
    tokens: int = 0
    failures: list[str] = field(default_factory=list)


async def one_stream(session: aiohttp.ClientSession, url: str, message: str, expected: str, tally: Tally) -> None:
    body = {"model": "qwen3", "messages": [{"role": "user", "content": message}], "stream": True,
            "stream_options": {"include_usage": True}}
    text, finish, usage, done = "", None, None, False
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                tally.failures.append(f"status {r.status}: {(await r.read())[:200]!r}")
                return
            async for raw in r.content:  # one SSE line at a time
                line = raw.decode().rstrip("\n")
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    tally.failures.append(f"error event: {event['error']}")
                    return
                for choice in event["choices"]:
                    text += choice["delta"].get("content") or ""
                    finish = choice["finish_reason"] or finish
                usage = event.get("usage") or usage
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        tally.failures.append(f"{type(exc).__name__}: {exc}")
        return
    if not done or finish != "stop" or text != expected:
        tally.failures.append(f"done={done} finish={finish} text={text!r} expected={expected!r}")
        return
    tally.streams += 1
    tally.tokens += usage["completion_tokens"]


async def run_slots(url: str, tok, slots: int, seconds: float, tally: Tally, stagger: float) -> None:
    """``slots`` streams at a time until ``seconds`` have passed (a slot finishes its last stream)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=STALL)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def slot(index: int) -> None:
            await asyncio.sleep(stagger * index / slots)
            rng = random.Random(index)
            k = 0
            while True:
                message = f"soak {index}.{k}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14)))
                expected = tok.decode(tok.encode(message, add_special_tokens=False).ids)
                await one_stream(session, url, message, expected, tally)
                k += 1
                if time.monotonic() >= end:
                    return

        await asyncio.gather(*(slot(i) for i in range(slots)))


def cpu_seconds(p: psutil.Process) -> float:
    times = p.cpu_times()
    return times.user + times.system


def envoy_allocated(admin: str) -> int:
    """Bytes Envoy's allocator has handed out and not had back (its admin /memory ``allocated``):
    unlike RSS, it falls when Envoy frees memory, which tcmalloc keeps for later."""
    return int(httpx.get(admin + "/memory", timeout=30).json()["allocated"])


def envoy_admin(proc) -> str:
    config = yaml.safe_load(Path(proc.argv[proc.argv.index("-c") + 1]).read_text())
    return f"http://127.0.0.1:{config['admin']['address']['socket_address']['port_value']}"


def in_flight(sim_url: str) -> int:
    """Requests the producer is generating now."""
    return len(httpx.get(sim_url + "/sim/stats", timeout=30).json()["running"])


def test_soak(soak_stack, qwen3_tokenizer):
    url = soak_stack.base_url + "/chat/completions"
    filter_pid = soak_stack.proc("filter").proc.pid
    envoy = psutil.Process(soak_stack.proc("envoy").proc.pid)
    admin = envoy_admin(soak_stack.proc("envoy"))
    workers = psutil.Process(filter_pid).children()
    assert len(workers) >= 2, "the filter runs one process: nothing to spread"

    # Warm-up: every worker has served, its caches are filled.
    soak_stack.sim_config(delay=0.05)
    warm = Tally()
    asyncio.run(run_slots(url, qwen3_tokenizer, 50, 0, warm, 1))
    assert not warm.failures, warm.failures[:5]
    time.sleep(3)
    baseline, envoy_baseline = footprint(filter_pid), envoy.memory_info().rss
    allocated_baseline = envoy_allocated(admin)
    cpu_before = [cpu_seconds(w) for w in workers]

    soak_stack.sim_config(delay=DELAY)
    tally = Tally()
    peak = [baseline, envoy_baseline, 0, allocated_baseline]  # filter RSS, Envoy RSS, in flight at the producer, Envoy allocated

    async def soak() -> None:
        async def sample() -> None:  # (reading /proc and the simulator in threads: the client loop keeps reading streams)
            loop = asyncio.get_running_loop()
            while True:
                peak[0] = max(peak[0], await loop.run_in_executor(None, footprint, filter_pid))
                peak[1] = max(peak[1], envoy.memory_info().rss)
                peak[2] = max(peak[2], await loop.run_in_executor(None, in_flight, soak_stack.sim_url))
                peak[3] = max(peak[3], await loop.run_in_executor(None, envoy_allocated, admin))
                await asyncio.sleep(2)

        task = asyncio.create_task(sample())
        try:
            # Hard bound: the period, plus time for the last streams to finish, plus slack.
            await asyncio.wait_for(run_slots(url, qwen3_tokenizer, STREAMS, SECONDS, tally, 10), SECONDS + 3 * STALL)
        finally:
            task.cancel()

    started = time.monotonic()
    asyncio.run(soak())
    duration = time.monotonic() - started

    # Nothing left behind at the producer; memory back near the baseline.
    stats = httpx.get(soak_stack.sim_url + "/sim/stats", timeout=10).json()
    aborted = httpx.get(soak_stack.sim_url + "/sim/aborted", timeout=10).json()
    cpu = [cpu_seconds(w) - before for w, before in zip(workers, cpu_before)]
    time.sleep(5)
    after, envoy_after, allocated_after = footprint(filter_pid), envoy.memory_info().rss, envoy_allocated(admin)
    report = (
        f"soak: {tally.streams} streams ({STREAMS} slots, at most {peak[2]} in flight at the producer, "
        f"{SECONDS:.0f} s of starts, {DELAY} s per event), {tally.tokens} tokens, {duration:.0f} s; "
        f"worker CPU {', '.join(f'{c:.1f}' for c in cpu)} s; filter RSS baseline {baseline >> 20} MiB, "
        f"peak {peak[0] >> 20} MiB, after {after >> 20} MiB; Envoy RSS {envoy_baseline >> 20} MiB, "
        f"peak {peak[1] >> 20} MiB, after {envoy_after >> 20} MiB; Envoy allocated {allocated_baseline >> 20} MiB, "
        f"peak {peak[3] >> 20} MiB, after {allocated_after >> 20} MiB; failures {len(tally.failures)}"
    )
    print("\n" + report)
    (soak_stack.proc("filter").log.parent / "soak-report.txt").write_text(report + "\n")
    assert not tally.failures, tally.failures[:10]
    assert tally.streams >= STREAMS  # every slot completed at least one stream
    assert stats["running"] == {}, "producer requests still running after every client finished"
    assert aborted == [], "a stream was cut although every client read to the end"
    assert peak[2] >= 0.9 * STREAMS, f"the streams were not concurrent: {report}"
    assert min(cpu) >= 0.25 * max(cpu), f"one worker got most of the streams: {report}"
    assert after - baseline <= max(64 << 20, (peak[0] - baseline) // 4), report
    # Envoy keeps its idle connections to the filter and the producer pooled (one per stream
    # that ran at once): about half of the peak stays allocated (56 of 115 MiB measured).
    assert allocated_after - allocated_baseline <= max(16 << 20, (peak[3] - allocated_baseline) * 3 // 4), report
