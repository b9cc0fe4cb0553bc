"""Real processes for the tests: the simulator, the filter and the Envoy binary, on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import forkserver
import yaml

from derender.ops import envoy_config
from derender.ops.children import Child, free_port, http_ok, tcp_open

ROOT = Path(__file__).resolve().parents[1]
LOGS = Path(os.environ.get("DERENDER_TEST_LOGS", tempfile.gettempdir())) / "derender-test-logs"


def http_get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post(url: str, body: dict | bytes, timeout: float = 10, headers: dict | None = None) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metric_total(url: str, name: str, **labels: str) -> float:
    """The sum of the Prometheus samples named ``name`` (``..._total``, ``..._count``: as exposed) with
    these labels among theirs, at ``url`` (a ``/metrics`` page)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http_get(url, timeout=10)[1].decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def until(check, what: str, timeout: float = 30.0):
    """``wait_for`` on an event loop: poll ``check`` without blocking the loop the test runs on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"not seen within {timeout} s: {what}")


def wait_for(check, what: str, timeout: float = 20.0):
    """Poll ``check`` until it returns something true, and return that; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not seen within {timeout} s: {what}")


class Proc(Child):
    """A child process of a test, its output in a log file of its own under ``LOGS``; a ``derender``
    command is forked by the session's fork server (``forkserver``: its imports done once)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        super().__init__(name, argv, env=env, log=LOGS / f"{name}-{os.getpid()}-{time.time_ns()}.log")

    def _spawn(self, out, env: dict[str, str]):
        if FORKS is None or self.argv[: len(DERENDER)] != DERENDER or self.log is None:
            return super()._spawn(out, env)
        return FORKS.spawn(self.argv[len(DERENDER):], env, self.log)

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.popen

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        super().stop(sig, timeout)


DERENDER = [sys.executable, "-m", "derender.cli"]
FORKS = None if os.environ.get("DERENDER_TEST_FORKSERVER") == "0" else forkserver.Server()


def start_forkserver() -> None:
    """Start the session's fork server now (its imports take a few seconds), if it is used."""
    if FORKS is not None and FORKS.popen is None:
        FORKS.start(LOGS / f"forkserver-{os.getpid()}-{time.time_ns()}.log")


def start_sim(model_dir: str, *flags: str) -> tuple[Proc, str]:
    port = free_port()
    sim = Proc("sim", [*DERENDER, "sim", "--model", str(model_dir), "--port", str(port), *flags]).start()
    url = f"http://127.0.0.1:{port}"
    sim.wait(lambda: http_ok(url + "/health"), 90)
    return sim, url


def start_filter(model_flags: list[str], producer: str, port: int | None = None) -> tuple[Proc, int]:
    port = port or free_port()
    flt = Proc("filter", [*DERENDER, "serve", *model_flags, "--port", str(port), "--producer", producer]).start()
    flt.wait(lambda: tcp_open(port), 240)
    return flt, port


@contextlib.contextmanager
def served_behind_envoy(name: str, model_dir: str, flags: list[str], sim_flags: tuple[str, ...] = (),
                        ready: Callable[[Proc], bool] | None = None, edit=None) -> Iterator[tuple[Proc, int, str]]:
    """A simulator, ``derender serve`` (qwen3's name, ``flags`` added) and Envoy in front:
    (the filter's process, its port, Envoy's URL); ``ready``: what else to wait for before Envoy;
    ``edit``: ``start_envoy``'s (``envoy_config.response_leg``: Envoy with the response leg)."""
    sim, sim_url = start_sim(model_dir, *sim_flags)
    port = free_port()
    flt = Proc(name, [*DERENDER, "serve", "--model", model_dir, "--served-model-name", "qwen3",
                      "--port", str(port), "--producer", sim_url, *flags]).start()
    procs = [sim, flt]
    try:
        flt.wait(lambda: tcp_open(port) and (ready is None or ready(flt)), 300)
        envoy, base = start_envoy(port, sim_url, edit=edit)
        procs.append(envoy)
        yield flt, port, base
    finally:
        for p in reversed(procs):
            p.stop()


