"""PNG plots of the last benchmark results (bench/RESULTS.json, bench/SATURATION.json).

    .venv/bin/python bench/plots.py        # writes bench/plots/*.png (matplotlib: pip install -e '.[bench]')

- ``cpu_per_token.png``: CPU per token against stream length, the filter beside vLLM's streaming
  derender (log scale: one grows with the stream, the other does not).
- ``throughput.png``: tokens per second and the gap between a stream's reads (p50, p99) against
  concurrent streams, Envoy alone, the echo ext_proc (the transport floor) and the filter.
- ``saturation.png``: the event loop's busy ratio and lag (p50, p99) against concurrent streams,
  beside delivered / offered tokens per second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BENCH = Path(__file__).resolve().parent
OUT = BENCH / "plots"


def concurrency_axes(axes, levels: list[int]) -> None:
    """Concurrent streams on a log-2 x axis, ticked at the levels measured, with a grid."""
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.grid(True, alpha=0.3)


def cpu_per_token(results: dict, out: Path) -> None:
    ours = {int(n): run["cpu_us_per_token"]["server"] / 1e3 for n, run in results["lengths"].items()}
    theirs = {int(n): run["cpu_us_per_token"] / 1e3 for n, run in results["vllm_derender"].items()}
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sorted(ours), [ours[n] for n in sorted(ours)], "o-", label="derender filter (qwen3 + hermes)")
    ax.plot(sorted(theirs), [theirs[n] for n in sorted(theirs)], "s-", label="vLLM streaming /derender")
    coupled = {int(n): run["coupled"]["cpu_us_per_token"]["server"] / 1e3
               for n, run in results["lengths"].items() if run.get("coupled")}
    if coupled:
        ax.plot(sorted(coupled), [coupled[n] for n in sorted(coupled)], "^-", label="vLLM coupled API server")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per stream")
    ax.set_ylabel("CPU per token (ms, log scale)")
    ax.set_title("CPU per token against stream length")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def throughput(results: dict, out: Path) -> None:
    runs = results["throughput"]
    levels = sorted(int(c) for c in runs)
    names = {"envoy": "Envoy alone", "echo": "echo ext_proc (floor)", "plain": "filter, plain qwen3",
             "hermes": "filter, qwen3 + hermes", "vllm-coupled": "vLLM coupled API server"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in names.items():
        if any(key not in runs[str(c)] for c in levels):
            continue
        left.plot(levels, [runs[str(c)][key]["tokens_per_s"] for c in levels], "o-", label=label)
        right.plot(levels, [runs[str(c)][key]["read_gap"]["p50"] * 1e3 for c in levels], "o-", label=f"{label} p50")
        right.plot(levels, [runs[str(c)][key]["read_gap"]["p99"] * 1e3 for c in levels], "o--", alpha=0.6,
                   color=right.lines[-1].get_color(), label=f"{label} p99")
    left.set_ylabel("tokens per second")
    left.set_title("Throughput")
    right.set_ylabel("gap between a stream's reads (ms)")
    right.set_yscale("log")
    right.set_title("Latency per token under load")
    concurrency_axes((left, right), levels)
    left.legend(fontsize=8)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def saturation(rows: list[dict], out: Path) -> None:
    levels = [r["streams"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(levels, [r["offered_tokens_per_s"] for r in rows], "s--", label="offered")
    left.plot(levels, [r["tokens_per_s"] for r in rows], "o-", label="delivered")
    left.set_ylabel("tokens per second")
    left.set_title("Load")
    right.plot(levels, [r["busy_ratio"] for r in rows], "o-", color="C2", label="busy ratio (mean of workers)")
    right.set_ylabel("busy ratio")
    right.set_ylim(0, 1)
    lag = right.twinx()
    lag.plot(levels, [r["lag_p50_ms"] for r in rows], "^-", color="C3", label="loop lag p50")
    lag.plot(levels, [r["lag_p99_ms"] for r in rows], "v--", color="C3", alpha=0.6, label="loop lag p99")
    lag.set_yscale("log")
    lag.set_ylabel("loop lag (ms, log scale)")
    right.set_title("Saturation signal")
    concurrency_axes((left, right), levels)
    left.legend()
    handles = right.get_legend_handles_labels()
    more = lag.get_legend_handles_labels()
    right.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    OUT.mkdir(exist_ok=True)
    results_file, saturation_file = BENCH / "RESULTS.json", BENCH / "SATURATION.json"
    made = []
    if results_file.exists():
        results = json.loads(results_file.read_text())
        cpu_per_token(results, OUT / "cpu_per_token.png")
        throughput(results, OUT / "throughput.png")
        made += ["cpu_per_token.png", "throughput.png"]
    if saturation_file.exists():
        saturation(json.loads(saturation_file.read_text()), OUT / "saturation.png")
        made.append("saturation.png")
    if not made:
        print("no results: run bench/run.py or bench/saturation.py first", file=sys.stderr)
        return 1
    print("wrote " + ", ".join(str(OUT / name) for name in made))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
