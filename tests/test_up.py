"""`derender up`, run exactly as the README tells a user to run it."""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import psutil
import pytest
from openai import AuthenticationError, OpenAI

from derender.ops import children
from stack import LOGS, free_port, metric_total, start_sim, wait_for

BIN = Path(sys.executable).parent


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_up_with_an_external_producer_then_sigterm(qwen3_dir, qwen3_tokenizer):
    sim, producer = start_sim(qwen3_dir)  # echo mode
    port = free_port()
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"up-{os.getpid()}.log", "w+")
    up = subprocess.Popen(
        [str(BIN / "derender"), "up", "--model", qwen3_dir, "--served-model-name", "qwen3", "--producer", producer, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        ready = up.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in ready, (ready, log.seek(0) or log.read()[-3000:])
        children = _children(up.pid)
        assert len(children) >= 2  # filter + Envoy (the producer is external)

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        message = "Robot: 🤖 done"
        stream = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": message}], stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == qwen3_tokenizer.decode(qwen3_tokenizer.encode(message, add_special_tokens=False).ids)

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        wait_for(lambda: not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE],
                 "every child of derender up to exit", timeout=10)
        log.seek(0)
        said = log.read()
        # Our lines, not our dependencies' alarms (the newcomer issue): no false tokenizer warning,
        # no Triton messages (the filter runs no kernel), no leak dump at exit, one SIGTERM told once.
        for noise in ("incorrect regex pattern", "Triton", "vllm._C", "leaked", "SIGTERM again"):
            assert noise not in said, (noise, said[-3000:])
    finally:
        if up.poll() is None:
            up.kill()
        sim.stop()
        log.close()


def test_up_starts_the_simulator_by_default(qwen3_dir):
    """With an API key, as a user exposing the stack would start it, and Envoy reaching the filter on
    loopback TCP (``--filter-socket tcp``) instead of the default Unix socket."""
    port = free_port()
    up = subprocess.Popen(
        [str(BIN / "derender"), "up", "--model", qwen3_dir, "--port", str(port), "--api-key", "sk-local",
         "--filter-socket", "tcp"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert f"http://127.0.0.1:{port}/v1" in up.stdout.readline()
        assert len(_children(up.pid)) >= 3  # simulator + filter + Envoy
        assert not [c for c in _children(up.pid) if "--uds" in c.cmdline()]
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-wrong", max_retries=0).models.list()
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-local", max_retries=0)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "ping"}])
        assert r.choices[0].message.content == "ping"
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=30) == 0
    finally:
        if up.poll() is None:
            up.kill()


@pytest.mark.parametrize("flags", [[], ["--response-leg", "worker"]], ids=["by default", "worker"])
def test_up_with_the_response_leg_in_two_workers(qwen3_dir, qwen3_tokenizer, flags):
    """``up`` (its default, ``--response-leg auto``, takes the leg with these flags) with two workers: each
    worker's leg listener answers the requests it rendered (Envoy's ORIGINAL_DST cluster reaches the one
    its rewrite names), and the producer is reached by the workers themselves (``connection: close`` is
    theirs, not Envoy's)."""
    import concurrent.futures

    sim, producer = start_sim(qwen3_dir)  # echo mode
    port = free_port()
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"up-leg-{os.getpid()}.log", "w+")
    up = subprocess.Popen(
        [str(BIN / "derender"), "up", "--model", qwen3_dir, "--served-model-name", "qwen3", "--producer", producer,
         "--port", str(port), *flags, "--workers", "2"],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    try:
        ready = up.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in ready, (ready, log.seek(0) or log.read()[-3000:])
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

        def ask(i: int) -> str:
            message = f"worker leg {i}: 你好 🤖"
            stream = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": message}], stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert text == qwen3_tokenizer.decode(qwen3_tokenizer.encode(message, add_special_tokens=False).ids)
            return text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert len(list(pool.map(ask, range(16)))) == 16
        log.seek(0)
        assert log.read().count("response leg listening on 127.0.0.1:") == 2  # one listener a worker
        with urllib.request.urlopen(producer + "/sim/headers", timeout=10) as r:
            seen = json.loads(r.read())
        assert seen and all({k.lower(): v for k, v in h.items()}.get("connection") == "close" for h in seen[-16:])
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
    finally:
        if up.poll() is None:
            up.kill()
        sim.stop()


def test_up_stops_every_child_however_often_it_is_signalled(qwen3_dir):  # (qwen3_dir: fetched)
    """A double Ctrl-C, or SIGTERM from make and a supervisor at once: signals that arrive while
    `derender up` is already stopping its children must not break off the stop path. Started as
    `make up` starts it (no --model): the default model is served by its name."""
    port = free_port()
    up = subprocess.Popen(
        [str(BIN / "derender"), "up", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    children: list[psutil.Process] = []
    try:
        assert f"http://127.0.0.1:{port}/v1" in up.stdout.readline()
        children = _children(up.pid)
        names = {c.pid: " ".join(c.cmdline()) for c in children}
        envoy = [c for c in children if c.name() == "envoy"]
        assert envoy and any(" sim " in f" {n} " for n in names.values()), names
        assert [m.id for m in OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused").models.list().data] == ["qwen3"]
        up.send_signal(signal.SIGINT)
        # Envoy is stopped first: once it is gone, up is inside its stop path. From then on,
        # more signals until up returns.
        wait_for(lambda: not envoy[0].is_running() or envoy[0].status() == psutil.STATUS_ZOMBIE,
                 "derender up to stop Envoy", timeout=30)
        sent = 0
        while up.poll() is None and sent < 2000:
            up.send_signal((signal.SIGINT, signal.SIGTERM)[sent % 2])
            sent += 1
            try:
                up.wait(timeout=0.01)
            except subprocess.TimeoutExpired:
                pass
        assert up.wait(timeout=30) == 0
        assert sent > 0
        left = [names[c.pid] for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"left running after {sent} more signals: {left}"
    finally:
        if up.poll() is None:
            up.kill()
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass


def _start_up(port: int, name: str, *flags: str) -> tuple[subprocess.Popen, object, str]:
    """`derender up` with ``flags``, its log file, and the temporary folder it was given (nothing of
    its own may remain there once it stops)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"up-{name}-{os.getpid()}.log", "w+")
    tmp = tempfile.mkdtemp(prefix="up-tmp-")
    up = subprocess.Popen([str(BIN / "derender"), "up", "--port", str(port), *flags],
                          stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "TMPDIR": tmp})
    return up, log, tmp


def _stop_up(up: subprocess.Popen, children: list[psutil.Process], tmp: str) -> None:
    if up.poll() is None:
        up.kill()  # a failed assertion: up's children would outlive it
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    shutil.rmtree(tmp, ignore_errors=True)


def _conversation(port: int, turns: int = 3) -> list[int | None]:
    """A conversation's turns through `derender up`: the cached tokens each turn's usage reports."""
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Be brief. " * 40}, {"role": "user", "content": "Hello there, replica."}]
    cached = []
    for _ in range(turns):
        r = client.chat.completions.create(model="qwen3", messages=messages)
        cached.append(r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else None)
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
    return cached


def _bindable(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def _sim_stats(children: list[psutil.Process]) -> list[dict]:
    sims = [c for c in children if " sim " in " ".join(c.cmdline())]
    ports = sorted(int(c.cmdline()[c.cmdline().index("--port") + 1]) for c in sims)
    return [json.loads(urllib.request.urlopen(f"http://127.0.0.1:{p}/sim/stats").read()) for p in ports]


def test_up_with_simulated_replicas_routes_a_conversation_to_one_of_them(qwen3_dir):
    """`derender up --replicas 2 --routing prefix`: two simulators in one Envoy cluster, balanced
    by consistent hashing on the filter's prefix key; a conversation's turns reach one replica."""
    port = free_port()
    up, log, tmp = _start_up(port, "replicas", "--replicas", "2", "--routing", "prefix", "--workers", "1")
    children: list[psutil.Process] = []
    try:
        ready = up.stdout.readline()
        assert "2 producer replicas, prefix routing" in ready, (ready, log.seek(0) or log.read()[-3000:])
        children = _children(up.pid)
        cached = _conversation(port)
        stats = _sim_stats(children)
        assert sorted(s["received"] for s in stats) == [0, 3], stats
        # With several replicas the simulated fleet models vLLM's prefix cache and reports its hits,
        # and the client sees them: the later turns find the earlier ones cached.
        assert cached[0] == 0 and cached[1] > 0 and cached[2] >= cached[1], cached
        assert sum(s["cached_prompt_tokens"] for s in stats) == sum(cached)
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        assert not [f for f in os.listdir(tmp) if f.startswith("derender")], os.listdir(tmp)
        log.seek(0)
        said = log.read()
        # An operator's start-up log: no aiohttp banner for the simulators' internal ports, no vLLM
        # kernel lines, no Envoy warning about an unlimited listener (the overload manager sets one).
        for noise in ("Running on http", "Press CTRL+C", "IR op priority", "SSM cache type", "no configured limit"):
            assert noise not in said, (noise, said[-3000:])
        assert said.count("derender.sim: simulator (echo mode, prefix cache of 16384 blocks)") == 2, said[-3000:]
    finally:
        _stop_up(up, children, tmp)


def test_up_with_two_filter_processes_and_kv_events_routing(qwen3_dir):
    """`derender up --filters 2 --routing kv-events`: two filter processes (each with its KV events hub)
    behind Envoy's ext_proc cluster; Envoy spreads the requests over both, and each routes a
    conversation to the replica whose events say it holds it. Nothing remains once it stops."""
    port, metrics = free_port(), free_port()
    while metrics + 1 == port or not _bindable(metrics + 1):  # the second filter's metrics port
        metrics = free_port()
    up, log, tmp = _start_up(port, "filters", "--replicas", "2", "--routing", "kv-events", "--workers", "1",
                             "--filters", "2", "--metrics-port", str(metrics))
    procs: list[psutil.Process] = []
    try:
        ready = up.stdout.readline()
        assert "2 producer replicas, kv-events routing" in ready, (ready, log.seek(0) or log.read()[-3000:])
        procs = _children(up.pid)
        filters = [c for c in procs if " serve " in " ".join(c.cmdline())]
        serving = {c.cmdline()[c.cmdline().index("--port") + 1] for c in filters}
        assert len(serving) == 2 and len(filters) == 4, [c.cmdline() for c in filters]  # 2 filters, 2 hubs
        # Envoy reaches each filter process on a Unix socket of its own (--filter-socket unix, the
        # default), in the stack's folder, which only this user can enter, the socket only this user's.
        sockets = {c.cmdline()[c.cmdline().index("--uds") + 1] for c in filters}
        assert len(sockets) == 2 and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in sockets), sockets
        assert {stat.S_IMODE(os.stat(os.path.dirname(p)).st_mode) for p in sockets} == {0o700}
        assert not [c for f in filters for c in f.net_connections("tcp")  # no TCP port but the metrics'
                    if c.status == psutil.CONN_LISTEN and c.laddr.port not in (metrics, metrics + 1)]
        cached = []
        for _ in range(3):  # three conversations of three turns
            cached += _conversation(port)
        stats = _sim_stats(procs)
        assert sum(s["received"] for s in stats) == 9, stats
        assert all(c > 0 for i, c in enumerate(cached) if i % 3), cached  # later turns: their replica

        def route_lines() -> list[str]:
            log.seek(0)
            return [line for line in log.read().splitlines() if " route=" in line]

        def served() -> list[float]:
            return [metric_total(f"http://127.0.0.1:{metrics + i}/metrics", "derender_routed_requests_total")
                    for i in range(2)]

        # A request's log line and its routing metrics are written when its ext_proc stream ends, which
        # can come after the client has read the answer's last byte: wait for the ninth request's.
        routes = wait_for(lambda: len(r := route_lines()) >= 9 and r, "the ninth request's log line")
        assert len(routes) == 9 and all(" routing=kv-events " in line for line in routes), routes
        counts = wait_for(lambda: sum(c := served()) >= 9 and c, "the ninth routed request in the metrics")
        assert sum(counts) == 9 and min(counts) > 0, counts  # both filter processes took requests
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        assert not [f for f in os.listdir(tmp) if f.startswith("derender")], os.listdir(tmp)
    finally:
        _stop_up(up, procs, tmp)


def test_ports_are_drawn_from_derender_port_range(monkeypatch):
    """``DERENDER_PORT_RANGE`` keeps side-by-side programs (two ``derender up``, two test workers) off
    each other's ports: every port ``up`` and the tests draw comes from it, none twice lately."""
    monkeypatch.setenv("DERENDER_PORT_RANGE", "23000-23100")
    ports = [free_port() for _ in range(20)]
    assert all(23000 <= port < 23100 for port in ports), ports
    assert len(set(ports)) == len(ports)
    # A port the process was told to bind (``up --port``) is never drawn for one of its children.
    monkeypatch.setenv("DERENDER_PORT_RANGE", "23200-23202")
    monkeypatch.setattr(children, "_CLAIMED", set())
    children.claim(23200)
    drawn = []
    for _ in range(10):
        monkeypatch.setattr(children, "_HANDED_OUT", collections.deque(maxlen=256))  # none handed out lately
        drawn.append(free_port())
    assert drawn == [23201] * 10, drawn
    monkeypatch.delenv("DERENDER_PORT_RANGE")  # else: below the kernel's ephemeral range
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert children.port_range() == ((10000, low) if low > 12000 else None)
