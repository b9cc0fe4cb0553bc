"""Child processes on loopback: started in a session of their own, awaited until ready, stopped whole.

``derender up`` runs the simulator, the filter and Envoy as ``Child``ren writing to its
stderr; the tests and the benchmark start the same programs the same way, each with its
own log file.
"""

from __future__ import annotations

import http.client
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

_HANDED_OUT: deque[int] = deque(maxlen=256)  # the ports ``free_port`` gave lately
_CLAIMED: set[int] = set()  # the ports this process was told to bind (``claim``)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_range() -> tuple[int, int] | None:
    """Where ``free_port`` draws from: ``DERENDER_PORT_RANGE`` ("LOW-HIGH", HIGH excluded) if set, else
    10000 up to the kernel's ephemeral range; None: let the kernel choose."""
    given = os.environ.get("DERENDER_PORT_RANGE", "")
    if given:
        first, _, end = given.partition("-")
        return int(first), int(end)
    low = _ephemeral_low()
    return (10000, low) if low > 12000 else None


def free_port() -> int:
    """A loopback port nothing listens on, for a program to bind. Drawn below the kernel's ephemeral
    range (``ip_local_port_range``): a port from it, free now, can be taken by any outgoing
    connection before that program binds it. Never one this process handed out lately, nor one it
    claimed (``claim``).

    Two programs drawing side by side (two ``derender up``, two test workers) can draw the same port
    and race to bind it; ``DERENDER_PORT_RANGE`` gives each a range of its own."""
    span = port_range()
    for _ in range(200):
        port = random.randrange(*span) if span else 0
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
                port = s.getsockname()[1]
        except OSError:
            continue
        if port not in _HANDED_OUT and port not in _CLAIMED:
            _HANDED_OUT.append(port)
            return port
    raise OSError("no free loopback port found")


def claim(*ports: int | None) -> None:
    """Ports this process was told to bind (``derender up --port``): ``free_port`` never hands them
    out, or one of the program's own children could take the port before it binds it."""
    _CLAIMED.update(port for port in ports if port)


def tcp_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def http_ok(url: str) -> bool:
    """``GET url`` answers 200 (straight to the address: no proxy from the environment)."""
    parts = urlsplit(url)
    try:
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=2)
        try:
            conn.request("GET", parts.path or "/")
            return conn.getresponse().status == 200
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return False


class Child:
    """One child process (and whatever it forks): its output to ``log``, or to this process's stderr."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.name = name
        self.argv = argv
        self.env = env or {}
        self.log = log
        self.popen: subprocess.Popen | None = None

    def start(self) -> Child:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        if self.log is None:
            self.popen = self._spawn(sys.stderr, env)
        else:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log, "wb") as out:
                self.popen = self._spawn(out, env)
        return self

    def _spawn(self, out, env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def exited(self) -> int | None:
        """The exit code once the process has ended, else None."""
        return self.popen.poll() if self.popen is not None else None

    def wait(self, ready: Callable[[], object], timeout: float) -> None:
        """Until ``ready()`` is true; RuntimeError if the process ends first or ``timeout`` s pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.exited()
            if code is not None:
                raise RuntimeError(f"{self.name} exited with code {code} while starting{self._log_end()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s{self._log_end()}")

    def tail(self, lines: int = 60) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def _log_end(self) -> str:
        return f"; the end of {self.log}:\n{self.tail()}" if self.log is not None else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """``sig`` to the process group, then SIGKILL if it has not ended within ``timeout`` s."""
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, sig)
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        except ProcessLookupError:
            pass
