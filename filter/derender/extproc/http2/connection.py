"""One HTTP/2 connection: frames in, each checked against RFC 9113 and the server's ``Limits``.

``data_received`` parses the frames where they arrive; a stream's coroutine gets its messages
through a future (``streams.StreamSide``). What a connection writes in one loop turn leaves in one
send at the turn's end.

What a peer can make the connection hold is bounded: streams (REFUSED_STREAM past
``max_concurrent_streams``, counting handlers still ending after a reset), message bytes (a message's
length is judged before any of it is kept, and every message is reserved against the connection's
and the worker's budgets; the windows are given back as handlers read the messages), header blocks
(bytes and CONTINUATION frames), control replies (reading pauses while writes are paused; a peer
that leaves more than ``max_control_queue`` of them unread is closed), and frames that make no
progress (empty frames, PRIORITY, WINDOW_UPDATE, SETTINGS entries). Resets the peer makes before an
answer, and resets it makes the server send, draw on a token bucket (Rapid Reset, MadeYouReset).
A frame that breaks one stream resets that stream only; one that breaks the connection's state
(HPACK, flow control, framing) gets GOAWAY with the code RFC 9113 names.
"""

from __future__ import annotations

import asyncio
import struct
from typing import TYPE_CHECKING

from .control import ControlSide
from .headers import Codec, HeaderSide
from .state import ConnectionState
from .streams import StreamSide
from .wire import (
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    ConnectionError_,
    StreamError,
    TokenBucket,
    frame,
)

if TYPE_CHECKING:
    from .server import Server

LINGER = 2.0  # seconds a closing connection's input is still read and dropped


class Backpressure(ConnectionState, asyncio.Protocol):
    """A peer that reads slower than the server writes is not read either until it catches up
    (CVE-2019-9517); writers wait on ``paused`` meanwhile."""

    paused: asyncio.Future | None

    def pause_writing(self) -> None:
        if self.paused is None:
            self.paused = self.loop.create_future()
            self.server.defended("read_paused")
            if self.transport is not None:
                self.transport.pause_reading()

    def resume_writing(self) -> None:
        paused, self.paused = self.paused, None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        if paused is not None and not paused.done():
            paused.set_result(None)


