"""Frames out, of one connection: what is written until the code running the connection takes it
(once per loop turn, so that a batch of replies leaves in one send), DATA as far as the peer's
windows allow (the rest waits on its stream), header blocks HPACK-encoded, a gRPC status as trailers.

``Outbound`` is the sending half of a ``machine.Machine``; it owns the peer's windows and frame size.
"""

from __future__ import annotations

from .headers import FieldEncoder
from .stream import Stream
from .wire import (
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    END_STREAM,
    RESOURCE_EXHAUSTED,
    RESPONSE_HEADERS,
    Limits,
    frame,
    percent,
)

PLAIN_STATUS = {RESOURCE_EXHAUSTED: "431"}  # a gRPC status's HTTP one, for a plain stream refused


class Outbound:
    def __init__(self, limits: Limits, plain: bool = False) -> None:
        self.plain = plain  # plain HTTP: DATA as it is, no gRPC status
        self.out: list[bytes] = []
        self.fields = FieldEncoder()
        self.send_window = DEFAULT_WINDOW  # the peer's connection window
        self.peer_initial_window = DEFAULT_WINDOW
        self.max_frame = DEFAULT_MAX_FRAME
        self.data_sent = 0  # DATA frames, against which WINDOW_UPDATE frames are counted
        self.control_queued = 0  # control replies written since the peer last read all
        self.max_status_message = limits.max_status_message
        self.shut = False  # the socket is closing: nothing more is written

    def write(self, data: bytes) -> None:
        if not self.shut:
            self.out.append(data)

    def control(self, data: bytes) -> None:
        """A control reply (the peer must read them: ``Machine`` counts those left unread)."""
        self.control_queued += 1
        self.write(data)

    def take(self) -> bytes:
        out, self.out = self.out, []
        return b"".join(out) if len(out) > 1 else out[0] if out else b""

    # -- a stream's replies ----------------------------------------------------------------------
    def send(self, stream: Stream, message: bytes) -> bool:
        """One gRPC message; False if part of it waits for the peer's windows."""
        if stream.started:
            head = b""
        else:
            stream.started = True
            head = self.fields.frames(stream.id, RESPONSE_HEADERS, 0, self.max_frame)
        data = message if self.plain else b"\x00" + len(message).to_bytes(4, "big") + message
        size = len(data)
        if not stream.pending and size <= stream.window and size <= self.send_window and size <= self.max_frame:
            stream.window -= size
            self.send_window -= size
            self.data_sent += 1
            if not self.shut:
                self.out.append(head + frame(DATA, 0, stream.id, data))
            return True
        if head:
            self.write(head)
        stream.pending += data
        return self.flush(stream)

    def flush(self, stream: Stream) -> bool:
        """What a stream has waiting, as far as the windows allow; True once nothing waits."""
        pending = stream.pending
        while pending:
            size = min(len(pending), stream.window, self.send_window, self.max_frame)
            if size <= 0:
                return False
            self.write(frame(DATA, 0, stream.id, bytes(pending[:size])))  # the turn's one send joins them
            del pending[:size]
            stream.window -= size
            self.send_window -= size
            self.data_sent += 1
        return True

    def status_fields(self, status: int, why: str) -> list[tuple[str, str]]:
        return [("grpc-status", str(status))] + (
            [("grpc-message", percent(why, self.max_status_message))] if why else []
        )

    def trailers(self, stream_id: int, status: int, why: str) -> None:
        if self.plain:  # the end of a plain reply: an empty DATA frame
            self.write(frame(DATA, END_STREAM, stream_id))
            return
        self.write(self.fields.frames(stream_id, self.status_fields(status, why), END_STREAM, self.max_frame))

    def trailers_only(self, stream_id: int, status: int, why: str) -> None:
        """A stream answered by its status alone."""
        if self.plain:  # a plain stream refused before its reply: an HTTP status alone
            fields = [(":status", PLAIN_STATUS.get(status, "500"))]
            self.write(self.fields.frames(stream_id, fields, END_STREAM, self.max_frame))
            return
        fields = [*RESPONSE_HEADERS, *self.status_fields(status, why)]
        self.write(self.fields.frames(stream_id, fields, END_STREAM, self.max_frame))
