"""A fork server for the tests' ``derender`` processes: torch, transformers and the web libraries
and vLLM's serving modules imported once, each ``derender serve`` / ``sim`` / ``up`` a fork of it
running the CLI's ``main``.

A filter process spends about 8 s of CPU importing torch (its compiler packages with it),
transformers and vLLM before it reads its flags; the suite starts about fifty. ``stack.Proc`` hands every
``derender`` command line to this server when it runs (``DERENDER_TEST_FORKSERVER=0``: never), and
gets back a ``Forked``: what ``Child`` reads of a ``Popen`` (pid, poll, wait, signals, the exit code).

The fork is the program as ``python -m derender.cli`` would run it: a session of its own, stdin
from /dev/null, stdout and stderr to its log file, the caller's environment and directory, the CLI
module run as ``__main__``, then Python's own exit (non-daemon threads joined, ``atexit``). None of the filter's
own modules is imported here (its metrics read ``PROMETHEUS_MULTIPROC_DIR`` at import, which ``derender
serve`` sets; it also points prometheus-client, which vLLM imports, at it).

Protocol, one Unix connection per process: the request as one JSON line (argv after ``-m
derender.cli``, env, cwd, log); the reply ``{"pid": N}`` then, when it has ended, ``{"code": N}``
(the exit code as ``Popen.returncode`` gives it: minus the signal that ended it).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch._inductor.lowering",
    "transformers",
    "tokenizers",
    "pydantic",
    "fastapi",
    "aiohttp",
    "openai",
    "yaml",
    "orjson",
    "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.openai.responses.serving",
    "vllm.entrypoints.anthropic.serving",
    "vllm.renderers.hf",
    "vllm.tokenizers.hf",
)


# -- the server --------------------------------------------------------------------------------------
def serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    assert not any(name.startswith("derender.ops") for name in sys.modules), "the filter's own modules load in the fork"
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the path appears once the server takes connections
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}  # pid -> its caller's connection
    while os.getppid() == parent:  # the test session is gone: so is the server
        for _ in selector.select(timeout=0.2):
            conn, _ = listener.accept()
            conn.settimeout(10)
            try:
                request = json.loads(_line(conn).split(b"\n", 1)[0])
            except (OSError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                for other in running.values():
                    other.close()
                conn.close()
                _run(request)  # never returns
            running[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


def _line(conn: socket.socket) -> bytes:
    """At least one line, all of it."""
    data = b""
    while b"\n" not in data:
        more = conn.recv(65536)
        if not more:
            raise OSError("connection closed")
        data += more
    return data


def _run(request: dict) -> None:
    """In the fork: become ``python -m derender.cli ARGV`` and exit as it would."""
    import runpy
    import threading

    code = 0
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]  # as -m puts it first (not this file's folder)
        sys.argv = ["derender.cli", *request["argv"]]
        runpy.run_module("derender.cli", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as Python's own exit: join non-daemon threads
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


# -- the client --------------------------------------------------------------------------------------
class Forked:
    """A process the fork server forked, as ``Child`` uses a ``subprocess.Popen``."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str]) -> None:
        self.conn, self.pid, self.args = conn, pid, args
        self.returncode: int | None = None
        self._buffer = b""

    def _read(self, timeout: float | None) -> None:
        self.conn.settimeout(timeout)
        while b"\n" not in self._buffer:
            more = self.conn.recv(256)
            if not more:  # the server is gone: so is the process's parent; count it killed
                self.returncode = -signal.SIGKILL
                return
            self._buffer += more
        self.returncode = json.loads(self._buffer.split(b"\n", 1)[0])["code"]
        self.conn.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._read(0)
            except (BlockingIOError, TimeoutError):
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self._read(timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Server:
    """The fork server of this test session, started at the first ``derender`` process."""

    def __init__(self) -> None:
        self.path = f"/tmp/derender-forkserver-{os.getpid()}-{time.time_ns()}.sock"
        self.popen: subprocess.Popen | None = None

    def start(self, log: Path) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            self.popen = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.DEVNULL,
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def spawn(self, argv: list[str], env: dict[str, str], log: Path, timeout: float = 120) -> Forked:
        """``python -m derender.cli *argv`` forked by the server (started if it is not)."""
        if self.popen is None:
            self.start(log.parent / f"forkserver-{os.getpid()}-{time.time_ns()}.log")
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.path):
            if self.popen is None or self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start (see {log.parent}/forkserver-*.log)")
            time.sleep(0.05)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(30)
        conn.connect(self.path)
        conn.sendall(json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log)}).encode() + b"\n")
        first, rest = _line(conn).split(b"\n", 1)
        forked = Forked(conn, json.loads(first)["pid"], argv)
        forked._buffer = rest  # the exit code too, if it has already ended
        return forked

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            self.popen.wait(10)
        if os.path.exists(self.path):
            os.unlink(self.path)


if __name__ == "__main__":
    serve(sys.argv[1])
