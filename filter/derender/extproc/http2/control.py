"""The frames that steer a connection, as values: the server's SETTINGS, the peer's SETTINGS and
WINDOW_UPDATE read and checked, and what the server remembers of recently closed streams."""

from __future__ import annotations

import struct

from .wire import (
    DEFAULT_MAX_FRAME,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    MAX_WINDOW,
    PROTOCOL_ERROR,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_HEADER_TABLE_SIZE,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    ConnectionError_,
    Limits,
    frame,
)

# How a recently closed stream ended, for the frames that may still come on it (RFC 9113 5.1).
BY_US, BY_PEER, ENDED = 1, 2, 3
RECENTLY_CLOSED = 128  # streams remembered per connection
KEEPALIVE = b"derender"  # a keepalive PING's payload
GOAWAY_PING = b"goaway!!"  # the PING between a graceful GOAWAY's two frames


def settings_frame(limits: Limits) -> bytes:
    """The server's SETTINGS: its stream limit, a stream's window, the header list size, no push."""
    return frame(
        SETTINGS,
        0,
        0,
        struct.pack(
            ">HIHIHIHI",
            SETTINGS_MAX_CONCURRENT_STREAMS,
            limits.max_concurrent_streams,
            SETTINGS_INITIAL_WINDOW_SIZE,
            limits.stream_window,
            SETTINGS_MAX_HEADER_LIST_SIZE,
            limits.max_header_list,
            SETTINGS_ENABLE_PUSH,
            0,
        ),
    )


def peer_settings(payload: bytes, max_entries: int) -> tuple[int | None, int | None, int | None]:
    """A SETTINGS frame's values the server uses: (initial window, max frame size, header table
    size), None where the frame does not set them; the last value of each counts."""
    if len(payload) % 6:
        raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS length", "frame_size")
    if len(payload) // 6 > max_entries:
        raise ConnectionError_(ENHANCE_YOUR_CALM, "too many SETTINGS entries", "settings_flood")
    window = max_frame = table_size = None
    for at in range(0, len(payload), 6):
        ident, value = struct.unpack_from(">HI", payload, at)
        if ident == SETTINGS_INITIAL_WINDOW_SIZE:
            if value > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE too large")
            window = value
        elif ident == SETTINGS_MAX_FRAME_SIZE:
            if not DEFAULT_MAX_FRAME <= value <= 16777215:
                raise ConnectionError_(PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
            max_frame = value
        elif ident == SETTINGS_ENABLE_PUSH:
            if value > 1:
                raise ConnectionError_(PROTOCOL_ERROR, "bad SETTINGS_ENABLE_PUSH")
        elif ident == SETTINGS_HEADER_TABLE_SIZE:
            table_size = value
    return window, max_frame, table_size


def window_increment(payload: bytes) -> int:
    if len(payload) != 4:
        raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE length", "frame_size")
    return int.from_bytes(payload, "big") & 0x7FFFFFFF


class Recent:
    """How the last ``RECENTLY_CLOSED`` streams ended (BY_US, BY_PEER, ENDED)."""

    __slots__ = ("closed",)

    def __init__(self) -> None:
        self.closed: dict[int, int] = {}

    def add(self, stream_id: int, how: int) -> None:
        closed = self.closed
        closed[stream_id] = how
        if len(closed) > RECENTLY_CLOSED:
            del closed[next(iter(closed))]

    def how(self, stream_id: int) -> int | None:
        return self.closed.get(stream_id)
