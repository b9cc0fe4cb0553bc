"""The processes a benchmark run starts on loopback, their CPU time and memory, Envoy's configs."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import yaml
from derender.ops import envoy_config
from derender.ops.children import Child, free_port, http_ok, tcp_open  # noqa: F401 (the bench's helpers)

BENCH = Path(__file__).resolve().parent
LOGS = Path(tempfile.gettempdir()) / "derender-bench-logs"
PYTHON = sys.executable


def exit_on_sigterm() -> None:
    """SIGTERM (``kill``, ``timeout``) leaves through the ``finally`` blocks that stop the
    benchmark's processes, as Ctrl-C does, instead of leaving them running."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class Proc(Child):
    """A process of the benchmark (and the workers it forks), its output in a log file; CPU time."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        super().__init__(name, argv, env, log=LOGS / f"{name}-{os.getpid()}.log")

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu(self) -> float:
        """CPU seconds (user + system) of the process and its live children."""
        return sum(cpu_of(p) for p in self.tree())

    def workers(self) -> list[psutil.Process]:
        """The processes doing the work: the forked workers, else the process itself."""
        tree = self.tree()
        return tree[1:] or tree


# The environment of the benchmark's vLLM processes (its render servers, its coupled server).
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING"}


def coupled_server(name: str, model_dir: str, script: Path, port: int, flags: list[str]) -> Proc:
    """vLLM's coupled API server (``bench/coupled_vllm.py``) serving ``model_dir`` as qwen3 with ``flags``
    (its parsers) on ``port``, its scripted engine sending ``script``'s tokens; not started yet."""
    return Proc(name, [PYTHON, str(BENCH / "coupled_vllm.py"), "--model", model_dir, "--served-model-name", "qwen3",
                       "--max-model-len", "40960", *flags, "--port", str(port), "--script", str(script)], env=VLLM_ENV)


def start_coupled(started: list[Proc], name: str, model_dir: str, script: Path, flags: list[str], delay: float) -> tuple[Proc, str]:
    """``coupled_server`` started (appended to ``started``), ready and paced one event every ``delay``
    seconds, each stream on its own timer; the process and its base URL."""
    port = free_port()
    coupled = coupled_server(name, model_dir, script, port, flags).start()
    started.append(coupled)
    base = f"http://127.0.0.1:{port}"
    coupled.wait(lambda: http_ok(base + "/v1/models"), 600)
    post(base + "/bench/delay", {"delay": delay, "lockstep": False})
    return coupled, base


def write_report(lines: list[str], out: str) -> None:
    """Print a benchmark's markdown report and write it to ``out`` (``-``: print only)."""
    report = "\n".join(lines) + "\n"
    print(report)
    if out != "-":
        Path(out).write_text(report)


def cpu_of(process: psutil.Process) -> float:
    try:
        t = process.cpu_times()
        return t.user + t.system
    except psutil.NoSuchProcess:
        return 0.0


def memory(proc: Proc) -> list[dict]:
    """RSS and USS (memory no other process shares) of each worker, MiB."""
    out = []
    for p in proc.workers():
        try:
            info = p.memory_full_info()
            out.append({"pid": p.pid, "rss": info.rss / 2**20, "uss": info.uss / 2**20})
        except psutil.NoSuchProcess:
            pass
    return out


# gRPC streams per HTTP/2 connection to the ext_proc, as ``envoy/local.yaml`` has it: Envoy opens a
# connection when its open ones are full, and SO_REUSEPORT spreads connections over the workers.
STREAMS_PER_CONNECTION = 16
# Envoy's worker threads (``--concurrency``) in every benchmark Envoy (``bench/run.py --envoy-concurrency``):
# one, as ``derender up`` and docker-compose.yaml start it.
ENVOY_CONCURRENCY = 1


def _h2_options(cluster: dict) -> dict:
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    return options["explicit_http_config"]["http2_protocol_options"]


def streams_per_connection() -> int | None:
    """``max_concurrent_streams`` of the ext_proc cluster in ``envoy/local.yaml`` as it is."""
    config = yaml.safe_load(envoy_config.render())
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "derender")
    return _h2_options(cluster).get("max_concurrent_streams")


