"""The worker's leg listener: Envoy's HTTP/2 streams for the requests this worker rendered.

``LegServer.hand`` starts a rendered request's producer leg (``producer.Leg``) and parks it under a
one-time token for Envoy to bring. Envoy brings it on an HTTP/2 connection of its pool to this worker
(``envoy_config.response_leg``), served by the filter's own frame layer in plain HTTP mode
(``http2.Machine.plain``): a stream is one request, POST with its token and no body, and its answer's
DATA as the leg writes it. Many streams share a connection, so what one loop turn writes for several
streams leaves in one send, as on the ext_proc port; HTTP/1.1 here cost Envoy and the worker a read and
a write per event and stream (docs/performance.md, "The response leg on HTTP/2").

Only Envoy has a reason to connect, and only with a token ext_proc just handed it. The frame layer's
bounds hold as on the ext_proc port (``LIMITS``: connections, streams per connection, header lists,
the preface, idle and keepalive timeouts, the flood and reset defences, docs/ext-proc-port.md), its
defences counted as ``leg_<name>``; a stream without a live token is answered 503, another method 405,
each in OpenAI's shape, and a body resets the stream (``leg_token``, ``leg_method``, ``leg_body``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import cast

from ...endpoints.router import ModelExchange
from ...exchange import Rewrite
from ...translate.errors import HTTPError
from ..http2 import Connection, Limits, Server
from ..http2.connection import Call
from ..http2.events import Opened
from ..listen import hostport, listen_hosts
from . import CAPABLE, LEG_HEADER
from .parked import Parked
from .producer import Leg
from .wire import Replicas

log = logging.getLogger("derender.leg")

# Envoy's leg cluster opens as many connections as 100 streams each need, and lets one idle for 30 s go
# (``envoy_config.response_leg``); a client's request headers come through whole (Envoy takes 60 KiB).
LIMITS = Limits(max_header_list=128 << 10, max_header_block=128 << 10, idle_timeout=60.0)
CONNECTION_SPECIFIC = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"})


class LegServer:
    """One worker's leg listener, on ``host`` and a port the system picks (``address`` once started)."""

    def __init__(self, producer_url: str, host: str = "127.0.0.1", on_defence: Callable[[str], None] | None = None,
                 parked: Parked | None = None, limits: Limits = LIMITS) -> None:  # fmt: skip
        self.replicas = Replicas([url.strip() for url in producer_url.split(",") if url.strip()])
        self.host = host
        self.parked = parked or Parked()
        self.address = ""
        self.legs: set[Leg] = set()
        self.server = _Server(self, limits, on_defence)
        self._quiet: asyncio.Event | None = None  # set when draining and the last answer is whole

    async def start(self) -> str:
        host = listen_hosts(self.host)[0]  # a network (``--leg-host 172.30.90.0/24``): this machine's address in it
        await self.server.start(host, 0)
        self.address = hostport(host, self.server.port)
        log.info("response leg listening on %s", self.address)
        return self.address

    @staticmethod
    def takes(metadata: dict[str, str]) -> bool:
        """Whether a request of this ext_proc stream comes here: its Envoy's config has the leg (its metadata,
        ``CAPABLE``, says so). The filter then asks Envoy, with its reply to the request's headers, for nothing
        of the response (``messages.LEG_MODE``): Envoy takes no change of mode after the headers."""
        return metadata.get(CAPABLE[0]) == CAPABLE[1]

    def hand(self, exchange: ModelExchange, rewrite: Rewrite) -> str | None:
        """Start ``exchange``'s producer leg and park it for Envoy: its token, or None when too many wait."""
        if self.parked.full:
            return None
        leg = Leg(exchange, rewrite, exchange.ctx.headers, self.replicas, self.leg_done)
        self.legs.add(leg)
        leg.start()
        return self.parked.park(leg)

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
        await self.server.stop(0)
        self.parked.close()