def start_envoy(filter_port: int, producer: str, *more_producers: str, edit=None, **values) -> tuple[Proc, str]:
    """Envoy with ``envoy/local.yaml``; ``more_producers``: further replicas in the producer cluster;
    ``edit``: a function that changes the parsed config before Envoy gets it."""
    port, admin = free_port(), free_port()
    host, pport = envoy_config.split_url(producer)
    cfg = envoy_config.render(
        LISTEN_PORT=port, ADMIN_PORT=admin, FILTER_PORT=filter_port, PRODUCER_HOST=host, PRODUCER_PORT=pport, **values
    )
    if more_producers or edit:
        config = yaml.safe_load(cfg)
        cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "producer")
        for url in more_producers:
            h, p = envoy_config.split_url(url)
            endpoint = {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"].append(endpoint)
        if edit:
            edit(config)
        cfg = yaml.safe_dump(config, sort_keys=False)
    path = Path(tempfile.mkdtemp(prefix="derender-envoy-")) / "envoy.yaml"
    path.write_text(cfg)
    envoy = Proc("envoy", [envoy_config.envoy_binary(), "-c", str(path), "--concurrency", "1", "--log-level", "warn", "--disable-hot-restart"]).start()
    envoy.admin_port = admin  # type: ignore[attr-defined]
    base = f"http://127.0.0.1:{port}"
    envoy.wait(lambda: http_ok(base + "/health"), 60)
    return envoy, base


def envoy_counter(admin_port: int, name: str) -> int:
    """One of Envoy's counters (``/stats``), 0 if it has none by that name."""
    text = http_get(f"http://127.0.0.1:{admin_port}/stats?filter=^{name}$")[1].decode()
    return sum(int(line.split(": ")[1]) for line in text.splitlines() if line.split(": ")[0] == name)


def start_cluster_envoy(filter_port: int, cluster: dict, tag: str, edit=None) -> tuple[Proc, str, int]:
    """Envoy with ``envoy/multi.yaml`` and one producer cluster (``envoy_config.producer_cluster``'s):
    (its process, base URL, admin port) once it answers; ``edit``: a function that changes the parsed
    config before Envoy gets it."""
    listen, admin = free_port(), free_port()
    config = envoy_config.render("multi.yaml", LISTEN_PORT=listen, ADMIN_PORT=admin, FILTER_PORT=filter_port,
                                 PRODUCER_CLUSTERS="  - " + json.dumps(cluster))
    if edit is not None:
        config = yaml.safe_dump(edit(yaml.safe_load(config)))
    path = LOGS / f"envoy-{tag}-{listen}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config)
    envoy = Proc("envoy", [envoy_config.envoy_binary(), "-c", str(path), "--concurrency", "1",
                           "--log-level", "warn", "--disable-hot-restart"]).start()
    base = f"http://127.0.0.1:{listen}"
    envoy.wait(lambda: http_ok(base + "/health"), 60)
    return envoy, base, admin


class Redis:
    """A real redis-server on a free loopback port, no persistence."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is installed by `make test` (Debian's redis-server package)"
        self.binary = binary
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Proc | None = None

    def start(self) -> Redis:
        self.proc = Proc("redis", [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no"]).start()
        self.proc.wait(lambda: tcp_open(self.port), 30)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None



def start_layout(name: str, clusters: dict[str, list[int]], wait_ready: bool = True) -> tuple[Proc, int, int]:
    """Envoy on a shipped layout as it is (``envoy/NAME.yaml``), only its addresses moved to loopback:
    its listener and admin page on free ports, each cluster of ``clusters`` on those ports of
    127.0.0.1 (its other clusters as written). Returns (Envoy, listener port, admin port)."""
    config = yaml.safe_load((Path(envoy_config.envoy_dir()) / f"{name}.yaml").read_text())
    listen, admin = free_port(), free_port()
    config["admin"]["address"]["socket_address"].update(address="127.0.0.1", port_value=admin)
    config["static_resources"]["listeners"][0]["address"]["socket_address"].update(address="127.0.0.1", port_value=listen)
    by_name = {c["name"]: c for c in config["static_resources"]["clusters"]}
    for cluster, ports in clusters.items():
        endpoints = [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
                     for port in ports]
        by_name[cluster]["load_assignment"]["endpoints"] = [{"lb_endpoints": endpoints}]
    path = Path(tempfile.mkdtemp(prefix=f"derender-{name}-")) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    envoy = Proc(f"envoy-{name}", [envoy_config.envoy_binary(), "-c", str(path), "--concurrency", "1",
                                   "--log-level", "warn", "--disable-hot-restart"]).start()
    if wait_ready:
        envoy.wait(lambda: http_ok(f"http://127.0.0.1:{admin}/ready"), 60)
    return envoy, listen, admin


@dataclass
class Stack:
    """Envoy + filter + simulator; ``base_url`` is the OpenAI endpoint (``.../v1``)."""

    model_dir: str
    model_flags: list[str]
    sim_flags: list[str] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    sim_url: str = ""
    envoy_url: str = ""
    filter_port: int = 0
    leg: bool = False  # the response leg in the filter's worker (serve --response-leg worker)

    def start(self) -> Stack:
        try:
            sim, self.sim_url = start_sim(self.model_dir, *self.sim_flags)
            self.procs.append(sim)
            flags = ["--model", self.model_dir, *self.model_flags, *(["--response-leg", "worker"] if self.leg else [])]
            flt, self.filter_port = start_filter(flags, self.sim_url)
            self.procs.append(flt)
            envoy, self.envoy_url = start_envoy(
                self.filter_port, self.sim_url, edit=envoy_config.response_leg if self.leg else None
            )
            self.procs.append(envoy)
        except Exception:
            self.stop()
            raise
        return self

    @property
    def base_url(self) -> str:
        return self.envoy_url + "/v1"

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def sim_config(self, **knobs) -> None:
        """Set the simulator's knobs for the requests that follow."""
        status, body = http_post(self.sim_url + "/sim/config", knobs)
        assert status == 200, body

    def sim_requests(self) -> list[dict]:
        return json.loads(http_get(self.sim_url + "/sim/requests")[1])

    def sim_received(self) -> int:
        """Generate requests the producer ever got (``/sim/requests`` keeps only the last 50)."""
        return json.loads(http_get(self.sim_url + "/sim/stats")[1])["received"]

    def sim_aborted(self) -> list[str]:
        return json.loads(http_get(self.sim_url + "/sim/aborted")[1])

    def sim_headers(self) -> list[dict]:
        """Request headers of the last 50 generate requests."""
        return json.loads(http_get(self.sim_url + "/sim/headers")[1])

    def sim_held(self) -> list[str]:
        """Engine ids of the requests the simulator holds (``hold_after``)."""
        return json.loads(http_get(self.sim_url + "/sim/stats")[1])["held"]

    def sim_release(self) -> list[str]:
        """Let the held requests go on; their engine ids."""
        status, body = http_post(self.sim_url + "/sim/release", {})
        assert status == 200, body
        return json.loads(body)["released"]

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@dataclass
class Target:
    """A filter whose ext_proc port a test speaks to directly (one worker: its process is the server),
    its Prometheus metrics, the simulator behind it and an Envoy in front of it."""

    filter: Proc
    port: int
    metrics_url: str
    sim: Proc
    sim_url: str
    envoy: Proc
    envoy_url: str

    def defences(self) -> dict[str, float]:
        """``derender_ext_proc_defences_total`` by defence, as the metrics port reports it now."""
        text = http_get(self.metrics_url, timeout=10)[1].decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("derender_ext_proc_defences_total{"):
                name = line.split('defence="', 1)[1].split('"', 1)[0]
                out[name] = float(line.rsplit(" ", 1)[1])
        return out

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.filter.popen.pid).memory_info().rss


    def stop(self) -> None:
        for p in (self.envoy, self.filter, self.sim):
            p.stop()


