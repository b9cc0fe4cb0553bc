"""The worker's leg listener: Envoy's HTTP/1.1 requests for the requests this worker rendered.

``LegServer.hand`` starts a rendered request's producer leg (``producer.Leg``) and parks it under a
one-time token for Envoy to bring; ``Front`` is Envoy's connection, which takes it by that token.

Only Envoy has a reason to connect, and only with a token ext_proc just handed it; everything else is
refused at once with an error in OpenAI's shape, and the connection closed. The bounds, per worker:
a new connection's first request must begin within ``FIRST_REQUEST`` seconds (Envoy connects when it
has one to send) and a kept-alive one's next within ``IDLE`` (Envoy's pool lets its idle connections go
sooner: ``envoy_config.response_leg``); a request's head and body within ``HEAD_TIMEOUT``; the head at
most ``MAX_HEAD`` bytes and ``MAX_HEADERS`` lines (431), the body ``MAX_BODY`` (413: ext_proc sends it
empty, the rendered request went to the producer from here), POST only (405), one request at a time,
``MAX_CONNECTIONS`` connections (past it a new one is closed). Each defence that acts is counted
(``derender_defences_total``, as the ext_proc port's are).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import httptools

from ...endpoints.router import ModelExchange
from ...exchange import Rewrite
from ...translate.errors import HTTPError
from ..listen import hostport
from . import LEG_HEADER
from .parked import Parked
from .producer import Leg
from .wire import Target, head

log = logging.getLogger("derender.leg")

FIRST_REQUEST = 10.0
IDLE = 60.0
HEAD_TIMEOUT = 10.0
MAX_HEAD = 128 << 10
MAX_HEADERS = 256
MAX_BODY = 64 << 10
MAX_CONNECTIONS = 10000
_LEG = LEG_HEADER.encode()


class _Refused(Exception):
    def __init__(self, status: int, message: str, defence: str) -> None:
        super().__init__(message)
        self.status, self.message, self.defence = status, message, defence


class LegServer:
    """One worker's leg listener, on ``host`` and a port the system picks (``address`` once started)."""

    def __init__(self, producer_url: str, host: str = "127.0.0.1", on_defence: Callable[[str], None] | None = None,
                 parked: Parked | None = None) -> None:  # fmt: skip
        self.target = Target(producer_url)
        self.host = host
        self.on_defence = on_defence
        self.parked = parked or Parked()
        self.address = ""
        self.connections: set[Front] = set()
        self.legs: set[Leg] = set()
        self._server: asyncio.AbstractServer | None = None
        self._quiet: asyncio.Event | None = None  # set when draining and the last answer is whole

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Front(self), self.host, 0, backlog=1024)
        port = self._server.sockets[0].getsockname()[1]
        self.address = hostport(self.host, port)
        log.info("response leg listening on %s", self.address)
        return self.address

    def hand(self, exchange: ModelExchange, rewrite: Rewrite) -> str | None:
        """Start ``exchange``'s producer leg and park it for Envoy: its token, or None when too many wait."""
        if self.parked.full:
            return None
        leg = Leg(exchange, rewrite, exchange.ctx.headers, self.target, self.leg_done)
        self.legs.add(leg)
        leg.start()
        return self.parked.park(leg)

    def defence(self, name: str) -> None:
        if self.on_defence is not None:
            self.on_defence(name)

    def leg_done(self, leg: Leg) -> None:
        self.legs.discard(leg)
        if self._quiet is not None and not self.legs:
            self._quiet.set()

    async def drain(self, seconds: float) -> None:
        """Until the answers under way are whole, or ``seconds`` have passed."""
        if not self.legs:
            return
        self._quiet = asyncio.Event()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._quiet.wait(), max(0.0, seconds))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for front in list(self.connections):
            front.abort()
        self.parked.close()


class Front(asyncio.Protocol):
    """One connection from Envoy."""

    def __init__(self, server: LegServer) -> None:
        self.server = server
        self.transport: Any = None
        self.parser = httptools.HttpRequestParser(self)
        self.timer: asyncio.TimerHandle | None = None
        self.leg: Leg | None = None
        self.taken: Leg | None = None  # its request's leg, taken by the token, until its body is read
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.body_bytes = 0
        self.token: bytes | None = None

    def _time(self, seconds: float, why: str) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(seconds, self._timed_out, why)

    def _timed_out(self, why: str) -> None:
        self.timer = None
        self.server.defence(why)
        self.abort()

    # -- the connection ------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        if len(self.server.connections) >= MAX_CONNECTIONS:
            self.server.defence("leg_connections")
            transport.abort()
            return
        self.server.connections.add(self)
        self._time(FIRST_REQUEST, "leg_first_request")

    def data_received(self, data: bytes) -> None:
        if self.leg is not None:  # one request at a time: Envoy never sends another before the answer
            self.server.defence("leg_pipelined")
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refused = exc.__context__
            if isinstance(refused, _Refused):
                self._refuse(refused)
            else:
                log.error("a leg request failed", exc_info=refused)
                self.abort()
        except httptools.HttpParserUpgrade:
            self._refuse(_Refused(400, "no upgrades here", "leg_malformed"))
        except httptools.HttpParserError:
            self._refuse(_Refused(400, "malformed HTTP/1.1", "leg_malformed"))

    def pause_writing(self) -> None:
        if self.leg is not None:
            self.leg.pause()

    def resume_writing(self) -> None:
        if self.leg is not None:
            self.leg.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        leg, self.leg = self.leg, None
        if leg is not None:
            leg.client_gone()
        elif self.taken is not None:  # its request's body did not come whole
            self.taken.client_gone()
            self.taken = None

    # -- what a leg asks (``producer.Front``) ----------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def finish(self) -> None:
        self.leg = None
        if not self.parser.should_keep_alive():
            self.transport.close()
            return
        self._time(IDLE, "leg_idle")

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- httptools' callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._reset()
        self._time(HEAD_TIMEOUT, "leg_slow_request")

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        self.headers.append((name, value))
        if len(self.headers) > MAX_HEADERS:
            raise _Refused(431, f"more than {MAX_HEADERS} header lines", "leg_headers")
        if name.lower() == _LEG:
            self.token = value

    def _count(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > MAX_HEAD:
            raise _Refused(431, f"a request head over {MAX_HEAD} bytes", "leg_headers")

    def on_headers_complete(self) -> None:
        if self.parser.get_method() != b"POST":
            raise _Refused(405, "POST only", "leg_method")
        leg = self.server.parked.take(self.token.decode("latin-1")) if self.token else None
        if leg is None:
            raise _Refused(503, "no rendered request waits under this token: it expired, or none was handed out",
                           "leg_token")  # fmt: skip
        self.taken = leg  # type: ignore[assignment]  # parked: only legs

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > MAX_BODY:
            raise _Refused(
                413, f"a body over {MAX_BODY} bytes (the rendered request is not sent through here)", "leg_body"
            )

    def on_message_complete(self) -> None:
        leg, self.taken = self.taken, None
        assert leg is not None  # on_headers_complete refused the request otherwise
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.leg = leg
        leg.attach(self)

    def _refuse(self, refused: _Refused) -> None:
        self.server.defence(refused.defence)
        if self.taken is not None:
            self.taken.client_gone()
            self.taken = None
        body = HTTPError(refused.status, refused.message).body()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        self.write(head(refused.status, headers, len(body)) + body)
        if self.transport is not None:
            self.transport.close()
