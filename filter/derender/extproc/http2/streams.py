"""A connection's streams: gRPC messages in (length judged first, reserved against the budgets, the
windows given back as the handler reads them) and out (flow control on what is sent, a handler's
write waiting while the peer's window holds its last reply back), trailers, resets.

``StreamSide`` is the half of ``connection.Connection`` that a stream's handler meets.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Awaitable, Callable

from grpc.aio import EOF  # the same end-of-stream marker the servicer checks on both transports

from .wire import (
    CANCELLED, DATA, END_STREAM, INTERNAL_ERROR, NO_ERROR, OK, PROTOCOL_ERROR, RESOURCE_EXHAUSTED, RESPONSE_HEADERS,
    RST_STREAM, UNIMPLEMENTED, UNKNOWN, WINDOW_UPDATE, Status, StreamError, frame, percent,
)

# handler(read, write): read() -> the next request message, or EOF once the peer is done sending;
# write(message) sends one reply. It returns (or raises) to end the stream.
Handler = Callable[[Callable[[], Awaitable[object]], Callable[[object], Awaitable[None]]], Awaitable[None]]
# path -> (the request type's ``FromString``, the handler)
Methods = dict[str, tuple[Callable[[bytes], object], Handler]]

BY_US, ENDED = 1, 3  # as connection.BY_US / ENDED
# What a message costs the budgets besides its bytes: its 5-byte prefix, and the bytes object and
# queue slot that hold it (a flood of empty messages is not free).
MESSAGE_OVERHEAD = 64


class Stream:
    __slots__ = ("id", "parse", "buffer", "need", "inbox", "waiter", "task", "window", "pending", "drained",
                 "started", "ended", "remote_closed", "trailers", "recv_window", "unacked", "held", "reserved",
                 "content_length", "received")

    def __init__(self, stream_id: int, parse: Callable[[bytes], object], window: int, recv_window: int,
                 content_length: int | None) -> None:
        self.id = stream_id
        self.parse = parse
        self.buffer = bytearray()  # the message being received, its 5-byte prefix first
        self.need = 0  # that message's whole length once its prefix is in (0: not yet)
        self.inbox: deque = deque()  # whole messages (bytes) or EOF, not yet read
        self.waiter: asyncio.Future | None = None
        self.task: asyncio.Task | None = None
        self.window = window  # what the peer lets us send on this stream
        self.pending = bytearray()  # DATA that waits for a window
        self.drained: asyncio.Future | None = None  # a write waiting for ``pending`` to leave
        self.started = False  # response headers sent
        self.ended = False  # trailers sent (or the stream reset)
        self.remote_closed = False
        self.trailers: tuple[int, str] | None = None  # (grpc-status, grpc-message) once the handler is done
        self.recv_window = recv_window  # what the peer may still send on it
        self.unacked = 0  # read, not yet given back in a WINDOW_UPDATE
        self.held = 0  # received, not yet read or let go
        self.reserved = 0  # reserved for its messages not yet read
        self.content_length = content_length
        self.received = 0


class StreamSide:
    """Streams, messages and replies of a ``Connection`` (whose attributes these methods use)."""

    # -- a stream's messages in ----------------------------------------------------------------
    def _open(self, stream_id: int, method, content_length: int | None, ended: int) -> None:
        parse, handler = method
        stream = Stream(stream_id, parse, self.peer_initial_window, self.stream_window, content_length)
        self.streams[stream_id] = stream
        self.running += 1
        stream.task = self.loop.create_task(self._run(stream, handler))
        if ended:
            self._end_of_input(stream)

    def _admit(self, stream: Stream, compressed: int, length: int) -> int:
        """A message's length prefix: its size on the wire once it is reserved, or 0 when it is refused."""
        limits = self.limits
        if length > limits.max_message:
            self._abort(stream, RESOURCE_EXHAUSTED, f"message larger than {limits.max_message} bytes", "message_size")
            return 0
        if compressed:
            self._abort(stream, UNIMPLEMENTED, "compressed message", "stream_error")
            return 0
        cost = length + MESSAGE_OVERHEAD
        server = self.server
        if self.reserved + cost > limits.max_buffered or server.reserved + cost > limits.max_buffered_total:
            self._abort(stream, RESOURCE_EXHAUSTED, "too many message bytes held", "buffer_full")
            return 0
        self.reserved += cost
        server.reserved += cost
        stream.reserved += cost
        return length + 5

    def _assemble(self, stream: Stream, data: bytes) -> None:
        buffer = stream.buffer
        if not buffer and len(data) >= 5:  # most DATA frames: one whole message
            length = int.from_bytes(data[1:5], "big")
            if len(data) == length + 5:
                if self._admit(stream, data[0], length):
                    self._deliver(stream, data[5:])
                return
        buffer += data
        while True:
            need = stream.need
            if not need:
                if len(buffer) < 5:
                    return
                need = stream.need = self._admit(stream, buffer[0], int.from_bytes(buffer[1:5], "big"))
                if not need:
                    return
            if len(buffer) < need:
                return
            message = bytes(buffer[5:need])
            del buffer[:need]
            stream.need = 0
            self._deliver(stream, message)

    def _deliver(self, stream: Stream, item: object) -> None:
        waiter = stream.waiter
        if waiter is not None and not stream.inbox:
            stream.waiter = None
            if not waiter.done():
                waiter.set_result(item)
                return
        stream.inbox.append(item)

    def _end_of_input(self, stream: Stream) -> None:
        if stream.remote_closed:
            return
        if stream.content_length is not None and stream.content_length != stream.received:
            raise StreamError(stream.id, PROTOCOL_ERROR, "DATA does not add up to content-length")
        stream.remote_closed = True
        if stream.buffer:
            self._abort(stream, INTERNAL_ERROR, "the stream ended inside a message", "stream_error")
            return
        self._deliver(stream, EOF)

    def _consumed(self, stream: Stream, length: int) -> None:
        """A handler read a message of ``length`` bytes: its budget and window come back."""
        cost = length + MESSAGE_OVERHEAD
        stream.reserved -= cost
        self.reserved -= cost
        self.server.reserved -= cost
        stream.held -= length + 5
        self._release(length + 5, stream)

    def _release(self, size: int, stream: Stream | None = None) -> None:
        """``size`` received bytes the filter is done with: given back to the peer's windows in batches."""
        self.unacked += size
        if self.unacked >= self.limits.connection_window // 2:
            self._control(frame(WINDOW_UPDATE, 0, 0, self.unacked.to_bytes(4, "big")))
            self.recv_window += self.unacked
            self.unacked = 0
        if stream is not None and not stream.remote_closed:
            stream.unacked += size
            if stream.unacked >= self.stream_window // 2:
                self._control(frame(WINDOW_UPDATE, 0, stream.id, stream.unacked.to_bytes(4, "big")))
                stream.recv_window += stream.unacked
                stream.unacked = 0

    def _discard(self, stream: Stream) -> None:
        """A stream's messages that no handler will read: its budget back, its bytes to the connection's window."""
        if stream.reserved:
            self.reserved -= stream.reserved
            self.server.reserved -= stream.reserved
            stream.reserved = 0
        if stream.held:
            self._release(stream.held)
            stream.held = 0
        stream.inbox.clear()
        stream.buffer.clear()
        stream.need = 0

    def _reset(self, stream: Stream) -> None:
        """The stream is over before its trailers (reset, or the connection went): its handler is cancelled."""
        stream.ended = True
        stream.remote_closed = True
        stream.pending.clear()
        self._discard(stream)
        drained, stream.drained = stream.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()

    async def _run(self, stream: Stream, handler: Handler) -> None:
        async def read() -> object:
            if stream.inbox:
                item = stream.inbox.popleft()
            else:
                if stream.waiter is not None:
                    raise RuntimeError("read() while another read() waits")
                stream.waiter = self.loop.create_future()
                item = await stream.waiter
            if item is EOF:
                return item
            if not stream.ended:
                self._consumed(stream, len(item))
            return stream.parse(item)

        async def write(message) -> None:
            if stream.ended:
                raise ConnectionResetError("the ext_proc stream is closed")
            self._send(stream, message.SerializeToString())
            if stream.pending:  # the peer's window holds it back: wait, as far as the peer reads
                stream.drained = drained = self.loop.create_future()
                await drained
            if self.paused is not None:
                await asyncio.shield(self.paused)

        status, why = OK, ""
        try:
            await handler(read, write)
        except asyncio.CancelledError:
            if stream.ended:  # reset: nothing more to send
                return
            status, why = CANCELLED, "cancelled"
            raise
        except Status as exc:
            status, why = exc.code, str(exc)
        except Exception as exc:  # noqa: BLE001 - the handler's failure is the stream's status
            status, why = UNKNOWN, f"{type(exc).__name__}: {exc}"
        finally:
            self.running -= 1
            if not stream.ended:
                self._finish(stream, status, why)

    # -- frames out ----------------------------------------------------------------------------
    def _send(self, stream: Stream, message: bytes) -> None:
        if stream.started:
            head = b""
        else:
            stream.started = True
            head = self.codec.frames(stream.id, RESPONSE_HEADERS, 0, self.max_frame)
        data = b"\x00" + len(message).to_bytes(4, "big") + message
        size = len(data)
        if not stream.pending and size <= stream.window and size <= self.send_window and size <= self.max_frame:
            stream.window -= size
            self.send_window -= size
            self.data_sent += 1
            self._write(head + frame(DATA, 0, stream.id, data))
            return
        if head:
            self._write(head)
        stream.pending += data
        self._flush(stream)

    def _flush(self, stream: Stream) -> None:
        """Send what a stream has waiting, as far as the windows allow; then its trailers if due."""
        pending = stream.pending
        while pending:
            size = min(len(pending), stream.window, self.send_window, self.max_frame)
            if size <= 0:
                return
            self._write(frame(DATA, 0, stream.id, bytes(pending[:size])))  # the turn's one send joins them
            del pending[:size]
            stream.window -= size
            self.send_window -= size
            self.data_sent += 1
        drained, stream.drained = stream.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)
        if stream.trailers is not None and stream.id in self.streams:
            self._write_trailers(stream)

    def _flush_all(self) -> None:
        for stream in list(self.streams.values()):
            if stream.pending:
                self._flush(stream)

    def _status_fields(self, status: int, why: str) -> list[tuple[str, str]]:
        return [("grpc-status", str(status))] + ([("grpc-message", percent(why, self.limits.max_status_message))]
                                                 if why else [])

    def _trailers_only(self, stream_id: int, status: int, why: str, ended: int) -> None:
        """A stream answered by its status alone; reset as well if the peer is still sending on it."""
        self._write(self.codec.frames(stream_id, [*RESPONSE_HEADERS, *self._status_fields(status, why)], END_STREAM,
                                      self.max_frame))
        if not ended:
            self._control(frame(RST_STREAM, 0, stream_id, NO_ERROR.to_bytes(4, "big")))
        self._closed_now(stream_id, ENDED if ended else BY_US)

    def _finish(self, stream: Stream, status: int, why: str) -> None:
        """The handler is done: its trailers, after whatever DATA still waits for a window."""
        stream.ended = True
        stream.trailers = (status, why)
        if not stream.pending:
            self._write_trailers(stream)

    def _write_trailers(self, stream: Stream) -> None:
        status, why = stream.trailers
        self._discard(stream)
        if self.transport.is_closing() or self.shut:
            self._remove(stream, BY_US)
            return
        if not stream.started:
            self._trailers_only(stream.id, status, why, stream.remote_closed)
            self._remove(stream, ENDED if stream.remote_closed else BY_US)
            return
        self._write(self.codec.frames(stream.id, self._status_fields(status, why), END_STREAM, self.max_frame))
        if stream.remote_closed:
            self._remove(stream, ENDED)
        else:  # answered before the peer was done: it may stop sending (RFC 9113 8.1)
            self._control(frame(RST_STREAM, 0, stream.id, NO_ERROR.to_bytes(4, "big")))
            self._remove(stream, BY_US)

    def _abort(self, stream: Stream, status: int, why: str, defence: str) -> None:
        """A stream the filter cannot go on with: its status to the peer, its handler cancelled."""
        self.server.defended(defence)
        stream.pending.clear()
        self._discard(stream)
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        self._finish(stream, status, why)
        self._made_to_reset()
