"""Context switches and CPU per token at production pacing: the filter's stack and vLLM's coupled server.

    .venv/bin/python bench/switches.py [--api chat|messages|responses] [--rounds 3] [--out -]

One paced stack as ``bench/run.py`` starts it (the simulator, ``derender serve`` with the default
flags behind Envoy on a Unix socket), then vLLM's coupled API server (``bench/coupled_vllm.py``)
paced the same, each given ``--rounds`` batches of ``--streams`` concurrent qwen3 + hermes streams
of ``--tokens`` tokens (one token per event, ``--delay`` apart). Over those batches, for each
process: CPU per token (user + system, every thread) and context switches per token, voluntary
(the process slept: a wake-up) and involuntary (it was preempted), summed over its threads from
``/proc/PID/task/*/status``. The simulator stands in for a producer on another host; its row shows
what else shares the cores with the filter. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from pathlib import Path

import psutil

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import load
import procs
import streams
from stream_interval import HERMES


def switches(pids: list[int]) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of every thread of ``pids`` so far."""
    voluntary = involuntary = 0
    for pid in pids:
        for status in Path(f"/proc/{pid}/task").glob("*/status"):
            try:
                text = status.read_text()
            except OSError:  # a thread that ended meanwhile
                continue
            for line in text.splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    voluntary += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    involuntary += int(line.split()[1])
    return voluntary, involuntary


def measure(url: str, body: bytes, named: dict[str, list[psutil.Process]], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """``args.rounds`` batches of streams at ``url``; per group of processes: CPU and switches per token."""
    asyncio.run(load.streams(url, body, args.streams, args.streams, ramp=1.0))  # warm-up
    pids = {name: [p.pid for p in group] for name, group in named.items()}
    cpu0 = {name: sum(procs.cpu_of(p) for p in group) for name, group in named.items()}
    sw0 = {name: switches(pids[name]) for name in named}
    tokens = 0
    for _ in range(args.rounds):
        done, _ = asyncio.run(load.streams(url, body, args.streams, args.streams, ramp=1.0))
        tokens += args.tokens * sum(1 for s in done if s.done)
    out = {}
    for name, group in named.items():
        cpu = sum(procs.cpu_of(p) for p in group) - cpu0[name]
        voluntary, involuntary = (b - a for a, b in zip(sw0[name], switches(pids[name]), strict=True))
        out[name] = {"cpu_us": cpu / tokens * 1e6, "voluntary": voluntary / tokens, "involuntary": involuntary / tokens}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    procs.paced_options(parser, tokens=100, rounds=3, rounds_help="batches of --streams measured (default 3)")
    args = parser.parse_args()
    procs.exit_on_sigterm()
    model_dir, script = procs.reasoning_script("switches", args.tokens)
    body = streams.api_body(args.api)
    started: list[procs.Proc] = []
    try:
        serve = ["--served-model-name", "qwen3", "--max-model-len", "40960", *HERMES]
        server, envoy = procs.start_stack(started, "switches", model_dir, script, serve, args.delay)
        filtered = measure(envoy.url + streams.API_PATHS[args.api], body,
                           {"filter workers": server.workers(), "Envoy": envoy.proc.tree(), "simulator": started[0].tree()}, args)
        for proc in reversed(started):
            proc.stop()
        started.clear()
        coupled, base = procs.start_coupled(started, "switches-coupled", model_dir, script, HERMES, args.delay)
        direct = measure(base + streams.API_PATHS[args.api], body, {"vLLM coupled server": coupled.tree()}, args)
    finally:
        for proc in reversed(started):
            proc.stop()
    lines = [
        "# Context switches and CPU per token at production pacing",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, `.venv/bin/python bench/switches.py --api "
        f"{args.api} --streams {args.streams} --tokens {args.tokens} --delay {args.delay} --rounds {args.rounds}`: "
        f"{args.rounds} batches of {args.streams} concurrent qwen3 + hermes {args.api} streams of {args.tokens} tokens, "
        f"one token per event every {args.delay * 1e3:.0f} ms, through Envoy and the filter (default flags), then vLLM's "
        "coupled server asked directly. Context switches summed over every thread of the process.",
        "",
        "| process | CPU us/token | voluntary switches /token | involuntary /token |",
        "|---|---:|---:|---:|",
    ]
    for name, row in {**filtered, **direct}.items():
        lines.append(f"| {name} | {row['cpu_us']:.0f} | {row['voluntary']:.2f} | {row['involuntary']:.2f} |")
    procs.write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
