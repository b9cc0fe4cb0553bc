"""HTTP/2's and gRPC's numbers, a frame's bytes, the two kinds of protocol error, and the limits.

``Limits`` is every bound the server keeps on what a peer can make it hold or do (RFC 9113 and
the lessons of the HTTP/2 advisories of 2019, 2023, 2024 and 2025; ``docs/operations.md`` lists
each with its default and what it answers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# Flags.
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Error codes (section 7).
(
    NO_ERROR,
    PROTOCOL_ERROR,
    INTERNAL_ERROR,
    FLOW_CONTROL_ERROR,
    SETTINGS_TIMEOUT,
    STREAM_CLOSED,
    FRAME_SIZE_ERROR,
    REFUSED_STREAM,
    CANCEL,
    COMPRESSION_ERROR,
    CONNECT_ERROR,
    ENHANCE_YOUR_CALM,
) = range(12)
# Settings (section 6.5.2).
(
    SETTINGS_HEADER_TABLE_SIZE,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
) = range(1, 7)
# gRPC status codes.
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED = 0, 1, 2, 3, 5, 8, 12

DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384
MAX_WINDOW = (1 << 31) - 1
LAST_STREAM = MAX_WINDOW  # a graceful GOAWAY's first stream id: "no more streams, soon"

# A gRPC response's headers (a trailers-only response adds the status to them).
RESPONSE_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


class ConnectionError_(Exception):
    """The peer broke HTTP/2 or a limit meant for the whole connection: GOAWAY with ``code``, then close.

    ``defence``: the name the metrics count it under."""

    def __init__(self, code: int, why: str, defence: str = "protocol_error") -> None:
        super().__init__(why)
        self.code = code
        self.defence = defence


class StreamError(Exception):
    """A frame that breaks one stream only (RFC 9113 section 5.4.2): RST_STREAM with ``code`` on it."""

    def __init__(self, stream_id: int, code: int, why: str) -> None:
        super().__init__(why)
        self.stream_id = stream_id
        self.code = code


class Status(Exception):
    """Raised by a handler: the stream ends with this gRPC status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What one peer can make the server hold or do. The defaults fit Envoy's ext_proc traffic
    (``envoy/``: at most 64 streams per connection, request bodies buffered up to 16 MiB)."""

    # Streams open at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS); a stream past it, or
    # past it counting handlers still ending after a reset, gets REFUSED_STREAM.
    max_concurrent_streams: int = 100
    # One gRPC message: Envoy's 16 MiB body buffer plus the message's own framing. A longer length
    # prefix gets RESOURCE_EXHAUSTED before any of it is kept.
    max_message: int = 17 * MiB
    # Bytes of messages a connection may have the filter hold (arrived, not yet read by their
    # handlers), and all connections of a worker together: past either, RESOURCE_EXHAUSTED. The
    # windows the filter grants are sized from them, and given back as messages are read.
    max_buffered: int = 64 * MiB
    max_buffered_total: int = 256 * MiB
    # One header block: its decoded size (SETTINGS_MAX_HEADER_LIST_SIZE; past it the stream is
    # refused), its HPACK bytes and its CONTINUATION frames (past either, the connection is closed).
    max_header_list: int = 64 << 10
    max_header_block: int = 64 << 10
    max_continuations: int = 32
    # SETTINGS entries in one frame (as nghttp2): past it, the connection is closed.
    max_settings_entries: int = 32
    # Reset accounting (Rapid Reset, MadeYouReset): a stream the peer resets before any answer,
    # or one the server resets because the peer broke it, takes a token; tokens come back at
    # ``reset_rate`` a second up to ``reset_burst``. None left: GOAWAY ENHANCE_YOUR_CALM.
    reset_burst: int = 1000
    reset_rate: float = 33.0
    # Control replies (PING and SETTINGS ACKs, RST_STREAM, WINDOW_UPDATE) queued while the peer
    # does not read: past this many, the connection is closed (Envoy's max_outbound_control_frames).
    max_control_queue: int = 1000
    # Frames that make no progress, counted as Envoy's codec counts them: consecutive empty
    # DATA / HEADERS / CONTINUATION frames; PRIORITY frames per stream opened; WINDOW_UPDATE frames
    # per DATA frame sent. Past any, GOAWAY ENHANCE_YOUR_CALM.
    max_empty_frames: int = 1
    max_priority_per_stream: int = 100
    max_window_updates_per_data: int = 10
    # Connections a worker holds at once; past it a new one is closed at once.
    max_connections: int = 2048
    # Seconds: the client preface (and TLS handshake) must arrive within ``preface_timeout``; the
    # peer must acknowledge the server's SETTINGS within ``settings_timeout``; a connection with no
    # stream for ``idle_timeout`` is closed gracefully (GOAWAY); one silent for ``keepalive_time``
    # gets a PING, and is closed if still silent ``keepalive_timeout`` later (a peer that stops
    # reading is silent too: its reads are paused).
    preface_timeout: float = 10.0
    settings_timeout: float = 10.0
    idle_timeout: float = 300.0
    keepalive_time: float = 60.0
    keepalive_timeout: float = 20.0
    # Characters of a status message sent as grpc-message (before percent-encoding).
    max_status_message: int = 1024

    @property
    def stream_window(self) -> int:
        """A stream's window: room for one whole message after up to half of it is held back."""
        return min(MAX_WINDOW, 2 * (self.max_message + 5))

    @property
    def connection_window(self) -> int:
        """The connection's window: every message the connection may hold, with slack for prefixes."""
        return min(MAX_WINDOW, 2 * (self.max_buffered + (64 << 10)))


class TokenBucket:
    """``burst`` tokens, given back at ``rate`` a second; ``take`` is False once none are left."""

    __slots__ = ("at", "burst", "clock", "rate", "tokens")

    def __init__(self, burst: int, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokens = float(burst)
        self.burst = burst
        self.rate = rate
        self.clock = clock
        self.at = clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def percent(text: str, limit: int = 1024) -> str:
    """grpc-message: at most ``limit`` characters, percent-encoded as gRPC requires (UTF-8 bytes
    outside printable ASCII, and ``%`` itself)."""
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return "".join(
        c if " " <= c <= "~" and c != "%" else "".join(f"%{b:02X}" for b in c.encode("utf-8", "replace")) for c in text
    )
