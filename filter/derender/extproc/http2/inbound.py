"""gRPC messages in: a message's length judged first, what waits reserved
against the connection's and the worker's budgets, the receive windows given back as handlers read.

``Inbound`` is the receiving half of a ``machine.Machine``; it owns the windows the server grants
and the bytes held for handlers. A message goes straight to a handler that waits to read, as at
production pacing, and its bytes go back to the windows at once; one that must wait in the stream's
inbox (or is still arriving) is reserved, and its bytes go back when the handler reads it.
"""

from __future__ import annotations

from grpc.aio import EOF  # the same end-of-stream marker the servicer checks on both transports

from .outbound import Outbound
from .stream import Stream
from .wire import INTERNAL_ERROR, RESOURCE_EXHAUSTED, UNIMPLEMENTED, WINDOW_UPDATE, Limits, frame

# What a message costs the budgets besides its bytes: its 5-byte prefix, and the bytes object and
# queue slot that hold it (a flood of empty messages is not free).
MESSAGE_OVERHEAD = 64


class Budget:
    """Message bytes held by all of a worker's connections, against ``Limits.max_buffered_total``."""

    __slots__ = ("limit", "reserved")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reserved = 0


class Refused(Exception):
    """A message the stream cannot take: the stream ends with this gRPC status."""

    def __init__(self, status: int, why: str, defence: str) -> None:
        super().__init__(why)
        self.status = status
        self.defence = defence


class Inbound:
    """Messages in and the windows granted for them, of one connection."""

    def __init__(self, limits: Limits, budget: Budget, outbound: Outbound) -> None:
        self.budget = budget
        self.outbound = outbound
        # (stream id, message or EOF) handed to handlers waiting to read: ``Machine.handed``, the one
        # event of every token, kept apart from ``Machine.events`` as plain pairs (no object per event)
        self.handed: list[tuple[int, object]] = []
        self.stream_window = limits.stream_window
        self.recv_window = limits.connection_window  # what the peer may still send on the connection
        self.stream_half, self.connection_half = limits.stream_window // 2, limits.connection_window // 2
        self.unacked = 0
        self.reserved = 0  # what messages admitted and not yet read cost, this connection's
        self.max_message, self.max_buffered = limits.max_message, limits.max_buffered

    def message(self, stream: Stream, body: bytes) -> None:
        """A whole message in one DATA frame (its prefix first), as most frames hold."""
        length = len(body) - 5
        if body[0] or length > self.max_message:
            self.refuse(body[0], length)
        if stream.reading and not stream.inbox:  # handed at once: once per token
            stream.reading = False
            self.handed.append((stream.id, body[5:]))
            self.unacked += length + 5
            stream.unacked += length + 5
            if self.unacked >= self.connection_half or stream.unacked >= self.stream_half:
                self.windows(stream)
        else:
            self.reserve(length)
            stream.inbox.append(body[5:])

    def assemble(self, stream: Stream, data: bytes) -> None:
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
                    self.refuse(buffer[0], length)
                self.reserve(length)
                need = stream.need = length + 5
            if len(buffer) < need:
                return
            message = bytes(buffer[5:need])
            del buffer[:need]
            stream.need = 0
            if self.hand(stream, message):
                self.unreserve(stream, len(message))
            else:
                stream.inbox.append(message)

    def refuse(self, compressed: int, length: int) -> None:
        if length > self.max_message:
            raise Refused(RESOURCE_EXHAUSTED, f"message larger than {self.max_message} bytes", "message_size")
        raise Refused(UNIMPLEMENTED, "compressed message", "stream_error")

    def end(self, stream: Stream) -> None:
        """The peer is done sending on ``stream``: EOF after its messages."""
        stream.remote_closed = True
        if stream.buffer:
            raise Refused(INTERNAL_ERROR, "the stream ended inside a message", "stream_error")
        if not self.hand(stream, EOF):
            stream.inbox.append(EOF)

    def hand(self, stream: Stream, item: object) -> bool:
        """Give ``item`` to the handler waiting to read, if it waits and nothing is ahead of it."""
        if not stream.reading or stream.inbox:
            return False
        stream.reading = False
        self.handed.append((stream.id, item))
        return True

    def read(self, stream: Stream) -> object | None:
        """The stream's next message (bytes, or EOF), or None: the handler then waits for a ``Message``."""
        if stream.inbox:
            item = stream.inbox.popleft()
            if item is not EOF and not stream.ended:
                self.unreserve(stream, len(item))
            return item
        if stream.reading:
            raise RuntimeError("read() while another read() waits")
        stream.reading = True
        return None

    def unread(self, stream: Stream, item: object) -> None:
        """A message handed to a handler that stopped waiting: first in its inbox again, reserved."""
        if item is not EOF:
            self.reserve(len(item))  # type: ignore[arg-type]
        stream.inbox.appendleft(item)

    def reserve(self, length: int) -> None:
        cost = length + MESSAGE_OVERHEAD
        budget = self.budget
        if self.reserved + cost > self.max_buffered or budget.reserved + cost > budget.limit:
            raise Refused(RESOURCE_EXHAUSTED, "too many message bytes held", "buffer_full")
        self.reserved += cost
        budget.reserved += cost

    def unreserve(self, stream: Stream, length: int) -> None:
        """A reserved message read (or let go): its budget back, its bytes to the windows."""
        self.reserved -= length + MESSAGE_OVERHEAD
        self.budget.reserved -= length + MESSAGE_OVERHEAD
        self.give_back(length + 5, stream)

    def give_back(self, size: int, stream: Stream | None = None) -> None:
        """``size`` received bytes the server is done with: to the peer's windows, in batches."""
        self.unacked += size
        if stream is not None and not stream.remote_closed:
            stream.unacked += size
        self.windows(stream)

    def windows(self, stream: Stream | None) -> None:
        """WINDOW_UPDATE for what was given back, once it is half a window (or more)."""
        if self.unacked >= self.connection_half:
            self.outbound.control(frame(WINDOW_UPDATE, 0, 0, self.unacked.to_bytes(4, "big")))
            self.recv_window += self.unacked
            self.unacked = 0
        if stream is not None and stream.unacked >= self.stream_half and not stream.remote_closed:
            self.outbound.control(frame(WINDOW_UPDATE, 0, stream.id, stream.unacked.to_bytes(4, "big")))
            stream.recv_window += stream.unacked
            stream.unacked = 0

    def discard(self, stream: Stream) -> None:
        """A stream's messages that no handler will read (those waiting, the one being received):
        their budget back, their bytes to the connection's window."""
        messages = [len(item) for item in stream.inbox if item is not EOF]
        size = sum(messages)
        cost = size + MESSAGE_OVERHEAD * len(messages)
        if stream.need:  # reserved when its length prefix came
            cost += stream.need - 5 + MESSAGE_OVERHEAD
        held = size + 5 * len(messages) + len(stream.buffer)
        self.reserved -= cost
        self.budget.reserved -= cost
        if held:
            self.give_back(held)
        stream.inbox.clear()
        stream.buffer.clear()
        stream.need = 0
        stream.reading = False