class PeakRss:
    """A process's peak resident memory, sampled every 20 ms by a thread of its own until ``stop()``,
    which returns how far it grew above where it started."""

    def __init__(self, pid: int) -> None:
        import threading

        import psutil

        self.process = psutil.Process(pid)
        self.before = self.peak = self.process.memory_info().rss
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        import psutil

        while not self.stopped.wait(0.02):
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:  # the process is gone: its test's own checks say so
                return

    def stop(self) -> int:
        self.stopped.set()
        self.thread.join(10)
        return self.peak - self.before


def start_target(model_dir: str, *flags: str, transport: str = "http2", **envoy_values) -> Target:
    """``Target``: ``derender serve`` with ``flags`` on ``transport``; ``envoy_values``: the Envoy
    template's (``start_envoy``)."""
    sim, sim_url = start_sim(model_dir)
    port, metrics = free_port(), free_port()
    flt = Proc(f"filter-{transport}", [*DERENDER, "serve", "--model", model_dir, "--served-model-name", "qwen3",
                                       "--max-model-len", "4096", "--port", str(port), "--producer", sim_url,
                                       "--workers", "1", "--metrics-port", str(metrics), "--transport", transport,
                                       *flags]).start()
    try:
        flt.wait(lambda: tcp_open(port), 300)
        envoy, base = start_envoy(port, sim_url, **envoy_values)
    except Exception:
        flt.stop()
        sim.stop()
        raise
    return Target(flt, port, f"http://127.0.0.1:{metrics}/metrics", sim, sim_url, envoy, base)
