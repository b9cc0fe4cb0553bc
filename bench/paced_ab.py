"""Two source trees of the filter side by side at production pacing: CPU per token, by thread.

    .venv/bin/python bench/paced_ab.py --before /path/to/old/checkout            # before vs this tree
    .venv/bin/python bench/paced_ab.py --before ../old --rounds 5 --out bench/PACED_AB.md
    .venv/bin/python bench/paced_ab.py --before ../old --api messages   # through /v1/messages
    .venv/bin/python bench/paced_ab.py --before . --after-traces        # traces off vs on, this tree
    .venv/bin/python bench/paced_ab.py --before . --after-flow          # flow control off vs on (room to spare)
    .venv/bin/python bench/paced_ab.py --before . --after-quotas        # token budgets off vs on, this tree
    .venv/bin/python bench/paced_ab.py --before . --after-env PYTHONMALLOC=malloc   # an environment setting

One simulator paced like a decoding GPU (one token per event, ``--delay`` apart), Envoy 1.40
(``bench/procs.py``'s config) and one filter worker (qwen3 + hermes, ``--workers 1``), started
from ``--before``'s ``filter/`` (put first on ``PYTHONPATH``) or from this tree, in interleaved
rounds; each round sends ``--streams`` concurrent reasoning + tool-call streams of ``--tokens``
tokens, ``--batches`` times over, after one warm-up batch. Per round: the worker's CPU per token,
its main thread's (the event loop: gRPC's callbacks and the filter's code), the rest of its
threads (gRPC's poller and C-core threads, the render pool), Envoy's, and ext_proc messages per
token. The median round of each tree is compared.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import load
import procs
import psutil
import streams
from stream_interval import HERMES


def commit_of(tree: str | None) -> str:
    """The tree's commit (and "+ changes" when its work tree differs), for the report."""
    where = tree or str(BENCH.parent)
    try:
        head = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--", "filter"], capture_output=True,
                               text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + (" + changes" if dirty else "")


def wakeups(pid: int) -> int:
    """Its main thread's voluntary context switches (each a sleep that something ended: the loop's wake-ups)."""
    try:
        return psutil.Process(pid).num_ctx_switches().voluntary
    except psutil.NoSuchProcess:
        return 0


def thread_cpu(pid: int) -> dict[int, float]:
    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}
    except psutil.NoSuchProcess:
        return {}


