"""Server-sent events reassembled across any split of the byte stream."""

from __future__ import annotations

import re

_LINE_END = re.compile(rb"\r\n|\r|\n")
_IGNORED_FIELDS = (b"event", b"id", b"retry")


class SSEError(ValueError):
    """The byte stream is not SSE. ``payloads``: the whole events decoded before the fault."""

    def __init__(self, message: str, payloads: list[bytes] | None = None) -> None:
        super().__init__(message)
        self.payloads = payloads or []


class SSEDecoder:
    """Feed body chunks, get whole events' ``data`` payloads back.

    Linear in the stream's length however it is split (a long event cut into
    many chunks is scanned once). Strict: a line that is not an SSE field or
    comment is an error, never silently skipped (it would drop the event it
    is glued to); so is an event longer than ``max_event_bytes``.
    """

    def __init__(self, max_event_bytes: int = 64 << 20) -> None:
        self.max_event_bytes = max_event_bytes
        self._parts: list[bytes] = []  # the line being read, in pieces
        self._held = 0  # bytes in self._parts and self._data
        self._after_cr = False  # the last chunk ended in CR: skip the LF of a CRLF
        self._data: list[bytes] = []  # data lines of the event being read
        self._error: str | None = None

    def feed(self, chunk: bytes) -> list[bytes]:
        if self._error is not None:
            raise SSEError(self._error)
        if not chunk:
            return []
        if (  # the common case at production pacing: one whole event, alone in its chunk
            not self._parts
            and not self._data
            and not self._after_cr
            and chunk.startswith(b"data: ")
            and chunk.endswith(b"\n\n")
            and 8 < len(chunk) <= self.max_event_bytes
            and chunk.count(b"\n") == 2
            and b"\r" not in chunk
        ):
            return [chunk[6:-2]]
        payloads: list[bytes] = []
        pos = 1 if self._after_cr and chunk.startswith(b"\n") else 0
        self._after_cr = False
        ends = _LINE_END.finditer(chunk, pos) if b"\n" in chunk or b"\r" in chunk else ()
        for match in ends:
            piece = chunk[pos : match.start()]
            line = b"".join((*self._parts, piece)) if self._parts else piece
            self._held -= sum(len(p) for p in self._parts)
            self._parts.clear()
            self._line(line, payloads)
            pos = match.end()
            self._after_cr = pos == len(chunk) and match.group() == b"\r"
        if pos < len(chunk):
            self._parts.append(chunk[pos:])
            self._held += len(chunk) - pos
        if self._held > self.max_event_bytes:
            self._fail(f"an SSE event is longer than {self.max_event_bytes} bytes", payloads)
        return payloads

    def close(self) -> list[bytes]:
        """End of stream: a last event without its blank line still counts."""
        if self._error is not None:
            raise SSEError(self._error)
        payloads: list[bytes] = []
        if self._parts:
            line = b"".join(self._parts)
            self._parts.clear()
            self._line(line, payloads)
        self._line(b"", payloads)
        self._held, self._after_cr = 0, False
        return payloads

    @property
    def pending(self) -> bool:
        return any(p.strip() for p in self._parts) or bool(self._data)

    def _line(self, line: bytes, payloads: list[bytes]) -> None:
        if not line:  # a blank line ends the event
            if self._data:  # (an event whose data is empty is not dispatched, as in browsers)
                payload = b"\n".join(self._data)
                if payload:
                    payloads.append(payload)
                self._held -= len(payload) + 1
                self._data = []
            return
        if line.startswith(b":"):  # a comment
            return
        name, colon, value = line.partition(b":")
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            self._data.append(value)
            self._held += len(value) + 1
        elif name not in _IGNORED_FIELDS:
            self._fail(f"not an SSE line: {line[:40]!r}", payloads)

    def _fail(self, message: str, payloads: list[bytes]) -> None:
        self._error = message
        self._parts, self._data, self._held = [], [], 0
        raise SSEError(message, payloads)
