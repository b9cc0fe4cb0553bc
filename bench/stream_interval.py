"""`--stream-interval N` at production pacing: what fewer, larger producer events save, and cost.

    .venv/bin/python bench/stream_interval.py                  # 1, 2, 4, 8; writes bench/STREAM_INTERVAL.md
    .venv/bin/python bench/stream_interval.py --intervals 1 4 --streams 16 --out -   # a quick look
    .venv/bin/python bench/stream_interval.py --intervals 1 --stream-paths lean vllm --rounds 5 --out -

One simulator paced like a decoding GPU (``--delay`` per engine step, one token a step; with
``stream_interval`` N it sends an event every N steps, grouped as vLLM's output processor groups
them), and one filter per interval (``--reasoning-parser qwen3 --tool-call-parser hermes``,
``--stream-interval N``) behind its own Envoy 1.40 (``bench/procs.py``'s config). Every stream is
the benchmark's Qwen3 reasoning + hermes tool call of ``--tokens`` tokens. The intervals are measured
one after the other, in rounds (each round runs every interval once), and each figure is the median
over the rounds: CPU per token of Envoy + the filter (their process trees), ext_proc messages per
token (Envoy's counters), the gap between a client's reads (what a user sees as the text's
cadence), and time to the first token.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import load
import procs
import streams

HERMES = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]


def measure(envoy: procs.Envoy, server: procs.Proc, body: bytes, count: int, tokens: int) -> dict:
    cpu0 = server.cpu() + envoy.proc.cpu()
    stats0 = envoy.stats()
    results, wall = asyncio.run(load.streams(envoy.url + "/v1/chat/completions", body, count, count, ramp=1.0))
    cpu = server.cpu() + envoy.proc.cpu() - cpu0
    stats1 = envoy.stats()
    total = count * tokens
    gaps = [b - a for r in results for a, b in zip(r.reads, r.reads[1:])]
    return {
        "failed": sum(1 for r in results if r.status != 200 or not r.done),
        "cpu_us_per_token": cpu / total * 1e6,
        "msgs_per_token": (stats1.get("stream_msgs_sent", 0) - stats0.get("stream_msgs_sent", 0)) / total,
        "gap_ms_p50": statistics.median(gaps) * 1e3 if gaps else None,
        "ttft_ms_p50": statistics.median(r.ttft for r in results if r.ttft is not None) * 1e3,
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams (default 64)")
    parser.add_argument("--tokens", type=int, default=250, help="tokens per stream (default 250)")
    parser.add_argument("--delay", type=float, default=0.02, help="seconds per engine step (default 0.02)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stream-paths", nargs="+", default=["lean"], choices=("lean", "vllm"),
                        help="the filters' --stream-path: one filter per interval and path (default lean)")
    parser.add_argument("--workers", type=int, default=2, help="processes per filter (default 2)")
    parser.add_argument("--out", default=str(BENCH / "STREAM_INTERVAL.md"), help="the report ('-': stdout only)")
    args = parser.parse_args()
    procs.exit_on_sigterm()
    model_dir, script = procs.reasoning_script("stream-interval", args.tokens)
    model = ["--model", model_dir, "--served-model-name", "qwen3", "--max-model-len", "40960", *HERMES]
    started: list[procs.Proc] = []
    try:
        sim_port = procs.free_port()
        sim = procs.Proc("sim", [procs.PYTHON, "-m", "derender.cli", "sim", "--model", model_dir, "--port", str(sim_port),
                                 "--mode", "script", "--script", str(script)]).start()
        started.append(sim)
        sim.wait(lambda: procs.http_ok(f"http://127.0.0.1:{sim_port}/health"), 120)
        pairs = {}
        for n, path in [(n, path) for n in args.intervals for path in args.stream_paths]:
            port = procs.free_port()
            server = procs.Proc(f"filter-si{n}-{path}", [procs.PYTHON, "-m", "derender.cli", "serve", *model,
                                                         "--stream-interval", str(n), "--stream-path", path,
                                                         "--port", str(port),
                                                         "--producer", f"http://127.0.0.1:{sim_port}",
                                                         "--workers", str(args.workers)]).start()
            started.append(server)
            server.wait(lambda port=port: procs.tcp_open(port), 600)
            envoy = procs.start_envoy(f"envoy-si{n}-{path}", sim_port, port)
            started.append(envoy.proc)
            envoy.proc.wait(lambda e=envoy: procs.http_ok(f"http://127.0.0.1:{e.admin}/ready"), 60)
            pairs[(n, path)] = (envoy, server)
        body = json.dumps(streams.chat_request("qwen3", True)).encode()
        procs.post(f"http://127.0.0.1:{sim_port}/sim/config", {"delay": args.delay})
        for n, (envoy, server) in pairs.items():  # warm-up: every worker has served a stream
            measure(envoy, server, body, args.streams, args.tokens)
        rounds: dict[tuple[int, str], list[dict]] = {key: [] for key in pairs}
        for r in range(args.rounds):
            for (n, path), (envoy, server) in pairs.items():
                got = measure(envoy, server, body, args.streams, args.tokens)
                rounds[(n, path)].append(got)
                print(f"round {r + 1} interval {n} {path}: {got['cpu_us_per_token']:.0f} us/token, "
                      f"{got['msgs_per_token']:.2f} msgs/token, gap p50 {got['gap_ms_p50']:.1f} ms, "
                      f"ttft p50 {got['ttft_ms_p50']:.1f} ms, failed {got['failed']}", flush=True)
    finally:
        for proc in reversed(started):
            proc.stop()
    first = next(iter(rounds))
    base = statistics.median(x["cpu_us_per_token"] for x in rounds[first])
    lines = [
        "# `--stream-interval N` at production pacing",
        "",
        f"{datetime.date.today()}, `.venv/bin/python bench/stream_interval.py "
        f"--intervals {' '.join(map(str, args.intervals))} --streams {args.streams} --tokens {args.tokens} "
        f"--delay {args.delay} --rounds {args.rounds} --workers {args.workers} "
        f"--stream-paths {' '.join(args.stream_paths)}`: {args.streams} concurrent qwen3 + "
        f"hermes streams of {args.tokens} tokens, one token per engine step every {args.delay * 1e3:.0f} ms, "
        f"the producer sending an event every N tokens; medians of {args.rounds} interleaved rounds on this "
        "2-core machine (every process on the same cores).",
        "",
        "| N | --stream-path | Envoy + filter CPU us/token | vs the first row | ext_proc msgs/token | "
        "read gap p50 ms | TTFT p50 ms | failed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (n, path), got in rounds.items():
        med = {k: statistics.median(x[k] for x in got) for k in ("cpu_us_per_token", "msgs_per_token",
                                                                   "gap_ms_p50", "ttft_ms_p50")}
        lines.append(f"| {n} | {path} | {med['cpu_us_per_token']:.0f} | {med['cpu_us_per_token'] / base:.2f}x | "
                     f"{med['msgs_per_token']:.2f} | {med['gap_ms_p50']:.1f} | {med['ttft_ms_p50']:.1f} | "
                     f"{sum(x['failed'] for x in got)} |")
    procs.write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