class StreamFront:
    """One leg's stream on a connection from Envoy: what the leg writes (``producer.Front``)."""

    __slots__ = ("call", "closed", "connection", "id", "leg")

    def __init__(self, connection: _Connection, call: Call, leg: Leg) -> None:
        self.connection = connection
        self.call = call
        self.id = call.id
        self.leg = leg
        self.closed = False

    def head(self, status: int, headers: list[tuple[bytes, bytes]], length: int | None) -> None:
        if not self.connection.machine.is_open(self.id):  # reset: its ``Ended`` tells the leg
            return
        fields = [(":status", str(status))]
        fields += [(k.lower().decode("latin-1"), v.decode("latin-1")) for k, v in headers
                   if k.lower() not in CONNECTION_SPECIFIC and k.lower() != b"content-length"]  # fmt: skip
        if length is not None:
            fields.append(("content-length", str(length)))
        self.connection.machine.respond(self.id, fields)
        self.connection.flush_soon()

    def body(self, data: bytes) -> None:
        connection = self.connection
        if not data or self.call.ended or not connection.machine.is_open(self.id):
            return
        if not connection.machine.send(self.id, data) and self.call.drained is None:  # it waits for Envoy's window
            self.leg.hold("window")
            self.call.drained = drained = connection.loop.create_future()
            drained.add_done_callback(lambda _: self.leg.release("window"))
        connection.flush_soon()

    def end(self, data: bytes) -> None:
        self.body(data)
        if not self.call.ended:
            self.call.ended = True
            self.connection.machine.finish(self.id, 0, "")  # an empty DATA frame with END_STREAM
            self.connection.flush_soon()

    def finish(self) -> None:
        self.connection.done(self)

    def abort(self) -> None:
        """Break the stream off: Envoy resets its client's stream."""
        if not self.call.ended:
            self.call.ended = True
            self.connection.machine.reset(self.id)
            self.connection.flush_soon()
        self.connection.done(self)


class _Connection(Connection):
    """One HTTP/2 connection from Envoy: each new stream takes the leg parked under its token."""

    server: _Server

    def __init__(self, server: _Server) -> None:
        super().__init__(server)
        self.fronts: dict[int, StreamFront] = {}

    def flush_soon(self) -> None:
        """At the loop turn's end: the machine's events, then one send of what the turn wrote."""
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._turn_end)

    def _turn_end(self) -> None:
        self._pump()  # ``scheduled`` still set: it schedules no send of its own
        self._flush_out()

    def _opened(self, event: Opened) -> None:
        call = self.calls[event.stream_id] = Call(event.stream_id, None)
        if event.method != "POST":
            self._refuse(call, 405, "POST only", "leg_method")
            return
        token = event.metadata.get(LEG_HEADER)
        leg = cast("Leg | None", self.server.legs.parked.take(token) if token else None)  # parked: only legs
        if leg is None:
            why = "no rendered request waits under this token: it expired, or none was handed out"
            self._refuse(call, 503, why, "leg_token")
            return
        front = self.fronts[call.id] = StreamFront(self, call, leg)
        leg.attach(front)

    def _refuse(self, call: Call, status: int, message: str, defence: str) -> None:
        self.server.defended(defence)
        call.ended = True
        if not self.machine.is_open(call.id):  # reset before its answer (its ``Ended`` is next)
            self._release(call)
            return
        body = HTTPError(status, message).body()
        fields = [(":status", str(status)), ("content-type", "application/json"), ("content-length", str(len(body)))]
        self.machine.respond(call.id, fields)
        self.machine.send(call.id, body)
        self.machine.finish(call.id, 0, "")
        self._release(call)
        self.flush_soon()

    def _release(self, call: Call) -> None:
        if self.calls.pop(call.id, None) is not None:
            self.machine.handler_done()

    def done(self, front: StreamFront) -> None:
        """The leg is over (whole, or broken off): its stream's place is free."""
        if not front.closed:
            front.closed = True
            self.fronts.pop(front.id, None)
            self._release(front.call)

    def _message(self, stream_id: int, item: object) -> None:
        pass  # a leg's request has no body: its end is nothing to act on

    def _ended(self, stream_id: int) -> None:
        """Envoy reset the stream (its client left), or the connection went."""
        call = self.calls.get(stream_id)
        if call is not None:
            call.ended = True
            self._wake(call)
        front = self.fronts.get(stream_id)
        if front is not None:
            front.leg.client_gone()
            self.done(front)
        elif call is not None:
            self._release(call)

    def pause_writing(self) -> None:
        super().pause_writing()
        for front in self.fronts.values():
            front.leg.hold("socket")

    def resume_writing(self) -> None:
        super().resume_writing()
        for front in list(self.fronts.values()):
            front.leg.release("socket")


class _Server(Server):
    """The frame layer's listener in plain HTTP mode, for a ``LegServer``."""

    connection = _Connection
    plain = True

    def __init__(self, legs: LegServer, limits: Limits, on_defence: Callable[[str], None] | None) -> None:
        super().__init__({}, limits, on_defence)
        self.legs = legs

    def defended(self, name: str, why: str = "") -> None:
        super().defended(name if name.startswith("leg_") else f"leg_{name}", why)

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]
