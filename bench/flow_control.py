"""One key's flood against another key's chats, with flow control and without (issue 45).

    .venv/bin/python bench/flow_control.py [--flood 200] [--chats 5] [--out bench/FLOW.md]

A simulator scheduling as vLLM does (``--max-num-seqs 8``: eight sequences run, the rest wait in arrival
order inside it), one event every 20 ms as a GPU decodes; the filter (one worker) and Envoy in front.
Key A keeps ``--flood`` streams open (each re-sent as it ends, or after what ``Retry-After`` says when
refused, as the SDKs retry); key B sends ``--chats`` chats one at a time. Reported: B's time to its first chunk alone (unloaded), and during A's flood with the filter's
flow control (``--replica-capacity 8``: the flood waits in the filter, fairly across keys) and without
(the flood waits inside the producer, first come first served).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import httpx  # noqa: E402
import procs  # noqa: E402

SEQS = 8
DELAY = 0.02
TOKENS = 100


class Refused(Exception):
    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after


async def first_chunk(client: httpx.AsyncClient, key: str, max_tokens: int) -> float:
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hello"}], "stream": True,
            "max_tokens": max_tokens}
    began = time.monotonic()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:  # 429: as the SDKs do, wait what Retry-After says
            await r.aread()
            raise Refused(float(r.headers.get("retry-after") or 1))
        async for line in r.aiter_lines():
            if first is None and line.startswith("data:"):
                first = time.monotonic() - began
    return first if first is not None else float("nan")


async def measure(base: str, flood: int, chats: int) -> tuple[list[float], list[float]]:
    """B's times to first chunk: alone, then during A's flood."""
    limits = httpx.Limits(max_connections=flood + 10, max_keepalive_connections=flood + 10)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        alone = [await first_chunk(client, "key-b", 5) for _ in range(chats)]
        stop = asyncio.Event()

        async def flooding() -> None:
            while not stop.is_set():
                try:
                    await first_chunk(client, "key-a", TOKENS)
                except Refused as refused:
                    await asyncio.sleep(refused.retry_after)
                except httpx.HTTPError:
                    await asyncio.sleep(1.0)

        tasks = [asyncio.create_task(flooding()) for _ in range(flood)]
        await asyncio.sleep(3.0)  # the flood in place: the producer full, the rest waiting
        loaded = [await first_chunk(client, "key-b", 5) for _ in range(chats)]
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return alone, loaded


def run(flow: bool, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    model_dir, script = procs.reasoning_script("flow", TOKENS)
    started: list[procs.Proc] = []
    serve = ["--served-model-name", "qwen3", "--workers", "1"]
    if flow:
        serve += ["--replica-capacity", str(SEQS), "--queue-size", str(args.flood + 50), "--queue-timeout", "120"]
    sim = [procs.PYTHON, "-m", "derender.cli", "sim", "--max-num-seqs", str(SEQS)]
    try:
        _, envoy = procs.start_stack(started, "flow", model_dir, script, serve, DELAY, sim=sim)
        return asyncio.run(measure(envoy.url, args.flood, args.chats))
    finally:
        for proc in reversed(started):
            proc.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=200)
    parser.add_argument("--chats", type=int, default=5)
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    rows = []
    for flow in (True, False):
        alone, loaded = run(flow, args)
        rows.append((flow, alone, loaded))
        print(f"flow control {'on' if flow else 'off'}: alone {statistics.median(alone) * 1000:.0f} ms, "
              f"during the flood {statistics.median(loaded) * 1000:.0f} ms", flush=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        "# One key's flood against another key's chats",
        "",
        f"{when}, `.venv/bin/python bench/flow_control.py --flood {args.flood} --chats {args.chats}`: one simulator "
        f"with `--max-num-seqs {SEQS}` (one event every {DELAY * 1000:.0f} ms, answers of {TOKENS} tokens), one filter "
        f"worker, Envoy. Key A keeps {args.flood} streams open; key B sends {args.chats} chats one at a time. "
        "Key B's time to its first chunk, ms:",
        "",
        "| filter | B alone, median | B during the flood, median | every chat during the flood | during / alone |",
        "|---|---:|---:|---|---:|",
    ]
    for flow, alone, loaded in rows:
        name = f"flow control (`--replica-capacity {SEQS}`)" if flow else "no flow control (the producer's own queue)"
        ratio = statistics.median(loaded) / statistics.median(alone)
        lines.append(f"| {name} | {statistics.median(alone) * 1000:.0f} | {statistics.median(loaded) * 1000:.0f} | "
                     f"{' / '.join(f'{x * 1000:.0f}' for x in loaded)} | {ratio:.1f}x |")
    procs.write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
