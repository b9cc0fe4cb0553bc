"""The listening socket (cleartext, or TLS with ALPN h2), its connections, their timers, and the
defences' count."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as ssl_
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from .connection import Connection
from .handlers import Methods
from .inbound import Budget
from .wire import Limits

log = logging.getLogger("derender.http2")

LOG_EVERY = 10.0  # seconds between two log lines about the same defence
# Seconds since its last request's stream opened that an idle connection still counts as carrying requests:
# the busy ratio's window (``ops.busy.WINDOW``), whose load that connection brought.
CARRIED = 10.0


class Server:
    """The listening socket, its connections, and the methods they serve.

    ``on_defence(name)`` is told each time a defence acts (``derender.ops.metrics`` counts them);
    ``defences`` keeps the same counts."""

    connection: type[Connection] = Connection  # the protocol run on each connection
    plain = False  # plain HTTP, not gRPC (``Machine.plain``)

    def __init__(
        self, methods: Methods, limits: Limits | None = None, on_defence: Callable[[str], None] | None = None
    ) -> None:
        self.methods = methods
        self.limits = limits or Limits()
        self.on_defence = on_defence
        self.defences: Counter[str] = Counter()
        self.connections: set[Connection] = set()
        self.budget = Budget(self.limits.max_buffered_total)  # message bytes held by all its connections
        self.draining = False
        self._server: asyncio.base_events.Server | None = None
        self._unix: asyncio.base_events.Server | None = None
        self._stopped = asyncio.Event()
        self._sweep: asyncio.Task | None = None
        self._logged: dict[str, tuple[float, int]] = {}

    def defended(self, name: str, why: str = "") -> None:
        """A defence acted: counted, and logged (at most once per ``LOG_EVERY`` seconds a defence)."""
        self.defences[name] += 1
        if self.on_defence is not None:
            self.on_defence(name)
        if not why:
            return
        now = time.monotonic()
        last, since = self._logged.get(name, (0.0, 0))
        if now - last >= LOG_EVERY:
            more = f" (and {since} more since the last report)" if since else ""
            log.warning("%s [%s]%s", why, name, more)
            self._logged[name] = (now, 0)
        else:
            self._logged[name] = (last, since + 1)

    async def start(
        self,
        host: str | list[str],
        port: int | None,
        reuse_port: bool = False,
        ssl: ssl_.SSLContext | None = None,
        unix: socket.socket | None = None,
    ) -> None:
        """Listen on ``host:port`` (not with ``port`` None) and, with ``unix`` (a listening Unix socket,
        maybe shared with sibling workers), there too: the same connections, bounds and TLS."""
        loop = asyncio.get_running_loop()
        extra: dict[str, Any] = (
            {"ssl": ssl, "ssl_handshake_timeout": self.limits.preface_timeout} if ssl is not None else {}
        )
        hosts = [h.strip("[]") for h in ([host] if isinstance(host, str) else host)]
        if port is not None:
            self._server = await loop.create_server(
                lambda: self.connection(self),
                [h for h in hosts if h] or None,
                port,
                reuse_port=reuse_port,
                backlog=1024,
                **extra,
            )
        if unix is not None:
            self._unix = await loop.create_unix_server(lambda: self.connection(self), sock=unix, backlog=1024, **extra)
        self._sweep = loop.create_task(self._sweep_timers())

    async def _sweep_timers(self) -> None:
        limits = self.limits
        every = min(
            1.0,
            limits.preface_timeout / 4,
            limits.settings_timeout / 4,
            limits.keepalive_timeout / 4,
            limits.idle_timeout / 4,
        )
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(every)
            now = loop.time()
            for connection in list(self.connections):
                connection.tick(now)

    @property
    def reserved(self) -> int:
        """Message bytes held by all the connections, against ``Limits.max_buffered_total``."""
        return self.budget.reserved

    def streams(self) -> int:
        return sum(len(c.machine.streams) for c in self.connections)

    def _movable(self) -> list[Connection]:
        recent = asyncio.get_running_loop().time() - CARRIED
        return [
            c for c in self.connections
            if (c.machine.streams or c.last_call >= recent) and not c.machine.goaway_phase and not c.machine.ending
        ]  # fmt: skip

    def movable(self) -> int:
        """Connections carrying requests that could be handed to another worker (``retire_one``): with streams
        open, or one opened in the last ``CARRIED`` seconds (with the response leg a request's ext_proc stream
        lasts only its render, and the connection is idle between requests)."""
        return len(self._movable())

    def retire_one(self) -> bool:
        """A graceful GOAWAY on the connection with the most streams: they finish, the peer's next
        streams go to a new connection (which the kernel may give another worker)."""
        movable = self._movable()
        if not movable:
            return False
        busiest = max(movable, key=lambda c: (len(c.machine.streams), c.last_call))
        log.info(
            "handing a connection with %d streams to the other workers (a graceful GOAWAY)",
            len(busiest.machine.streams),
        )
        busiest.retire()
        return True

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new connections and streams (GOAWAY), give the open streams ``grace`` seconds, then cut them."""
        self.draining = True
        for listening in (self._server, self._unix):
            if listening is not None:
                listening.close()
        for connection in list(self.connections):
            connection.drain()
        if grace:
            deadline = asyncio.get_running_loop().time() + grace
            while self.streams() and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110 - a count over many connections
                await asyncio.sleep(0.05)
        tasks = []
        for connection in list(self.connections):
            for call in list(connection.calls.values()):
                if call.task is not None and not call.task.done():
                    call.task.cancel()
                    tasks.append(call.task)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for connection in list(self.connections):
            connection.close()
        if self._sweep is not None:
            self._sweep.cancel()
        self._stopped.set()


def tls_context(cert: str, key: str | None, client_ca: str | None = None) -> ssl_.SSLContext:
    """A server TLS context for the ext_proc port: TLS 1.2+, ALPN h2; with ``client_ca``, a client
    certificate signed by it is required (mTLS)."""
    context = ssl_.SSLContext(ssl_.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl_.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"])
    if client_ca:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl_.CERT_REQUIRED
    return context
