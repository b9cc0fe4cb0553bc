"""Server-sent events reassembled across any split of the byte stream."""

from __future__ import annotations

import re

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE = re.compile(rb"\r\n|\n|\r")


class SSEDecoder:
    """Feed body chunks, get whole events' ``data`` payloads back."""

    def __init__(self, max_event_bytes: int = 64 << 20) -> None:
        self._buffer = b""
        self.max_event_bytes = max_event_bytes

    def feed(self, chunk: bytes) -> list[bytes]:
        if not chunk:
            return []
        buffer = self._buffer + chunk if self._buffer else chunk
        payloads: list[bytes] = []
        start = 0
        for match in _EVENT_END.finditer(buffer):
            data = _data(buffer[start : match.start()])
            if data is not None:
                payloads.append(data)
            start = match.end()
        self._buffer = buffer[start:]
        if len(self._buffer) > self.max_event_bytes:
            raise ValueError(f"an SSE event is longer than {self.max_event_bytes} bytes")
        return payloads

    def close(self) -> list[bytes]:
        """End of stream: a last event without its blank line still counts."""
        rest, self._buffer = self._buffer, b""
        data = _data(rest) if rest.strip() else None
        return [data] if data is not None else []

    @property
    def pending(self) -> bool:
        return bool(self._buffer.strip())


def _data(block: bytes) -> bytes | None:
    lines = []
    for line in _LINE.split(block):
        if line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(lines) if lines else None
