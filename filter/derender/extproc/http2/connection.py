"""One HTTP/2 connection on a socket: the asyncio side of a ``machine.Machine``.

The machine holds the protocol; this feeds it what the socket reads, runs a task per stream for its
handler (``read`` and ``write`` over the machine), acts on the machine's events, and writes what the
machine has to send once per loop turn, so that a GPU's batch of replies leaves in a few sends. A
peer that reads slower than the server writes is not read either until it catches up
(CVE-2019-9517); writers wait meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from grpc.aio import EOF

from .events import Close, Defended, Drained, Ended, Opened
from .handlers import METADATA, Handler, serve_handler
from .machine import Machine

if TYPE_CHECKING:
    from .server import Server

LINGER = 2.0  # seconds a closing connection's input is still read and dropped
HEALTH_PATH = "/grpc.health.v1.Health/"  # a health checker's calls: they make no connection one that carries requests


class Call:
    """A stream's handler, as this side runs it."""

    __slots__ = ("drained", "ended", "id", "parse", "task", "waiter")

    def __init__(self, stream_id: int, parse) -> None:
        self.id = stream_id
        self.parse = parse  # the request type's FromString
        self.task: asyncio.Task | None = None
        self.waiter: asyncio.Future | None = None  # a read() waiting for a ``Message``
        self.drained: asyncio.Future | None = None  # a write() waiting for a ``Drained``
        self.ended = False  # the stream is over: its status sent, or it was reset


class Connection(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.machine = Machine(
            server.limits, server.budget, server.methods, self.loop.time, server.draining, server.plain
        )
        self.calls: dict[int, Call] = {}
        self.transport: asyncio.Transport | None = None
        self.paused: asyncio.Future | None = None
        self.scheduled = False  # a flush at this loop turn's end
        self.lingering = False  # our side shut: what the peer still sends is read and dropped
        self.last_call = float("-inf")  # when a request's stream (not a health check) last opened here

    # -- the machine's output -----------------------------------------------------------------------
    def _pump(self) -> None:
        """Act on the machine's events; what it has to send leaves at the loop turn's end."""
        machine = self.machine
        handed = machine.handed
        if handed:  # the messages handed to waiting handlers (``events.Message``): one per token
            for stream_id, item in handed:
                self._message(stream_id, item)
            handed.clear()
        events = machine.events
        while events:
            event = events.popleft()
            kind = type(event)
            if kind is Drained:
                call = self.calls.get(event.stream_id)
                if call is not None:
                    self._wake(call)
            elif kind is Opened:
                self._opened(event)
            elif kind is Ended:
                self._ended(event.stream_id)
            elif kind is Defended:
                self.server.defended(event.name, event.why)
            elif kind is Close:
                self._close()
        if machine.outbound.out and not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._flush_out)

    def _flush_out(self) -> None:
        self.scheduled = False
        data = self.machine.data_to_send()
        transport = self.transport
        if data and transport is not None and not transport.is_closing() and not self.lingering:
            transport.write(data)
            if not transport.get_write_buffer_size():
                self.machine.sent_all()

    def _close(self) -> None:
        """Close after what is written; with TCP, a lingering close: FIN first, then what the peer
        still sends is read and dropped (for ``LINGER`` seconds at most), so that the kernel does not
        answer it with a reset that would destroy the GOAWAY before the peer reads it."""
        self._flush_out()
        transport = self.transport
        if transport is None or transport.is_closing() or self.lingering:
            return
        if transport.can_write_eof():
            self.lingering = True
            transport.write_eof()
            if self.paused is None:
                transport.resume_reading()
            self.loop.call_later(LINGER, transport.abort)
        else:
            transport.close()

    # -- streams --------------------------------------------------------------------------------------
    def _opened(self, event: Opened) -> None:
        parse, handler = self.server.methods[event.path]
        if not event.path.startswith(HEALTH_PATH):
            self.last_call = self.loop.time()
        call = self.calls[event.stream_id] = Call(event.stream_id, parse)
        call.task = self.loop.create_task(self._run(call, handler, event.metadata))
        call.task.add_done_callback(lambda task: self._handler_done(call))  # one cancelled before it ran too

    def _handler_done(self, call: Call) -> None:
        if self.calls.get(call.id) is call:
            del self.calls[call.id]
        self.machine.handler_done()

    def _message(self, stream_id: int, item: object) -> None:
        call = self.calls.get(stream_id)
        waiter = call.waiter if call is not None else None
        if waiter is not None and not waiter.done():
            call.waiter = None  # type: ignore[union-attr]
            waiter.set_result(item)
        else:  # its read() was cancelled
            self.machine.unread(stream_id, item)

    def _ended(self, stream_id: int) -> None:
        call = self.calls.get(stream_id)
        if call is None:
            return
        call.ended = True
        self._wake(call)
        if call.task is not None and not call.task.done():
            call.task.cancel()

    @staticmethod
    def _wake(call: Call) -> None:
        drained, call.drained = call.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    async def _run(self, call: Call, handler: Handler, metadata: dict[str, str]) -> None:
        if metadata:
            METADATA.set(metadata)  # this task's own context: its handler's
        machine, loop, stream_id = self.machine, self.loop, call.id

        async def read() -> object:
            item = machine.read(stream_id)
            if item is None:  # nothing waits (and nothing was written): a ``Message`` brings it
                call.waiter = waiter = loop.create_future()
                try:
                    item = await waiter
                except asyncio.CancelledError:
                    machine.stop_reading(stream_id)
                    raise
            else:
                self._pump()  # its bytes went back to the windows
            return item if item is EOF else call.parse(item)

        async def write(message) -> None:
            """The reply goes out as far as the windows allow; while the peer's window holds it back,
            or the socket's writes are paused, the handler waits."""
            if call.ended:
                raise ConnectionResetError("the ext_proc stream is closed")
            if machine.send(stream_id, message.SerializeToString()):  # written: no event comes of a send
                if not self.scheduled:
                    self.scheduled = True
                    loop.call_soon(self._flush_out)
            else:
                call.drained = drained = loop.create_future()
                self._pump()
                await drained
            if self.paused is not None:
                await asyncio.shield(self.paused)

        await serve_handler(handler, read, write, call, self._finish)

    def _finish(self, call: Call, status: int, why: str) -> None:
        call.ended = True
        self.machine.finish(call.id, status, why)
        self._pump()

    # -- what the server asks -------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        self.machine.tick(now)
        self._pump()

    def drain(self) -> None:
        """The server stops: GOAWAY, no new streams."""
        self.machine.drain()
        self._pump()

    def retire(self) -> None:
        """Hand the peer's next streams to another connection (a graceful GOAWAY); the open ones finish."""
        self.machine.retire()
        self._pump()

    def close(self) -> None:
        self.machine.close()
        self._pump()

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        server = self.server
        if len(server.connections) >= server.limits.max_connections:
            server.defended("max_connections", "HTTP/2 connection refused: too many connections")
            self.machine.refuse()
            transport.write(self.machine.data_to_send())
            transport.close()
            return
        server.connections.add(self)
        self.machine.initiate()
        transport.write(self.machine.data_to_send())

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.machine.lost()
        self._pump()
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.machine.receive(data)
        self._pump()

    def pause_writing(self) -> None:
        if self.paused is None:
            self.paused = self.loop.create_future()
            self.server.defended("read_paused")
            if self.transport is not None:
                self.transport.pause_reading()

    def resume_writing(self) -> None:
        paused, self.paused = self.paused, None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        if paused is not None and not paused.done():
            paused.set_result(None)
