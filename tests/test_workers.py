"""``derender serve --workers N``: N forked processes on one SO_REUSEPORT port, one supervisor."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import stat
import time

import psutil
import pytest
from stack import DERENDER, Proc, free_port, served_behind_envoy, tcp_open

from derender.extproc import health
from derender.extproc.health import EXT_PROC_SERVICE


def _listening(pid: int, port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in psutil.Process(pid).net_connections("tcp"))
    except psutil.NoSuchProcess:
        return False


def _wait_for(check, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return check()


@pytest.fixture(scope="module")
def workers_stack(qwen3_dir):
    two = lambda flt: len(psutil.Process(flt.proc.pid).children()) == 2  # noqa: E731
    with served_behind_envoy("filter-workers", qwen3_dir, ["--workers", "2"], ready=two) as stack:
        yield stack


def test_every_worker_listens_on_the_one_port(workers_stack):
    flt, port, _ = workers_stack
    workers = psutil.Process(flt.proc.pid).children()
    assert len(workers) == 2
    assert all(_wait_for(lambda w=w: _listening(w.pid, port)) for w in workers)
    assert not _listening(flt.proc.pid, port)  # the supervisor does not serve


def test_each_worker_warms_up_after_the_fork(workers_stack):
    flt, _, _ = workers_stack
    log = flt.log.read_text()
    assert log.count("derender.warmup: model qwen3 warmed up in ") == 2, log[-3000:]
    assert "warm-up of model" not in log


def test_a_chat_stream_through_envoy(workers_stack):
    from openai import OpenAI

    _, _, base = workers_stack
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    for _ in range(4):  # new streams, whichever worker Envoy's connection reached
        chunks = list(client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "two workers"}], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "two workers"
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_dead_worker_stops_the_rest(workers_stack):
    flt, _, _ = workers_stack
    workers = psutil.Process(flt.proc.pid).children()
    os.kill(workers[0].pid, signal.SIGKILL)
    assert flt.proc.wait(timeout=30) == 1  # the supervisor exits non-zero...
    assert _wait_for(lambda: not workers[1].is_running() or workers[1].status() == psutil.STATUS_ZOMBIE)  # ...after stopping the other


def _on_unix_socket(pid: int, path: str) -> bool:
    try:
        return any(c.laddr == path for c in psutil.Process(pid).net_connections("unix"))
    except psutil.NoSuchProcess:
        return False


def test_sigterm_stops_supervisor_and_workers(qwen3_dir):
    port = free_port()
    flt = Proc(
        "filter-workers-term",
        [*DERENDER, "serve", "--model", qwen3_dir, "--port", str(port), "--producer", "http://127.0.0.1:9", "--workers", "2"],
    ).start()
    try:
        flt.wait(lambda: tcp_open(port) and len(psutil.Process(flt.proc.pid).children()) == 2, 300)
        workers = psutil.Process(flt.proc.pid).children()
        os.kill(flt.proc.pid, signal.SIGTERM)  # the supervisor alone, not the process group
        assert flt.proc.wait(timeout=30) == 0
        assert _wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers))
        assert not tcp_open(port)
    finally:
        flt.stop()


def test_workers_on_a_unix_socket_alone(qwen3_dir, tmp_path):
    """``--uds PATH --no-tcp``, as ``derender up`` runs its filters: both workers accept on the one
    Unix socket, which only this user can reach, no TCP port is open but each worker's response leg
    listener on loopback (``extproc.leg``: requests with a token ext_proc handed out only), and the
    socket is gone once the filter stops."""
    port, uds = free_port(), str(tmp_path / "ext_proc.sock")
    flt = Proc(
        "filter-workers-unix",
        [*DERENDER, "serve", "--model", qwen3_dir, "--port", str(port), "--producer", "http://127.0.0.1:9", "--workers", "2",
         "--uds", uds, "--no-tcp"],
    ).start()
    try:
        flt.wait(lambda: len(psutil.Process(flt.proc.pid).children()) == 2
                 and all(_on_unix_socket(w.pid, uds) for w in psutil.Process(flt.proc.pid).children()), 300)
        workers = psutil.Process(flt.proc.pid).children()
        assert _wait_for(lambda: health.check(f"unix:{uds}", EXT_PROC_SERVICE))  # the workers' servers started
        assert stat.S_IMODE(os.stat(uds).st_mode) == 0o600
        assert all(health.check(f"unix:{uds}", EXT_PROC_SERVICE) for _ in range(6))  # a connection each
        assert not tcp_open(port)

        def listening() -> list:
            return [[c for c in w.net_connections("tcp") if c.status == psutil.CONN_LISTEN] for w in workers]

        # Each worker opens its leg listener as it starts, which the Unix socket (made before the fork) does not wait for.
        assert _wait_for(lambda: all(len(ls) == 1 and ls[0].laddr.ip == "127.0.0.1" for ls in listening())), listening()
        assert "response leg listening on 127.0.0.1:" in flt.log.read_text()
        os.kill(flt.proc.pid, signal.SIGTERM)
        assert flt.proc.wait(timeout=30) == 0
        assert _wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers))
        assert not os.path.exists(uds)
    finally:
        flt.stop()


@pytest.mark.parametrize("flags, said", [
    (["--no-tcp"], "--no-tcp needs --uds"),
    (["--uds", "x.sock", "--transport", "grpcio"], "--uds needs the filter's own transport"),
])
def test_listener_flags_that_cannot_work_are_refused_before_anything_loads(flags, said):
    import subprocess

    done = subprocess.run([*DERENDER, "serve", "--model", "unused", *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and said in done.stderr, done.stderr[-2000:]


@pytest.fixture
def collector_off():
    """The collector off, as ``derender serve`` loads the model; everything put back after."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def test_the_worker_serves_with_the_collector_on_and_the_model_frozen(collector_off):
    from derender.extproc import workers

    seen = []

    async def serve(reuse_port: bool) -> None:
        seen.append((gc.isenabled(), gc.get_freeze_count()))

    try:
        workers.run(serve, 0, 1)
    finally:
        asyncio.set_event_loop(None)  # run_one leaves its closed loop as this thread's
    [(enabled, frozen)] = seen
    assert enabled and frozen > 0


def test_a_helper_forked_before_the_workers_collects_its_garbage(collector_off):
    from derender.extproc import workers

    read, write = os.pipe()

    async def main() -> None:
        os.write(write, b"on" if gc.isenabled() else b"off")

    pid = workers.fork_helper("gc probe", main)
    os.close(write)
    try:
        assert os.read(read, 8) == b"on"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