class Connection(HeaderSide, ControlSide, StreamSide, Backpressure):
    def __init__(self, server: Server) -> None:
        self.server = server
        limits = self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface = False
        self.got_settings = False  # the peer's first SETTINGS (the end of its preface)
        self.codec = Codec(limits.max_header_list)
        self.streams = {}
        self.closed: dict[int, int] = {}  # stream id -> BY_US / BY_PEER / ENDED, the last RECENTLY_CLOSED
        self.last_stream = 0
        self.streams_opened = 0
        self.running = 0  # handlers not yet returned (a reset stream's may still be ending)
        self.header_block = None  # a headers.HeaderBlock until its END_HEADERS
        # Sending: the peer's windows and frame size.
        self.send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.max_frame = DEFAULT_MAX_FRAME
        # Receiving: what the peer may still send, and what was read but not yet given back.
        self.stream_window = limits.stream_window
        self.recv_window = limits.connection_window
        self.stream_half, self.connection_half = limits.stream_window // 2, limits.connection_window // 2
        self.unacked = 0
        self.reserved = 0  # what messages admitted and not yet read cost, this connection's
        # The limits a message meets, here rather than behind ``self.limits`` on the per-message path.
        self.max_message, self.max_buffered = limits.max_message, limits.max_buffered
        self.max_buffered_total = limits.max_buffered_total
        # Accounting of what makes no progress.
        self.resets = TokenBucket(limits.reset_burst, limits.reset_rate)
        self.empty_run = 0
        self.priorities = 0
        self.window_updates = 0
        self.data_sent = 0
        self.control_queued = 0
        # Writing and timers.
        self.paused: asyncio.Future | None = None
        self.out: list[bytes] = []  # frames of this loop turn, sent together at its end
        self.reads = 0  # data_received calls: the sweep's sign of life
        self.seen_reads = 0
        self.opened = self.silent_since = self.idle_since = self.loop.time()
        self.settings_sent_at: float | None = None
        self.pinged = False
        self.goaway_phase = 0  # 1: "no new streams soon" sent, 2: the last stream id sent
        self.ending = False  # GOAWAY for an error sent: nothing more is read
        self.shut = False  # our side of the socket shut (a lingering close): nothing more is written

    # -- writing ---------------------------------------------------------------------------------
    def _write(self, data: bytes) -> None:
        if not self.out:
            self.loop.call_soon(self._flush_out)
        self.out.append(data)

    def _control(self, data: bytes) -> None:
        """A control reply; the peer must read them: past ``max_control_queue`` unread, it is closed."""
        self.control_queued += 1
        if self.control_queued > self.limits.max_control_queue and not self.ending:
            self.fail(ConnectionError_(ENHANCE_YOUR_CALM, "control frames left unread", "control_flood"))
            return
        self._write(data)

    def _flush_out(self) -> None:
        out, self.out = self.out, []
        transport = self.transport
        if out and transport is not None and not transport.is_closing() and not self.shut:
            transport.write(b"".join(out) if len(out) > 1 else out[0])
            if not transport.get_write_buffer_size():
                self.control_queued = 0

    def _close(self) -> None:
        """Close after what is written; with TCP, a lingering close: FIN first, then what the peer
        still sends is read and dropped (for ``LINGER`` seconds at most), so that the kernel does not
        answer it with a reset that would destroy the GOAWAY before the peer reads it."""
        self._flush_out()
        transport = self.transport
        if transport is None or transport.is_closing() or self.shut:
            return
        self.ending = True
        if transport.can_write_eof():
            self.shut = True
            transport.write_eof()
            if self.paused is None:
                transport.resume_reading()
            self.loop.call_later(LINGER, transport.abort)
        else:
            transport.close()

    def goaway(self, code: int = NO_ERROR, last: int | None = None) -> None:
        if self.transport is not None and not self.transport.is_closing() and not self.shut:
            payload = (self.last_stream if last is None else last).to_bytes(4, "big") + code.to_bytes(4, "big")
            self._write(frame(GOAWAY, 0, 0, payload))

    def fail(self, exc: ConnectionError_) -> None:
        """End the connection for ``exc``: GOAWAY with its code, the streams cancelled, the socket closed."""
        if self.ending:
            return
        self.ending = True
        self.server.defended(exc.defence, f"HTTP/2 connection closed: {exc}")
        self.goaway(exc.code)
        self._close()
        self._reset_all()  # no stream of it goes on

    def _reset_all(self) -> None:
        for stream in list(self.streams.values()):
            self._reset(stream)
        self.streams.clear()

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        server = self.server
        if len(server.connections) >= self.limits.max_connections:
            self.ending = True
            server.defended("max_connections", "HTTP/2 connection refused: too many connections")
            transport.write(
                frame(SETTINGS, 0, 0) + frame(GOAWAY, 0, 0, bytes(4) + ENHANCE_YOUR_CALM.to_bytes(4, "big"))
            )
            transport.close()
            return
        server.connections.add(self)
        limits = self.limits
        settings = struct.pack(
            ">HIHIHIHI",
            SETTINGS_MAX_CONCURRENT_STREAMS,
            limits.max_concurrent_streams,
            SETTINGS_INITIAL_WINDOW_SIZE,
            self.stream_window,
            SETTINGS_MAX_HEADER_LIST_SIZE,
            limits.max_header_list,
            SETTINGS_ENABLE_PUSH,
            0,
        )
        transport.write(
            frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, (self.recv_window - DEFAULT_WINDOW).to_bytes(4, "big"))
        )
        self.settings_sent_at = self.loop.time()
        if server.draining:
            self.goaway()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.out.clear()
        self.ending = True
        self._reset_all()
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.ending:
            return
        self.reads += 1
        buffer = self.buffer
        buffer += data
        if not self.preface:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    self.fail(ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface"))
                return
            if buffer[: len(PREFACE)] != PREFACE:
                self.fail(ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface"))
                return
            del buffer[: len(PREFACE)]
            self.preface = True
        at, size = 0, len(buffer)
        try:
            while size - at >= 9:
                length = int.from_bytes(buffer[at : at + 3], "big")
                if length > DEFAULT_MAX_FRAME:  # the filter never raises SETTINGS_MAX_FRAME_SIZE
                    raise ConnectionError_(FRAME_SIZE_ERROR, f"a {length}-byte frame", "frame_size")
                if size - at - 9 < length:
                    break
                kind, flags = buffer[at + 3], buffer[at + 4]
                stream_id = int.from_bytes(buffer[at + 5 : at + 9], "big") & 0x7FFFFFFF
                payload = bytes(buffer[at + 9 : at + 9 + length])
                at += 9 + length
                try:
                    self._frame(kind, flags, stream_id, payload)
                except StreamError as exc:
                    self._stream_error(exc)
                if self.ending:
                    return
        except ConnectionError_ as exc:
            self.fail(exc)
        finally:
            del buffer[:at]

    # -- frames in ---------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.header_block is not None and kind != CONTINUATION:
            raise ConnectionError_(PROTOCOL_ERROR, "a header block interrupted")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif not self.got_settings and kind != SETTINGS:
            raise ConnectionError_(PROTOCOL_ERROR, "the preface's SETTINGS missing")
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == PING:
            self._ping(flags, stream_id, payload)
        elif kind == RST_STREAM:
            self._rst_stream(stream_id, payload)
        elif kind == PRIORITY:
            self._priority(stream_id, payload)
        elif kind == GOAWAY:
            self._goaway_frame(stream_id, payload)
        elif kind == PUSH_PROMISE:
            raise ConnectionError_(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # Unknown frame types are ignored (RFC 9113 section 4.1).

    def _empty(self) -> None:
        self.empty_run += 1
        if self.empty_run > self.limits.max_empty_frames:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "empty frames in a row", "empty_frames")

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ConnectionError_(PROTOCOL_ERROR, "bad padding")
        return payload[1 : len(payload) - payload[0]]

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        size = len(payload)
        if size > self.recv_window:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "DATA past the connection window")
        self.recv_window -= size
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            self._give_back(size)
            if stream_id == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "DATA on stream 0")
            if stream_id > self.last_stream:
                raise ConnectionError_(PROTOCOL_ERROR, "DATA on an idle stream")
            if stream is not None:
                raise StreamError(stream_id, STREAM_CLOSED, "DATA after the end of the stream")
            self._closed_stream(stream_id, DATA)
            return
        if size > stream.recv_window:
            self._give_back(size)
            raise StreamError(stream_id, FLOW_CONTROL_ERROR, "DATA past the stream window")
        stream.recv_window -= size
        if flags & PADDED:
            body = self._unpad(flags, payload)
            self._give_back(size - len(body), stream)  # padding counts against the windows, and is returned at once
        else:
            body = payload
        if body:
            self.empty_run = 0
            if stream.content_length is not None:
                stream.received += len(body)
                if stream.received > stream.content_length:
                    self._give_back(len(body))
                    raise StreamError(stream_id, PROTOCOL_ERROR, "DATA past content-length")
            if not stream.buffer and len(body) >= 5 and len(body) == int.from_bytes(body[1:5], "big") + 5:
                self._message(stream, body)  # one whole message, as most frames hold
            else:
                self._assemble(stream, body)
        elif not flags & END_STREAM:
            self._empty()
        if flags & END_STREAM and stream.id in self.streams:
            self._end_of_input(stream)
