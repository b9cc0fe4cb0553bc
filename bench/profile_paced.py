"""Where a filter worker's CPU goes at production pacing: a py-spy profile, summarized.

    .venv/bin/pip install -e '.[bench]'        # py-spy
    .venv/bin/python bench/profile_paced.py                    # writes bench/PROFILE_PACED.md
    .venv/bin/python bench/profile_paced.py --stream-path vllm --out -

One simulator paced like a decoding GPU (one token per event, ``--delay`` apart), one filter with
one worker (qwen3 + hermes, ``--stream-path``) behind Envoy 1.40 (``bench/procs.py``'s config),
``--streams`` concurrent reasoning + tool-call streams of ``--tokens`` tokens, again and again;
py-spy samples the worker's threads for ``--seconds`` while they run (its raw output is kept in
the log folder). The summary: the share of samples per thread, the functions holding the most
samples (inclusive), and what the ext_proc servicer's loop spends its own samples on, by line.
Samples py-spy could not read (native code without a Python frame) are counted apart.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import load
import procs
import streams
from stream_interval import HERMES


def summarize(raw: Path, errors: int) -> list[str]:
    total, threads, inclusive, servicer = 0, collections.Counter(), collections.Counter(), collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        threads[re.sub(r"\(\d+\)", "", frames[0])] += n
        seen = set()
        for frame in frames[1:]:
            name = re.sub(r":\d+\)$", ")", frame)
            if name not in seen:
                seen.add(name)
                inclusive[name] += n
        for i, frame in enumerate(frames):
            if frame.startswith("ExternalProcessor.serve_stream"):
                nxt = frames[i + 1] if i + 1 < len(frames) else "(its own line) " + frame
                servicer[re.sub(r":\d+\)$", ")", nxt) if i + 1 < len(frames) else nxt] += n
                break
    pct = lambda n: f"{n / total * 100:.1f} %"
    out = [f"{total} samples read, {errors} unreadable (native code with no Python frame).", "",
           "| thread | share |", "|---|---:|"]
    out += [f"| {name} | {pct(n)} |" for name, n in threads.most_common(6)]
    out += ["", "Functions holding the most samples (inclusive):", "", "| function | share |", "|---|---:|"]
    out += [f"| `{name}` | {pct(n)} |" for name, n in inclusive.most_common(40)
            if not name.startswith(("_run_module_as_main", "_run_code", "<module>", "main (", "cmd_serve", "run (",
                                    "run_one", "Thread."))][:30]
    out += ["", "The ext_proc servicer's loop (`serve_stream`): its calls and its own lines (an `await` of "
            "grpc.aio's `read()` / `write()` is counted on its line: gRPC's Cython has no Python frame):", "",
            "| call or line | share |", "|---|---:|"]
    out += [f"| `{name}` | {pct(n)} |" for name, n in servicer.most_common(12)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=250)
    parser.add_argument("--delay", type=float, default=0.02, help="seconds between a stream's events (default 0.02)")
    parser.add_argument("--seconds", type=int, default=20, help="how long py-spy samples (default 20)")
    parser.add_argument("--stream-path", choices=("lean", "vllm"), default="lean")
    parser.add_argument("--api", choices=["chat", "messages", "responses"], default="chat",
                        help="which API the streams are asked through (default chat)")
    parser.add_argument("--response-leg", choices=("envoy", "worker"), default="envoy", help="the filter's --response-leg")
    parser.add_argument("--native", action="store_true", help="py-spy --native: C frames too (uvloop, the tokenizer); it pauses the worker for each sample")
    parser.add_argument("--out", default=str(BENCH / "PROFILE_PACED.md"), help="the report ('-': stdout only)")
    args = parser.parse_args()
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not installed: .venv/bin/pip install -e '.[bench]'")
    procs.exit_on_sigterm()
    model_dir, script = procs.reasoning_script("profile-paced", args.tokens)
    raw = procs.LOGS / f"profile-paced-{args.api}-{args.stream_path}.raw"
    started: list[procs.Proc] = []
    try:
        serve = ["--served-model-name", "qwen3", "--max-model-len", "40960", *HERMES, "--stream-path", args.stream_path,
                 "--workers", "1"]
        server, envoy = procs.start_stack(started, "profiled", model_dir, script, serve, args.delay,
                                          leg=args.response_leg == "worker")
        body = streams.api_body(args.api)
        url = envoy.url + streams.API_PATHS[args.api]
        asyncio.run(load.streams(url, body, args.streams, args.streams, ramp=1.0))  # warm-up
        stop = threading.Event()

        def keep_loaded() -> None:
            while not stop.is_set():
                asyncio.run(load.streams(url, body, args.streams, args.streams, ramp=1.0))

        loader = threading.Thread(target=keep_loaded, daemon=True)
        loader.start()
        stats0, cpu0 = envoy.stats(), server.cpu()
        spied = subprocess.run([spy, "record", "-p", str(server.pid), "-r", "200", "-d", str(args.seconds), "--threads",
                                *(["--native"] if args.native else ["--nonblocking"]), "--format", "raw", "-o", str(raw)], capture_output=True, text=True)
        cpu, stats1 = server.cpu() - cpu0, envoy.stats()
        stop.set()
        loader.join()
    finally:
        for proc in reversed(started):
            proc.stop()
    errors = int((re.search(r"Errors: (\d+)", spied.stdout + spied.stderr) or [0, 0])[1])
    msgs = stats1.get("stream_msgs_sent", 0) - stats0.get("stream_msgs_sent", 0)
    lines = [
        "# A filter worker at production pacing (py-spy)",
        "",
        f"{datetime.date.today()}, `.venv/bin/python bench/profile_paced.py --streams {args.streams} --tokens "
        f"{args.tokens} --delay {args.delay} --seconds {args.seconds} --stream-path {args.stream_path}"
        f"{' --api ' + args.api if args.api != 'chat' else ''}`: "
        f"{args.streams} concurrent qwen3 + hermes {args.api} streams of {args.tokens} tokens, one token per event every "
        f"{args.delay * 1e3:.0f} ms, one filter worker (`--stream-path {args.stream_path}`) behind Envoy 1.40, sampled "
        f"by py-spy at 200 Hz for {args.seconds} s on this 2-core machine. The worker used {cpu:.1f} s of CPU in "
        f"those {args.seconds} s ({cpu / args.seconds * 100:.0f} % of a core) for {msgs} ext_proc messages "
        f"({cpu / max(msgs, 1) * 1e6:.0f} us per message).",
        "",
        *summarize(raw, errors),
    ]
    procs.write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
