"""A connection's streams: gRPC messages in (length judged first, reserved against the budgets, the
windows given back as the handler reads them) and out (flow control on what is sent, a handler's
write waiting while the peer's window holds its last reply back), trailers, resets.

``StreamSide`` is the half of ``connection.Connection`` that a stream's handler meets.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from grpc.aio import EOF  # the same end-of-stream marker the servicer checks on both transports

from .control import BY_US, ENDED
from .handlers import METADATA, Handler, serve_handler, writer
from .state import ConnectionState
from .wire import (
    DATA,
    END_STREAM,
    INTERNAL_ERROR,
    NO_ERROR,
    PROTOCOL_ERROR,
    RESOURCE_EXHAUSTED,
    RESPONSE_HEADERS,
    RST_STREAM,
    UNIMPLEMENTED,
    WINDOW_UPDATE,
    StreamError,
    frame,
    percent,
)

# What a message costs the budgets besides its bytes: its 5-byte prefix, and the bytes object and
# queue slot that hold it (a flood of empty messages is not free).
MESSAGE_OVERHEAD = 64


class Stream:
    __slots__ = (
        "buffer",
        "content_length",
        "drained",
        "ended",
        "id",
        "inbox",
        "need",
        "parse",
        "pending",
        "received",
        "recv_window",
        "remote_closed",
        "started",
        "task",
        "trailers",
        "unacked",
        "waiter",
        "window",
    )

    def __init__(
        self,
        stream_id: int,
        parse: Callable[[bytes], object],
        window: int,
        recv_window: int,
        content_length: int | None,
    ) -> None:
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
        self.content_length = content_length
        self.received = 0


class StreamSide(ConnectionState):
    """Streams, messages and replies of a ``Connection`` (whose attributes these methods use)."""

    # -- a stream's messages in ----------------------------------------------------------------
    def _open(self, stream_id: int, method, content_length: int | None, ended: int, metadata: dict[str, str]) -> None:
        parse, handler = method
        stream = Stream(stream_id, parse, self.peer_initial_window, self.stream_window, content_length)
        self.streams[stream_id] = stream
        self.running += 1
        stream.task = self.loop.create_task(self._run(stream, handler, metadata))
        stream.task.add_done_callback(self._handler_done)  # a task cancelled before it ran counts too
        if ended:
            self._end_of_input(stream)

    def _handler_done(self, task: asyncio.Task) -> None:
        self.running -= 1

    # A message goes straight to its handler when it waits in read(), as it does at production pacing:
    # its bytes go back to the windows at once. One that must wait in the stream's inbox (or is still
    # being received) is reserved against the connection's and the worker's budgets, and its bytes
    # are given back when the handler reads it.
    def _message(self, stream: Stream, body: bytes) -> None:
        """A whole message in one DATA frame (its prefix first)."""
        length = len(body) - 5
        if body[0] or length > self.max_message:
            self._refuse_message(stream, body[0], length)
            return
        waiter = stream.waiter
        if waiter is not None and not stream.inbox and not waiter.done():  # _hand, inlined: once per token
            stream.waiter = None
            waiter.set_result(body[5:])
            self.unacked += length + 5
            stream.unacked += length + 5
            if self.unacked >= self.connection_half or stream.unacked >= self.stream_half:
                self._windows(stream)
        elif self._reserve(stream, length):
            stream.inbox.append(body[5:])

    def _reserve(self, stream: Stream, length: int) -> bool:
        cost = length + MESSAGE_OVERHEAD
        server = self.server
        if self.reserved + cost > self.max_buffered or server.reserved + cost > self.max_buffered_total:
            self._abort(stream, RESOURCE_EXHAUSTED, "too many message bytes held", "buffer_full")
            return False
        self.reserved += cost
        server.reserved += cost
        return True

    def _unreserve(self, stream: Stream, length: int) -> None:
        """A reserved message read (or let go): its budget back, its bytes to the windows."""
        self.reserved -= length + MESSAGE_OVERHEAD
        self.server.reserved -= length + MESSAGE_OVERHEAD
        self._give_back(length + 5, stream)

    def _refuse_message(self, stream: Stream, compressed: int, length: int) -> None:
        if length > self.max_message:
            self._abort(stream, RESOURCE_EXHAUSTED, f"message larger than {self.max_message} bytes", "message_size")
        else:
            self._abort(stream, UNIMPLEMENTED, "compressed message", "stream_error")

    def _assemble(self, stream: Stream, data: bytes) -> None:
        """Bytes of a stream's messages as they come, when a frame holds other than one whole message."""
        buffer = stream.buffer
        buffer += data
        while True:
            need = stream.need
            if not need:
                if len(buffer) < 5:
                    return
                length = int.from_bytes(buffer[1:5], "big")
                if buffer[0] or length > self.max_message:
                    self._refuse_message(stream, buffer[0], length)
                    return
                if not self._reserve(stream, length):
                    return
                need = stream.need = length + 5
            if len(buffer) < need:
                return
            message = bytes(buffer[5:need])
            del buffer[:need]
            stream.need = 0
            if self._hand(stream, message):
                self._unreserve(stream, len(message))
            else:
                stream.inbox.append(message)

    @staticmethod
    def _hand(stream: Stream, item: object) -> bool:
        """Give ``item`` to the handler waiting in read(), if it waits and nothing is ahead of it."""
        waiter = stream.waiter
        if waiter is None or stream.inbox:
            return False
        stream.waiter = None
        if waiter.done():  # its read() was cancelled
            return False
        waiter.set_result(item)
        return True

    def _end_of_input(self, stream: Stream) -> None:
        if stream.remote_closed:
            return
        if stream.content_length is not None and stream.content_length != stream.received:
            raise StreamError(stream.id, PROTOCOL_ERROR, "DATA does not add up to content-length")
        stream.remote_closed = True
        if stream.buffer:
            self._abort(stream, INTERNAL_ERROR, "the stream ended inside a message", "stream_error")
        elif not self._hand(stream, EOF):
            stream.inbox.append(EOF)

    def _give_back(self, size: int, stream: Stream | None = None) -> None:
        """``size`` received bytes the filter is done with: to the peer's windows, in batches."""
        self.unacked += size
        if stream is not None and not stream.remote_closed:
            stream.unacked += size
        self._windows(stream)

    def _windows(self, stream: Stream | None) -> None:
        """WINDOW_UPDATE for what was given back, once it is half a window (or more)."""
        if self.unacked >= self.connection_half:
            self._control(frame(WINDOW_UPDATE, 0, 0, self.unacked.to_bytes(4, "big")))
            self.recv_window += self.unacked
            self.unacked = 0
        if stream is not None and stream.unacked >= self.stream_half and not stream.remote_closed:
            self._control(frame(WINDOW_UPDATE, 0, stream.id, stream.unacked.to_bytes(4, "big")))
            stream.recv_window += stream.unacked
            stream.unacked = 0

    def _discard(self, stream: Stream) -> None:
        """A stream's messages that no handler will read (those waiting, the one being received):
        their budget back, their bytes to the connection's window."""
        messages = [len(item) for item in stream.inbox if item is not EOF]
        size = sum(messages)
        cost = size + MESSAGE_OVERHEAD * len(messages)
        if stream.need:  # reserved when its length prefix came
            cost += stream.need - 5 + MESSAGE_OVERHEAD
        held = size + 5 * len(messages) + len(stream.buffer)
        self.reserved -= cost
        self.server.reserved -= cost
        if held:
            self._give_back(held)
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

    async def _run(self, stream: Stream, handler: Handler, metadata: dict[str, str]) -> None:
        connection = self
        if metadata:
            METADATA.set(metadata)  # this task's own context: its handler's

        async def read() -> object:
            if stream.inbox:
                item = stream.inbox.popleft()
                if item is not EOF and not stream.ended:
                    connection._unreserve(stream, len(item))
            else:
                if stream.waiter is not None:
                    raise RuntimeError("read() while another read() waits")
                stream.waiter = connection.loop.create_future()
                item = await stream.waiter
            return item if item is EOF else stream.parse(item)

        await serve_handler(handler, read, writer(self, stream), stream, self._finish)

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
        return [("grpc-status", str(status))] + (
            [("grpc-message", percent(why, self.limits.max_status_message))] if why else []
        )

    def _trailers_only(self, stream_id: int, status: int, why: str, ended: int) -> None:
        """A stream answered by its status alone; reset as well if the peer is still sending on it."""
        self._write(
            self.codec.frames(
                stream_id, [*RESPONSE_HEADERS, *self._status_fields(status, why)], END_STREAM, self.max_frame
            )
        )
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
        status, why = stream.trailers or (0, "")
        self._discard(stream)
        if self.transport is None or self.transport.is_closing() or self.shut:
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
        self._take_reset()
