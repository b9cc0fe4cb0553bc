"""The saturation signal under load: event-loop busy ratio and lag as concurrent streams grow.

One filter (qwen3 + hermes, ``--workers`` processes, ``--metrics-port``) behind Envoy, the
simulator pacing each stream like a decoding GPU (one token per event, ``--delay`` s apart).
For each number of concurrent streams it runs streams for about ``--seconds`` and reports:
tokens per second (what the clients got against what the producer offered), the filter's CPU
per token, the gap between a stream's reads (p99: the latency the filter adds once it queues),
and what the metrics say meanwhile: ``derender_event_loop_busy_ratio`` per worker (the mean
over workers, sampled every second once the 10 s window is full of load) and the ticks'
lateness from ``derender_event_loop_lag_seconds`` (p50 / p99 from the histogram's buckets).

    .venv/bin/python bench/saturation.py [--levels 16,64,128,256,512] [--out bench/SATURATION.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import load  # noqa: E402
import procs  # noqa: E402
import streams  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

SERVED = "qwen3"
HERMES_FLAGS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
TOKENS = 100  # per stream


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    busy, buckets, count = {}, {}, 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "derender_event_loop_busy_ratio":
                busy[s.labels.get("pid", "0")] = s.value
            elif s.name == "derender_event_loop_lag_seconds_bucket":
                buckets[float(s.labels["le"])] = s.value
            elif s.name == "derender_event_loop_lag_seconds_count":
                count = s.value
    return {"busy": busy, "buckets": buckets, "count": count}


def quantile(before: dict, after: dict, q: float) -> float:
    """Upper bound of the bucket holding the ``q`` quantile of the ticks between two scrapes."""
    total = after["count"] - before["count"]
    if total <= 0:
        return float("nan")
    for le in sorted(after["buckets"]):
        if after["buckets"][le] - before["buckets"].get(le, 0.0) >= q * total:
            return le
    return float("inf")


def main() -> int:
    procs.exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="16,64,128,256,512", help="concurrent streams, comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0, help="about how long each level runs")
    parser.add_argument("--delay", type=float, default=0.02, help="seconds between a stream's events")
    parser.add_argument("--max-tokens", type=int, default=150_000, help="cap per level, past saturation")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default=None, help="markdown report (default: print only)")
    args = parser.parse_args()
    p = procs
    model_dir, script = p.reasoning_script("saturation", TOKENS)
    metrics_port = p.free_port()
    started: list[p.Proc] = []
    try:
        serve = ["--served-model-name", SERVED, "--max-model-len", "40960", *HERMES_FLAGS, "--workers", str(args.workers),
                 "--metrics-port", str(metrics_port)]
        flt, envoy = p.start_stack(started, "saturation", model_dir, script, serve, args.delay,
                                   sim=[p.PYTHON, str(BENCH / "timed_sim.py")])
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        url = envoy.url + "/v1/chat/completions"
        body = json.dumps(streams.chat_request(SERVED, True)).encode()
        asyncio.run(load.streams(url, body, 64, 64, ramp=0.5))  # warm-up: every worker has served
        time.sleep(11)  # the busy window forgets the warm-up
        rows = []
        for level in [int(x) for x in args.levels.split(",")]:
            per_stream = TOKENS * args.delay
            # About --seconds of streams if the filter keeps up; past saturation, at most
            # --max-tokens tokens (a minute or so here), never fewer than two rounds.
            count = max(2 * level, min(int(level * args.seconds / per_stream), args.max_tokens // TOKENS))
            samples: list[float] = []
            stop = threading.Event()
            began = time.monotonic()

            def sample() -> None:
                while not stop.wait(1.0):
                    if time.monotonic() - began >= 10.0:  # the window holds load only
                        busy = scrape(metrics_url)["busy"]
                        if busy:
                            samples.append(statistics.mean(busy.values()))

            before, cpu0 = scrape(metrics_url), flt.cpu()
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            results, wall = asyncio.run(load.streams(url, body, count, level, ramp=min(2.0, per_stream)))
            stop.set()
            sampler.join()
            after, cpu = scrape(metrics_url), flt.cpu() - cpu0
            failed = sum(1 for r in results if r.status != 200 or not r.done)
            gaps = sorted(b - a for r in results for a, b in zip(r.reads, r.reads[1:]))
            tokens = count * TOKENS
            row = {
                "streams": level,
                "offered_tokens_per_s": level / args.delay,
                "tokens_per_s": tokens / wall,
                "cpu_us_per_token": cpu / tokens * 1e6,
                "read_gap_p99_ms": gaps[int(0.99 * (len(gaps) - 1))] * 1e3 if gaps else float("nan"),
                "busy_ratio": statistics.median(samples) if samples else float("nan"),
                "busy_ratio_max": max(samples) if samples else float("nan"),
                "lag_p50_ms": quantile(before, after, 0.5) * 1e3,
                "lag_p99_ms": quantile(before, after, 0.99) * 1e3,
                "failed": failed,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for proc in reversed(started):
            proc.stop()
    text = markdown(rows, args)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "# Saturation: event-loop busy ratio and lag against concurrent streams",
        "",
        f"`{' '.join(['.venv/bin/python bench/saturation.py', *sys.argv[1:]])}`: one filter (qwen3 + hermes, "
        f"{args.workers} workers) behind Envoy on {os.cpu_count()} shared cores (client, Envoy, filter and simulator "
        f"on the same machine), streams of {TOKENS} tokens, one token per event every {args.delay * 1e3:.0f} ms. "
        "Offered: the tokens per second the producer would send if nothing waited. Busy ratio: "
        "`derender_event_loop_busy_ratio`, mean over workers, median (max) of 1 s samples once its 10 s window "
        "held only load. Lag: `derender_event_loop_lag_seconds`, the bucket bound holding the quantile.",
        "",
        "| concurrent streams | offered tokens/s | delivered tokens/s | filter CPU us/token | read gap p99 ms "
        "| busy ratio (max) | loop lag p50 / p99 ms | failed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['streams']} | {r['offered_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | {r['cpu_us_per_token']:.0f} "
            f"| {r['read_gap_p99_ms']:.0f} | {r['busy_ratio']:.2f} ({r['busy_ratio_max']:.2f}) "
            f"| {r['lag_p50_ms']:g} / {r['lag_p99_ms']:g} | {r['failed']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
