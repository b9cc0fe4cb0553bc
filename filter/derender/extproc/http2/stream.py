"""One stream's state, as its connection's ``Machine`` keeps it (both directions)."""

from __future__ import annotations

from collections import deque


class Stream:
    __slots__ = (
        "blocked",
        "buffer",
        "content_length",
        "ended",
        "id",
        "inbox",
        "need",
        "pending",
        "reading",
        "received",
        "recv_window",
        "remote_closed",
        "started",
        "trailers",
        "unacked",
        "window",
    )

    def __init__(self, stream_id: int, window: int, recv_window: int, content_length: int | None) -> None:
        self.id = stream_id
        self.buffer = bytearray()  # the message being received, its 5-byte prefix first
        self.need = 0  # that message's whole length once its prefix is in (0: not yet)
        self.inbox: deque = deque()  # whole messages (bytes) or EOF, not yet read
        self.reading = False  # the handler waits for the next message
        self.window = window  # what the peer lets us send on this stream
        self.pending = bytearray()  # DATA that waits for a window
        self.blocked = False  # the handler waits for ``pending`` to leave
        self.started = False  # response headers sent
        self.ended = False  # trailers due (or the stream reset)
        self.remote_closed = False
        self.trailers: tuple[int, str] | None = None  # (grpc-status, grpc-message) once the handler is done
        self.recv_window = recv_window  # what the peer may still send on it
        self.unacked = 0  # read, not yet given back in a WINDOW_UPDATE
        self.content_length = content_length
        self.received = 0
