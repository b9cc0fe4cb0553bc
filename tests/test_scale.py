"""``derender serve --workers auto``: one worker at start, another when one fills, connections moved to it.

The decisions (``extproc.scale.Scaler``) are checked on their own; the whole runs with a real Envoy,
a paced simulator and the filter's supervisor, with the busy threshold set low so that a test's load
fills a worker."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import psutil
import pytest
from stack import served_behind_envoy

from derender.extproc import scale
from derender.ops import envoy_config
from derender.extproc.scale import FORK, MOVE, Reading, Scaler


def reading(slot, busy, connections=0, listening=True, age=60.0) -> Reading:
    return Reading(slot, busy, connections, listening, age)


def test_a_busy_worker_alone_gets_a_sibling_once_per_window():
    scaler = Scaler(most=3, busy_at=0.7, window=10)
    assert scaler.decide([reading(0, 0.69, 4)], now=100) is None
    assert scaler.decide([reading(0, 0.9, 4, age=9)], now=100) is None  # too young to judge
    assert scaler.decide([reading(0, 0.9, 4, listening=False)], now=100) is None
    assert scaler.decide([reading(0, 0.9, 4)], now=100) == (FORK, -1)
    # the new worker not listening yet: no second fork within the window
    assert scaler.decide([reading(0, 0.9, 4), reading(1, 0.0, 0, listening=False, age=1)], now=105) is None
    both_busy = [reading(0, 0.9, 4), reading(1, 0.8, 3)]
    assert scaler.decide(both_busy, now=110) == (FORK, -1)
    assert scaler.decide([*both_busy, reading(2, 0.9, 3)], now=130) is None  # at most 3


def test_connections_move_from_a_busy_worker_to_one_with_room():
    scaler = Scaler(most=2, busy_at=0.7, window=10)
    newcomer = reading(1, 0.0, 0, age=1)  # young workers take connections before they can be judged
    assert scaler.decide([reading(0, 0.9, 4), newcomer], now=100) == (MOVE, 0)
    assert scaler.decide([reading(0, 0.9, 4), newcomer], now=101) is None  # settling
    assert scaler.decide([reading(0, 0.9, 3), reading(1, 0.1, 1)], now=102.5) == (MOVE, 0)
    assert scaler.decide([reading(0, 0.9, 2), reading(1, 0.2, 1)], now=105) is None  # within one: nothing to gain
    assert scaler.decide([reading(0, 0.9, 4), reading(1, 0.5, 0)], now=108) is None  # no room there, and at most 2
    assert scaler.decide([reading(0, 0.5, 4), reading(1, 0.0, 0)], now=110) is None  # not busy: left alone


def test_a_worker_with_no_connection_takes_the_only_one_of_a_busy_worker():
    """With the response leg Envoy's one thread holds one ext_proc connection (its streams last a render),
    and every request's leg runs where it is: a worker with room and none takes it from a busy one."""
    scaler = Scaler(most=2, busy_at=0.7, window=10)
    assert scaler.decide([reading(0, 0.9, 1), reading(1, 0.0, 0, age=1)], now=100) == (MOVE, 0)
    assert scaler.decide([reading(0, 0.9, 1), reading(1, 0.0, 0)], now=101) is None  # settling
    assert scaler.decide([reading(0, 0.1, 0), reading(1, 0.9, 1)], now=103) == (MOVE, 1)  # and back, once busy
    assert scaler.decide([reading(0, 0.9, 1), reading(1, 0.1, 1)], now=106) is None  # one each: nothing to gain
    assert scaler.decide([reading(0, 0.9, 0), reading(1, 0.0, 0)], now=109) is None  # nothing to move


def test_the_board_is_shared_with_a_forked_worker():
    board = scale.Board(2)
    board.clear(1)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            board.report(1, 0.75, 3)
            deadline = time.monotonic() + 10
            while board.moves(1) == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            board.report(1, 0.5, 2 if board.moves(1) == 1 else 99)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 10
    while board.reading(1) != (0.75, 3, True) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert board.reading(1) == (0.75, 3, True)
    assert board.reading(0) == (0.0, 0, False)
    board.ask_move(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert board.reading(1) == (0.5, 2, True)


def _envoy_connections(pid: int, port: int) -> int:
    try:
        return sum(
            1 for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
        )
    except psutil.NoSuchProcess:
        return 0


@pytest.fixture(scope="module", params=["ext_proc", "leg"])
def auto_stack(qwen3_dir, request):
    """``--workers auto`` behind Envoy, through ext_proc or (``leg``) with Envoy's config for the response
    leg: each request's leg runs on the worker whose ext_proc connection brought it."""
    flags = ["--workers", "auto", "--max-workers", "2", "--scale-busy", "0.03"]
    edit = envoy_config.response_leg if request.param == "leg" else None
    with served_behind_envoy(f"filter-auto-{request.param}", qwen3_dir, flags, sim_flags=("--delay", "0.02"),
                             edit=edit) as stack:  # fmt: skip
        yield stack


def test_auto_starts_one_worker_then_adds_one_that_takes_connections(auto_stack):
    """One worker at start; under load past --scale-busy a second is forked, the first hands it
    connections by graceful GOAWAYs (Envoy reconnects; the kernel gives the second some), and no
    stream breaks on the way."""
    flt, port, base = auto_stack
    supervisor = psutil.Process(flt.proc.pid)
    assert len(supervisor.children()) == 1
    text = " ".join(f"word{i}" for i in range(30))
    stop, failures, served = threading.Event(), [], [0]
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                body = {"model": "qwen3", "messages": [{"role": "user", "content": text}], "stream": True}
                try:
                    with http.stream("POST", base + "/v1/chat/completions", json=body) as r:
                        data = r.read().decode()
                    got = "".join(
                        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                        for line in data.splitlines()
                        if line.startswith("data: {") and '"choices":[{' in line
                    )
                    if r.status_code != 200 or got != text:
                        failures.append((r.status_code, data[:300]))
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                with lock:
                    served[0] += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(40)]  # Envoy: 16 streams a connection
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 120
        second = None
        while time.monotonic() < deadline and not failures:
            children = supervisor.children()
            if len(children) == 2:
                second = max(children, key=lambda p: p.create_time())
                if _envoy_connections(second.pid, port):
                    break
            time.sleep(0.5)
        assert not failures, failures[:3]
        assert second is not None, "no second worker was forked under load"
        assert _envoy_connections(second.pid, port), "the second worker never got one of Envoy's connections"
        before = served[0]
        time.sleep(3)  # both workers serving
        assert served[0] > before
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures, failures[:3]
    assert len(supervisor.children()) == 2
    log = flt.log.read_text()
    assert "adding worker 2 of up to 2" in log and "hands a connection to a worker with room" in log, log[-2000:]
