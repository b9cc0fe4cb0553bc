"""Per request and per token at production pacing: the filter's stack against vLLM's coupled server.

    .venv/bin/python bench/split.py [--api chat|messages|responses] [--lengths 60,300] [--rounds 5] [--out -]

A paced run's CPU per token mixes what a request costs once (the render, the first and last
events) with what every token costs; which side is ahead can depend on the stream's length. This
runs both stacks at once, idle but for the one being measured: the simulator, ``derender serve``
(the default flags) behind Envoy on a Unix socket, as ``bench/run.py`` starts them, and vLLM's
coupled API server (``bench/coupled_vllm.py``), both paced the same (one token per event, ``--delay``
apart). Each round runs ``--streams`` concurrent qwen3 + hermes streams of each of the two
``--lengths`` on each side, in an order that alternates by round. From a side's CPU per stream at
the two lengths (Envoy + every filter process; the coupled server's process), assumed to be
``request + length x token``, each round gives that side's cost per request and per token; the
report has every round's, their medians and the paired ratios (filter / coupled, within a round).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import procs
import streams
from stream_interval import HERMES


def cpu_per_stream(url: str, body: bytes, group: list[procs.Proc], count: int) -> float:
    """``count`` concurrent streams at ``url``; the CPU seconds ``group`` used per stream."""
    return sum(procs.streams_cpu(url, body, group, count)) / count


def split(short: int, long: int, cost_short: float, cost_long: float) -> tuple[float, float]:
    """(seconds per request, seconds per token) from a stream's cost at two lengths."""
    per_token = (cost_long - cost_short) / (long - short)
    return cost_short - short * per_token, per_token


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    procs.paced_options(parser, tokens=None, rounds=5)
    parser.add_argument("--lengths", default="60,300", help="two stream lengths in tokens (default 60,300)")
    args = parser.parse_args()
    short, long = sorted(int(n) for n in args.lengths.split(","))
    procs.exit_on_sigterm()
    model_dir, script = procs.reasoning_script("split", long)
    body = streams.api_body(args.api)
    path = streams.API_PATHS[args.api]
    scripts = {n: streams.script_line(streams.reasoning_tool_call(model_dir, n)) for n in (short, long)}
    started: list[procs.Proc] = []
    rows: list[dict[str, tuple[float, float]]] = []
    try:
        serve = ["--served-model-name", "qwen3", "--max-model-len", "40960", *HERMES]
        server, envoy = procs.start_stack(started, "split", model_dir, script, serve, args.delay)
        coupled, base = procs.start_coupled(started, "split-coupled", model_dir, script, HERMES, args.delay)
        # The simulator and the coupled server read the script on every request.
        sides = {"filter": (envoy.url + path, [server, envoy.proc]), "coupled": (base + path, [coupled])}
        for n in (short, long):  # warm-up: every path and length once
            script.write_text(scripts[n])
            for url, group in sides.values():
                cpu_per_stream(url, body, group, args.streams)
        for round_ in range(args.rounds):
            costs: dict[tuple[str, int], float] = {}
            order = [(side, n) for n in (short, long) for side in sides]
            for side, n in order if round_ % 2 == 0 else order[::-1]:
                script.write_text(scripts[n])
                url, group = sides[side]
                costs[side, n] = cpu_per_stream(url, body, group, args.streams)
            rows.append({side: split(short, long, costs[side, short], costs[side, long]) for side in sides})
            print(f"round {round_ + 1}: " + ", ".join(
                f"{side} {r * 1e3:.2f} ms/request + {t * 1e6:.1f} us/token" for side, (r, t) in rows[-1].items()), flush=True)
    finally:
        for proc in reversed(started):
            proc.stop()

    request_ratio = [row["filter"][0] / row["coupled"][0] for row in rows]
    token_ratio = [row["filter"][1] / row["coupled"][1] for row in rows]
    lines = [
        "# Per request and per token at production pacing",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, `.venv/bin/python bench/split.py --api "
        f"{args.api} --lengths {short},{long} --streams {args.streams} --delay {args.delay} --rounds {args.rounds}`: "
        f"{args.streams} concurrent qwen3 + hermes {args.api} streams of {short} and of {long} tokens, one token per event "
        f"every {args.delay * 1e3:.0f} ms, through Envoy and the filter (default flags; Envoy + filter CPU) and vLLM's "
        "coupled server asked directly, both stacks up at once and measured in turn. A side's CPU per stream at the two "
        "lengths, taken as request + length x token, gives its cost per request and per token in each round.",
        "",
        "| round | filter ms/request | filter us/token | coupled ms/request | coupled us/token | per request filter/coupled | per token filter/coupled |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, row in enumerate(rows, 1):
        (fr, ft), (cr, ct) = row["filter"], row["coupled"]
        lines.append(f"| {i} | {fr * 1e3:.2f} | {ft * 1e6:.1f} | {cr * 1e3:.2f} | {ct * 1e6:.1f} | "
                     f"{fr / cr:.2f}x | {ft / ct:.2f}x |")
    lines += [
        f"| median | {statistics.median([r['filter'][0] for r in rows]) * 1e3:.2f} | {statistics.median([r['filter'][1] for r in rows]) * 1e6:.1f} | "
        f"{statistics.median([r['coupled'][0] for r in rows]) * 1e3:.2f} | {statistics.median([r['coupled'][1] for r in rows]) * 1e6:.1f} | "
        f"**{statistics.median(request_ratio):.2f}x** | **{statistics.median(token_ratio):.2f}x** |",
        "",
        "The last two columns pair each round's two sides; their medians are the figures to quote.",
    ]
    procs.write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