def unix_path(name: str) -> str:
    """A Unix socket's path in the log folder for the ext_proc server ``name`` (``serve --uds``), as
    ``derender up`` gives its filter one by default (``--filter-socket unix``)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    return str(LOGS / f"{name}-{os.getpid()}.sock")


def envoy_yaml(listen: int, admin: int, producer_port: int, filter_port: int | None, full_duplex: bool = False,
               unix: str | None = None, leg: bool = False) -> str:
    """``envoy/local.yaml`` as ``derender up`` renders it; without the ext_proc filter when
    ``filter_port`` is None (Envoy alone); response bodies FULL_DUPLEX_STREAMED if asked;
    ``STREAMS_PER_CONNECTION`` on the ext_proc cluster; with ``unix``, the ext_proc reached on that
    Unix socket (``derender up``'s default) instead of ``filter_port``; ``leg``: for a filter serving with
    ``--response-leg worker`` (``envoy_config.response_leg``)."""
    text = envoy_config.render(
        LISTEN_PORT=listen, ADMIN_PORT=admin, FILTER_PORT=filter_port or 1, PRODUCER_HOST="127.0.0.1", PRODUCER_PORT=producer_port
    )
    config = yaml.safe_load(text)
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "derender":
            _h2_options(cluster)["max_concurrent_streams"] = STREAMS_PER_CONNECTION
    if unix is not None and filter_port is not None:
        envoy_config.unix_filter_endpoints(config, [unix])
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = manager["http_filters"]
    ext_proc = next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")
    if filter_port is None:
        filters.remove(ext_proc)
    elif full_duplex:
        mode = ext_proc["typed_config"]["processing_mode"]
        mode["response_body_mode"] = "FULL_DUPLEX_STREAMED"
        mode["response_trailer_mode"] = "SEND"
    if leg:
        envoy_config.response_leg(config)
    return yaml.safe_dump(config, sort_keys=False)


@dataclass
class Envoy:
    proc: Proc
    port: int
    admin: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, int]:
        """ext_proc counters (gRPC messages each way) and the bytes each way on the connections to the
        filter (the ``derender`` cluster's ``upstream_cx_rx_bytes_total``, ``..._tx_...``)."""
        query = urllib.parse.quote(r"ext_proc|cluster\.derender\.upstream_cx_[rt]x_bytes_total")
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/stats?filter={query}", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            key, _, value = line.partition(": ")
            if value.strip().isdigit():
                out[key.rsplit(".", 1)[-1]] = out.get(key.rsplit(".", 1)[-1], 0) + int(value)
        return out


def start_envoy(name: str, producer_port: int, filter_port: int | None, full_duplex: bool = False,
                concurrency: int | None = None, unix: str | None = None, leg: bool = False) -> Envoy:
    """Envoy in front of the producer (and the ext_proc at ``filter_port``, or on the Unix socket
    ``unix``), with ``concurrency`` worker threads (default ``ENVOY_CONCURRENCY``)."""
    port, admin = free_port(), free_port()
    path = LOGS / f"{name}-{os.getpid()}.yaml"
    LOGS.mkdir(parents=True, exist_ok=True)
    path.write_text(envoy_yaml(port, admin, producer_port, filter_port, full_duplex, unix, leg))
    argv = [envoy_config.envoy_binary(), "-c", str(path), "--concurrency", str(concurrency or ENVOY_CONCURRENCY), "--log-level", "warn", "--disable-hot-restart"]
    proc = Proc(name, argv).start()
    return Envoy(proc, port, admin)


def paced_options(parser, tokens: int | None, rounds: int, rounds_help: str | None = None, api_help: str | None = None) -> None:
    """The options a paced run's script shares: ``--api``, ``--streams`` (64), ``--tokens`` (``tokens``;
    none if None), ``--delay`` (0.02 s), ``--rounds`` (``rounds``) and ``--out`` (a markdown report)."""
    import streams  # the bench's token streams (bench/ is on sys.path for every bench script)

    parser.add_argument("--api", choices=list(streams.API_PATHS), default="chat", help=api_help)
    parser.add_argument("--streams", type=int, default=64)
    if tokens is not None:
        parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--delay", type=float, default=0.02, help="seconds between a stream's events (default 0.02)")
    parser.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    parser.add_argument("--out", default="-", help="a markdown report (default '-': stdout only)")


def streams_cpu(url: str, body: bytes, group: list[Proc], count: int) -> list[float]:
    """``count`` concurrent paced streams at ``url`` (started over a second); the CPU seconds each of
    ``group`` used meanwhile. Raises if any stream did not finish."""
    return streams_run(url, body, group, count)[0]


def streams_run(url: str, body: bytes, group: list[Proc], count: int) -> tuple[list[float], list[float]]:
    """``streams_cpu``'s CPU seconds, and each stream's time to its first body read (seconds)."""
    import asyncio

    import load  # the bench's clients (bench/ is on sys.path for every bench script)

    before = [p.cpu() for p in group]
    done, _ = asyncio.run(load.streams(url, body, count, count, ramp=1.0))
    finished = sum(1 for s in done if s.done)
    if finished != count:
        raise RuntimeError(f"{count - finished} of {count} streams at {url} did not finish")
    return [p.cpu() - b for p, b in zip(group, before, strict=True)], [s.ttft for s in done if s.ttft is not None]


def reasoning_script(name: str, tokens: int) -> tuple[str, Path]:
    """The bench's Qwen3 folder (fetched if missing) and a simulator script, in the log folder, of
    one Qwen3 reasoning + hermes tool-call answer of ``tokens`` tokens."""
    import streams  # the bench's token streams (bench/ is on sys.path for every bench script)
    from derender.ops import assets

    model_dir = str(assets.fetch("qwen3"))
    LOGS.mkdir(parents=True, exist_ok=True)
    script = LOGS / f"{name}-script-{os.getpid()}.jsonl"
    script.write_text(streams.script_line(streams.reasoning_tool_call(model_dir, tokens)))
    return model_dir, script


def start_stack(started: list[Proc], name: str, model_dir: str, script: Path, serve_args: list[str], delay: float,
                env: dict[str, str] | None = None, sim: list[str] | None = None,
                lockstep: bool = False, server: list[str] | None = None,
                envoy_concurrency: int | None = None, unix: bool = True, leg: bool = False) -> tuple[Proc, Envoy]:
    """A paced benchmark's processes on loopback, each appended to ``started`` as it starts (for the
    caller's ``finally``): a simulator in script mode (``sim``: its program, default ``derender sim``)
    sending ``script``'s tokens one event every ``delay`` seconds, a filter (``derender serve --model
    model_dir`` and ``serve_args``, with ``env``; ``server``: another ext_proc program instead, given
    only ``--port``) producing from it, and Envoy in front (``envoy_concurrency`` threads). Returns the
    ext_proc server and Envoy, both ready. ``lockstep``: every stream's event at the same step
    (``derender sim --lockstep``), as one GPU decodes its batch. ``unix``: Envoy reaches the ext_proc
    server on a Unix socket (``--uds``), as ``derender up`` does by default; else on its TCP port. ``leg``:
    the filter serves with ``--response-leg worker`` and Envoy has the config for it."""
    sim_port, port = free_port(), free_port()
    producer = Proc(f"{name}-sim", [*(sim or [PYTHON, "-m", "derender.cli", "sim"]), "--model", model_dir, "--port",
                                    str(sim_port), "--mode", "script", "--script", str(script)]).start()
    started.append(producer)
    argv = server or [PYTHON, "-m", "derender.cli", "serve", "--model", model_dir, *serve_args,
                      "--producer", f"http://127.0.0.1:{sim_port}", *(["--response-leg", "worker"] if leg else [])]
    uds = unix_path(f"{name}-filter") if unix else None
    ext_proc = Proc(f"{name}-filter", [*argv, "--port", str(port), *(["--uds", uds] if uds else [])], env=env).start()
    started.append(ext_proc)
    producer.wait(lambda: http_ok(f"http://127.0.0.1:{sim_port}/health"), 120)
    ext_proc.wait(lambda: tcp_open(port), 600)
    envoy = start_envoy(f"{name}-envoy", sim_port, port, concurrency=envoy_concurrency, unix=uds, leg=leg)
    started.append(envoy.proc)
    envoy.proc.wait(lambda: http_ok(f"http://127.0.0.1:{envoy.admin}/ready"), 60)
    post(f"http://127.0.0.1:{sim_port}/sim/config", {"delay": delay, "lockstep": lockstep})
    return ext_proc, envoy


def post(url: str, body: dict) -> None:
    """POST ``body`` as JSON (the simulator's ``/sim/config``)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as r:
        r.read()


def get_json(url: str) -> dict:
    """GET ``url``'s JSON (the simulator's ``/sim/stats``)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (NaNs left out; NaN when none are left)."""
    values = sorted(v for v in values if v == v)
    return values[min(len(values) - 1, int(len(values) * q))] if values else float("nan")
