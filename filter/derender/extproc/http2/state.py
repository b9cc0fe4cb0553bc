"""What a ``Connection`` holds, declared once for every side of it.

``connection.Connection`` is four sides (``HeaderSide``, ``ControlSide``, ``StreamSide``, ``Backpressure``),
each in its own module, sharing one object's attributes and calling each other's methods. Each side
inherits this class, so the type checker knows those attributes and methods where they are used;
``Connection.__init__`` sets the attributes, and the sides define the methods (the declarations below
exist only for the type checker, so nothing here runs or is looked up at run time).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .headers import Codec, HeaderBlock
    from .server import Server
    from .streams import Stream
    from .wire import ConnectionError_, Limits, TokenBucket


class ConnectionState:
    server: Server
    limits: Limits
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport | None
    buffer: bytearray
    preface: bool
    got_settings: bool
    codec: Codec
    streams: dict[int, Stream]
    closed: dict[int, int]
    last_stream: int
    streams_opened: int
    running: int
    header_block: HeaderBlock | None
    send_window: int
    peer_initial_window: int
    max_frame: int
    stream_window: int
    recv_window: int
    stream_half: int
    connection_half: int
    unacked: int
    reserved: int
    max_message: int
    max_buffered: int
    max_buffered_total: int
    resets: TokenBucket
    empty_run: int
    priorities: int
    window_updates: int
    data_sent: int
    control_queued: int
    paused: asyncio.Future | None
    out: list[bytes]
    reads: int
    seen_reads: int
    opened: float
    silent_since: float
    idle_since: float
    settings_sent_at: float | None
    pinged: bool
    goaway_phase: int
    ending: bool
    shut: bool

    if TYPE_CHECKING:
        # connection.Connection
        def _write(self, data: bytes) -> None: ...
        def _control(self, data: bytes) -> None: ...
        def _close(self) -> None: ...
        def _empty(self) -> None: ...
        @staticmethod
        def _unpad(flags: int, payload: bytes) -> bytes: ...
        def fail(self, exc: ConnectionError_) -> None: ...
        def goaway(self, code: int = 0, last: int | None = None) -> None: ...

        # control.ControlSide
        def _closed_stream(self, stream_id: int, kind: int) -> None: ...
        def _closed_now(self, stream_id: int, how: int) -> None: ...
        def _refuse(self, stream_id: int) -> None: ...
        def _remove(self, stream: Stream, how: int) -> None: ...
        def _take_reset(self, why: str = ...) -> None: ...

        # streams.StreamSide
        def _open(
            self, stream_id: int, method: tuple, content_length: int | None, ended: int, metadata: dict[str, str]
        ) -> None: ...
        def _end_of_input(self, stream: Stream) -> None: ...
        def _flush(self, stream: Stream) -> None: ...
        def _flush_all(self) -> None: ...
        def _reset(self, stream: Stream) -> None: ...
        def _trailers_only(self, stream_id: int, status: int, why: str, ended: int) -> None: ...
