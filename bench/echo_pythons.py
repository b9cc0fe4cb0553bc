"""The transport floor on several Python versions: the echo ext_proc's CPU per token at production pacing.

    # a virtualenv per interpreter, with what the echo server imports (no vLLM, no torch):
    python3.12 -m venv /tmp/py312 && /tmp/py312/bin/pip install grpcio xds-protos uvloop hpack \\
        grpcio-health-checking protobuf
    .venv/bin/python bench/echo_pythons.py --python 3.12=/tmp/py312/bin/python [--python 3.13=...]

The filter's transport (its own HTTP/2 on uvloop, ``bench/echo_extproc.py``, one worker) answering
every ext_proc message with the same bytes, run by this virtualenv's Python and by each
``--python``, interleaved in ``--rounds`` rounds; each round: a simulator paced like a decoding GPU
(one token per event, ``--delay`` apart), Envoy 1.40 (``bench/procs.py``'s config) in front of the
echo, one warm-up batch, then ``--batches`` x ``--streams`` concurrent producer streams of
``--tokens`` tokens. Reported: the echo process's CPU per token (every thread) and Envoy's, the
median round of each interpreter. vLLM 0.33 runs on 3.12 and 3.13 too; the filter's translation is
not measured here (it needs vLLM and torch in each virtualenv), only the transport it rides on.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import load
import procs
from paced_ab import thread_cpu


def version(python: str) -> str:
    return subprocess.run([python, "-c", "import platform; print(platform.python_version())"], capture_output=True,
                          text=True, check=True).stdout.strip()


def one_round(python: str, model_dir: str, script: Path, args: argparse.Namespace) -> dict:
    started: list[procs.Proc] = []
    try:
        echo, envoy = procs.start_stack(started, "pyecho", model_dir, script, [], args.delay,
                                        env={"PYTHONPATH": str(BENCH.parent / "filter")}, lockstep=args.lockstep,
                                        server=[python, str(BENCH / "echo_extproc.py"), "--workers", "1"])
        # The producer request itself (the echo changes nothing, so the client reads token-id events).
        body = json.dumps({"model": "qwen3", "token_ids": list(range(1000, 1400)), "stream": True,
                           "sampling_params": {"max_tokens": 4096}}).encode()
        url = envoy.url + "/inference/v1/generate"
        asyncio.run(load.streams(url, body, args.streams, args.streams, ramp=1.0))  # warm-up
        threads0, envoy0 = thread_cpu(echo.pid), envoy.proc.cpu()
        results, _ = asyncio.run(load.streams(url, body, args.streams * args.batches, args.streams, ramp=1.0))
        threads1, envoy1 = thread_cpu(echo.pid), envoy.proc.cpu()
    finally:
        for proc in reversed(started):
            proc.stop()
    done = sum(1 for r in results if r.done)
    tokens = max(args.tokens * done, 1)
    used = sum(cpu - threads0.get(tid, 0.0) for tid, cpu in threads1.items())
    return {"echo": used / tokens * 1e6, "envoy": (envoy1 - envoy0) / tokens * 1e6, "failed": len(results) - done}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", default=[], metavar="NAME=PATH",
                        help="another interpreter (repeatable); this virtualenv's Python always runs too")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--delay", type=float, default=0.02)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lockstep", action="store_true", help="every stream's event at the same step")
    parser.add_argument("--out", default="-", help="the report (default '-': stdout only)")
    args = parser.parse_args()
    procs.exit_on_sigterm()
    pythons = {version(sys.executable): sys.executable}
    for item in args.python:
        name, _, path = item.partition("=")
        pythons[f"{name} ({version(path)})" if path else version(name)] = path or name
    model_dir, script = procs.reasoning_script("pyecho", args.tokens)
    rounds: dict[str, list[dict]] = {name: [] for name in pythons}
    for i in range(args.rounds):
        for name, python in pythons.items():
            result = one_round(python, model_dir, script, args)
            rounds[name].append(result)
            print(f"round {i + 1} {name}: echo {result['echo']:.1f} us/token, Envoy {result['envoy']:.0f}, "
                  f"failed {result['failed']}", flush=True)
    lines = [
        "# The echo ext_proc (the filter's transport) on several Python versions",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, `.venv/bin/python bench/echo_pythons.py "
        + " ".join(f"--python {p.partition('=')[0]}=<its python>" for p in args.python) + f" --rounds {args.rounds}"
        + (" --lockstep" if args.lockstep else "") + f"`: {args.streams} concurrent producer streams of {args.tokens} "
        f"tokens, one token per event every {args.delay * 1e3:.0f} ms, one echo worker behind Envoy 1.40, "
        f"{args.rounds} interleaved rounds of {args.batches} x {args.streams} streams; the median round of each, "
        "CPU us per token:",
        "",
        "| Python | echo ext_proc | Envoy | failed | every round (echo) |",
        "|---|---:|---:|---:|---:|",
    ]
    base = None
    for name, runs in rounds.items():
        median = sorted(runs, key=lambda r: r["echo"])[len(runs) // 2]
        base = base or median["echo"]
        every = " / ".join(f"{r['echo']:.1f}" for r in runs)
        lines.append(f"| {name} | {median['echo']:.1f} ({median['echo'] / base:.2f}x) | {median['envoy']:.0f} | "
                     f"{sum(r['failed'] for r in runs)} | {every} |")
    procs.write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