class TraceSink:
    """An OTLP/gRPC trace receiver in this process that counts the spans it gets (``--after-traces``)."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as ts_grpc

        sink = self
        self.spans = 0

        class Service(ts_grpc.TraceServiceServicer):
            def Export(self, request, context):
                sink.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                return ts.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        ts_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.url = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


class QuotaStore:
    """A redis-server here and a quota file whose one key never runs out (``--after-quotas``): the
    after tree reserves, extends and settles every stream's tokens in it; nothing is refused."""

    KEY = "sk-bench-quota"

    def __init__(self) -> None:
        import shutil
        import socket
        import tempfile

        import yaml

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        binary = shutil.which("redis-server")
        assert binary, "redis-server (make setup installs it)"
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL)
        big = 10**12
        self.path = Path(tempfile.mkdtemp(prefix="derender-bench-quota-")) / "quota.yaml"
        self.path.write_text(yaml.safe_dump({
            "redis": f"redis://127.0.0.1:{self.port}/0",
            "keys": [{"name": "bench", "key": self.KEY, "tokens_per_minute": big, "tokens_per_day": big,
                      "tokens_per_month": big, "requests_per_minute": big, "concurrent_streams": 100000}],
        }))
        self.flags = ("--quota-config", str(self.path), "--api-key", self.KEY)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def one_round(tree: str | None, model_dir: str, script: Path, args: argparse.Namespace,
              envoy_threads: int | None = None, frame_layer: str | None = None, flags: tuple[str, ...] = (),
              reach: str = "unix", extra_env: tuple[str, ...] = ()) -> dict:
    env = dict(os.environ)
    env.update(pair.split("=", 1) for pair in extra_env)  # type: ignore[arg-type]
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(tree) / "filter"), env.get("PYTHONPATH")]))
    if frame_layer == "h2":  # the ext_proc connections on python-hyper's h2 (bench/h2lib)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH / "h2lib"), env.get("PYTHONPATH")]))
        env["DERENDER_FRAME_LAYER"] = "h2"
    started: list[procs.Proc] = []
    try:
        serve = ["--served-model-name", "qwen3", "--max-model-len", "40960", *HERMES, "--workers", "1", *flags]
        server, envoy = procs.start_stack(started, "ab", model_dir, script, serve, args.delay, env=env,
                                          lockstep=args.lockstep,
                                          envoy_concurrency=envoy_threads or args.envoy_concurrency,
                                          unix=reach == "unix")
        body = streams.api_body(args.api)
        url = envoy.url + streams.API_PATHS[args.api]
        asyncio.run(load.streams(url, body, args.streams, args.streams, ramp=1.0))  # warm-up
        threads0, stats0, envoy0, woke0 = thread_cpu(server.pid), envoy.stats(), envoy.proc.cpu(), wakeups(server.pid)
        results, _ = asyncio.run(load.streams(url, body, args.streams * args.batches, args.streams, ramp=1.0))
        threads1, stats1, envoy1, woke1 = thread_cpu(server.pid), envoy.stats(), envoy.proc.cpu(), wakeups(server.pid)
    finally:
        for proc in reversed(started):
            proc.stop()
    tokens = args.tokens * sum(1 for r in results if r.done)
    used = {tid: cpu - threads0.get(tid, 0.0) for tid, cpu in threads1.items()}
    main = used.get(server.pid, 0.0)
    msgs = stats1.get("stream_msgs_sent", 0) - stats0.get("stream_msgs_sent", 0)
    per = lambda seconds: seconds / max(tokens, 1) * 1e6
    firsts = sorted(r.ttft for r in results if r.ttft is not None)
    return {"worker": per(sum(used.values())), "main": per(main), "other": per(sum(used.values()) - main),
            "envoy": per(envoy1 - envoy0), "msgs": msgs / max(tokens, 1),
            # bytes each way between Envoy and the filter, and the worker's sleeps ended, per token
            "rx_bytes": (stats1.get("upstream_cx_rx_bytes_total", 0) - stats0.get("upstream_cx_rx_bytes_total", 0))
            / max(tokens, 1),
            "tx_bytes": (stats1.get("upstream_cx_tx_bytes_total", 0) - stats0.get("upstream_cx_tx_bytes_total", 0))
            / max(tokens, 1),
            "wakeups": (woke1 - woke0) / max(tokens, 1), "failed": len(results) - sum(1 for r in results if r.done),
            "ttft_ms": firsts[len(firsts) // 2] * 1e3 if firsts else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a checkout of the filter to compare this tree with")
    parser.add_argument("--after", default=None, help="the other checkout (default: this tree)")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--batches", type=int, default=4, help="batches of --streams measured per round (default 4)")
    parser.add_argument("--delay", type=float, default=0.02, help="seconds between a stream's events (default 0.02)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lockstep", action="store_true",
                        help="every stream's event at the same moment, one step every --delay (one GPU's batch)")
    parser.add_argument("--api", choices=["chat", "messages", "responses"], default="chat",
                        help="the endpoint the streams are asked through (default chat)")
    parser.add_argument("--envoy-concurrency", type=int, default=procs.ENVOY_CONCURRENCY,
                        help=f"Envoy's worker threads (default {procs.ENVOY_CONCURRENCY})")
    parser.add_argument("--before-envoy-concurrency", type=int, default=None,
                        help="Envoy's threads for the before tree's rounds only (with --before . : Envoy's threads A/B)")
    parser.add_argument("--before-frame-layer", choices=["own", "h2"], default="own",
                        help="the before tree's ext_proc frame layer: the filter's own (default) or python-hyper's h2 "
                        "(bench/h2lib; with --before . : the frame layers A/B)")
    parser.add_argument("--after-traces", action="store_true",
                        help="the after tree exports OpenTelemetry traces (every request sampled) to a receiver here")
    parser.add_argument("--after-quotas", action="store_true",
                        help="the after tree charges every stream to a key's token budgets (--quota-config) in a Redis here")
    parser.add_argument("--after-flow", action="store_true",
                        help="the after tree runs flow control with room to spare (--replica-capacity 1000): what a "
                        "request that finds room pays, and the producer's /metrics read every 0.25 s")
    parser.add_argument("--socket", choices=["unix", "tcp"], default="unix",
                        help="how Envoy reaches both trees' filters: a Unix socket (serve --uds, derender up's "
                        "default) or loopback TCP (a tree from before --uds)")
    parser.add_argument("--before-socket", choices=["unix", "tcp"], default=None,
                        help="the before tree's only (with --before . : the sockets A/B)")
    parser.add_argument("--after-env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the after tree's filter only (repeatable): "
                        "an allocator or interpreter setting against the same code")
    parser.add_argument("--out", default="-", help="the report (default '-': stdout only)")
    args = parser.parse_args()
    procs.exit_on_sigterm()
    model_dir, script = procs.reasoning_script("paced-ab", args.tokens)
    trees = {"before": args.before, "after": args.after}
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    sink = TraceSink() if args.after_traces else None
    traced: tuple[str, ...] = ("--otlp-traces-endpoint", sink.url, "--trace-sample-ratio", "1") if sink else ()
    store = QuotaStore() if args.after_quotas else None
    if args.after_flow:
        traced += ("--replica-capacity", "1000", "--saturation-interval", "0.25")
    if store is not None:
        traced += store.flags
        load.HEADERS["authorization"] = f"Bearer {store.KEY}"  # both trees get it; the before one checks no key
    for i in range(args.rounds):
        for name, tree in trees.items():
            result = one_round(tree, model_dir, script, args, args.before_envoy_concurrency if name == "before" else None,
                               args.before_frame_layer if name == "before" else None,
                               traced if name == "after" else (),
                               (args.before_socket or args.socket) if name == "before" else args.socket,
                               tuple(args.after_env) if name == "after" else ())
            rounds[name].append(result)
            print(f"round {i + 1} {name}: " + ", ".join(f"{k} {v:.2f}" if k in ("msgs", "ttft_ms", "wakeups") else f"{k} {v:.0f}"
                                                        for k, v in result.items()), flush=True)
    if store is not None:
        store.stop()
    median = {name: sorted(rs, key=lambda r: r["worker"])[len(rs) // 2] for name, rs in rounds.items()}
    lines = [
        "# Two trees of the filter at production pacing",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, `.venv/bin/python bench/paced_ab.py "
        f"--before <checkout of {commit_of(args.before)}>{' --after <checkout>' if args.after else ''} "
        f"--rounds {args.rounds} --batches {args.batches}{' --api ' + args.api if args.api != 'chat' else ''}"
        f"{' --lockstep' if args.lockstep else ''}"
        f"{f' --envoy-concurrency {args.envoy_concurrency}' if args.envoy_concurrency != procs.ENVOY_CONCURRENCY else ''}"
        f"{f' --before-envoy-concurrency {args.before_envoy_concurrency}' if args.before_envoy_concurrency else ''}"
        f"{f' --before-frame-layer {args.before_frame_layer}' if args.before_frame_layer != 'own' else ''}"
        f"{' --after-traces' if args.after_traces else ''}{' --after-quotas' if args.after_quotas else ''}"
        f"{' --after-flow' if args.after_flow else ''}"
        f"{f' --socket {args.socket}' if args.socket != 'unix' else ''}"
        f"{f' --before-socket {args.before_socket}' if args.before_socket else ''}"
        f"{''.join(f' --after-env {pair}' for pair in args.after_env)}`: "
        f"{args.streams} concurrent qwen3 + hermes {args.api} streams of "
        f"{args.tokens} tokens, one token per event every {args.delay * 1e3:.0f} ms"
        f"{' (every stream at the same step, as one GPU batch)' if args.lockstep else ''}, one filter worker behind Envoy 1.40, {args.rounds} interleaved rounds of "
        f"{args.batches} x {args.streams} streams; the median round of each (by the worker's CPU), CPU us per token:",
        "",
        "| tree | worker | its main thread | its other threads | Envoy | worker + Envoy | ext_proc msgs/token | failed | every round (worker) | first chunk, median ms, every round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in median.items():
        every = " / ".join(f"{x['worker']:.0f}" for x in rounds[name])
        layer = ", h2 frame layer" if name == "before" and args.before_frame_layer == "h2" else ""
        lines.append(f"| {name} ({commit_of(trees[name])}{layer}) | {r['worker']:.0f} | {r['main']:.0f} | {r['other']:.0f} | "
                     f"{r['envoy']:.0f} | {r['worker'] + r['envoy']:.0f} | {r['msgs']:.2f} | {r['failed']} | {every} | "
                     + " / ".join(f"{x['ttft_ms']:.1f}" for x in rounds[name]) + " |")
    if sink is not None:
        lines += ["", f"The after tree exported traces (every request sampled; {sink.spans} spans received)."]
    if store is not None:
        lines += ["", "The after tree charged every stream to one key's budgets (--quota-config, Redis here): "
                      "reserved before the producer, settled at the end; nothing refused or cut."]
    ratios = [a["worker"] / b["worker"] for b, a in zip(rounds["before"], rounds["after"])]
    lines += ["", "Round by round, after / before (worker): " + ", ".join(f"{r:.2f}" for r in ratios) + "."]
    b, a = median["before"], median["after"]
    lines += ["", f"After / before: worker {a['worker'] / b['worker']:.2f}x, worker + Envoy "
                  f"{(a['worker'] + a['envoy']) / (b['worker'] + b['envoy']):.2f}x, main thread {a['main'] / b['main']:.2f}x."]
    procs.write_report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
