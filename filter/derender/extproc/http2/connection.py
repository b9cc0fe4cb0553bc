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
import logging
import struct
from typing import TYPE_CHECKING

from . import headers as fields
from .streams import StreamSide
from .wire import (
    ACK, CONTINUATION, DATA, DEFAULT_MAX_FRAME, DEFAULT_WINDOW, END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, GOAWAY, HEADERS, LAST_STREAM, MAX_WINDOW, NO_ERROR, PADDED, PING,
    PREFACE, PRIORITY, PRIORITY_FLAG, PROTOCOL_ERROR, PUSH_PROMISE, REFUSED_STREAM, RESOURCE_EXHAUSTED, RST_STREAM,
    SETTINGS, SETTINGS_ENABLE_PUSH, SETTINGS_HEADER_TABLE_SIZE, SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE, SETTINGS_TIMEOUT,
    STREAM_CLOSED, UNIMPLEMENTED, WINDOW_UPDATE, ConnectionError_, StreamError, TokenBucket, frame,
)

if TYPE_CHECKING:
    from .server import Server

log = logging.getLogger("derender.http2")

# How a recently closed stream ended, for the frames that may still come on it (RFC 9113 5.1).
BY_US, BY_PEER, ENDED = 1, 2, 3
RECENTLY_CLOSED = 128  # streams remembered per connection
KEEPALIVE = b"derender"  # a keepalive PING's payload
GOAWAY_PING = b"goaway!!"  # the PING between a graceful GOAWAY's two frames
LINGER = 2.0  # seconds a closing connection's input is still read and dropped


class HeaderBlock:
    __slots__ = ("stream_id", "flags", "data", "frames", "dependency")

    def __init__(self, stream_id: int, flags: int, data: bytes, dependency: int | None) -> None:
        self.stream_id = stream_id
        self.flags = flags
        self.data = bytearray(data)
        self.frames = 1
        self.dependency = dependency


class Connection(StreamSide, asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        limits = self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface = False
        self.got_settings = False  # the peer's first SETTINGS (the end of its preface)
        self.codec = fields.Codec(limits.max_header_list)
        self.streams: dict = {}
        self.closed: dict[int, int] = {}  # stream id -> BY_US / BY_PEER / ENDED, the last RECENTLY_CLOSED
        self.last_stream = 0
        self.streams_opened = 0
        self.running = 0  # handlers not yet returned (a reset stream's may still be ending)
        self.header_block: HeaderBlock | None = None
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

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        server = self.server
        if len(server.connections) >= self.limits.max_connections:
            self.ending = True
            server.defended("max_connections", "HTTP/2 connection refused: too many connections")
            transport.write(frame(SETTINGS, 0, 0) + frame(GOAWAY, 0, 0, bytes(4) + ENHANCE_YOUR_CALM.to_bytes(4, "big")))
            transport.close()
            return
        server.connections.add(self)
        limits = self.limits
        settings = struct.pack(">HIHIHIHI", SETTINGS_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams,
                               SETTINGS_INITIAL_WINDOW_SIZE, self.stream_window,
                               SETTINGS_MAX_HEADER_LIST_SIZE, limits.max_header_list, SETTINGS_ENABLE_PUSH, 0)
        transport.write(frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, (self.recv_window - DEFAULT_WINDOW).to_bytes(4, "big")))
        self.settings_sent_at = self.loop.time()
        if server.draining:
            self.goaway()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.out.clear()
        self.ending = True
        for stream in list(self.streams.values()):
            self._reset(stream)
        self.streams.clear()
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)

    def pause_writing(self) -> None:
        """The peer reads slower than the filter writes: stop reading it until it catches up."""
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
            if buffer[:len(PREFACE)] != PREFACE:
                self.fail(ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface"))
                return
            del buffer[:len(PREFACE)]
            self.preface = True
        at, size = 0, len(buffer)
        try:
            while size - at >= 9:
                length = int.from_bytes(buffer[at:at + 3], "big")
                if length > DEFAULT_MAX_FRAME:  # the filter never raises SETTINGS_MAX_FRAME_SIZE
                    raise ConnectionError_(FRAME_SIZE_ERROR, f"a {length}-byte frame", "frame_size")
                if size - at - 9 < length:
                    break
                kind, flags = buffer[at + 3], buffer[at + 4]
                stream_id = int.from_bytes(buffer[at + 5:at + 9], "big") & 0x7FFFFFFF
                payload = bytes(buffer[at + 9:at + 9 + length])
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
            if stream_id:
                raise ConnectionError_(PROTOCOL_ERROR, "GOAWAY on a stream")
            if len(payload) < 8:
                raise ConnectionError_(FRAME_SIZE_ERROR, "short GOAWAY", "frame_size")
            # The peer opens no more streams; the open ones go on, and the connection's timers end it.
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
        return payload[1:len(payload) - payload[0]]

    def _closed_stream(self, stream_id: int, kind: int) -> None:
        """DATA or HEADERS for a stream no longer open (RFC 9113 section 5.1)."""
        how = self.closed.get(stream_id)
        if how == BY_US:
            return  # it may have been in flight when the filter reset the stream
        if how is None:
            if kind == HEADERS:
                raise ConnectionError_(PROTOCOL_ERROR, f"stream {stream_id} is not new")
            return  # closed long ago: nothing to tell
        raise StreamError(stream_id, STREAM_CLOSED, "frame on a closed stream")

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

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        body = self._unpad(flags, payload)
        dependency = None
        if flags & PRIORITY_FLAG:
            if len(body) < 5:
                raise ConnectionError_(FRAME_SIZE_ERROR, "short HEADERS priority", "frame_size")
            dependency = int.from_bytes(body[:4], "big") & 0x7FFFFFFF
            body = body[5:]
        if body:
            self.empty_run = 0
        elif not flags & END_STREAM:
            self._empty()
        if len(body) > self.limits.max_header_block:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "header block too large", "continuation_flood")
        self.header_block = HeaderBlock(stream_id, flags, body, dependency)
        if flags & END_HEADERS:
            self._header_block_done()

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        block = self.header_block
        if block is None or block.stream_id != stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        block.frames += 1
        block.data += payload
        if payload:
            self.empty_run = 0
        elif not flags & END_HEADERS:
            self._empty()
        if block.frames > self.limits.max_continuations + 1 or len(block.data) > self.limits.max_header_block:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "header block too large", "continuation_flood")
        if flags & END_HEADERS:
            self._header_block_done()

    def _header_block_done(self) -> None:
        block, self.header_block = self.header_block, None
        stream_id, flags = block.stream_id, block.flags
        try:
            decoded = self.codec.decode(bytes(block.data))
        except fields.TooLarge as exc:
            too_large = str(exc)
            decoded = None
        else:
            too_large = ""
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers
            if stream.remote_closed:
                raise StreamError(stream_id, STREAM_CLOSED, "HEADERS after the end of the stream")
            if not flags & END_STREAM:
                raise StreamError(stream_id, PROTOCOL_ERROR, "HEADERS without END_STREAM on an open stream")
            if too_large:
                raise StreamError(stream_id, PROTOCOL_ERROR, too_large)
            try:
                fields.trailers(decoded)
            except fields.Malformed as exc:
                raise StreamError(stream_id, PROTOCOL_ERROR, str(exc)) from None
            self._end_of_input(stream)
            return
        if stream_id <= self.last_stream:
            self._closed_stream(stream_id, HEADERS)
            return
        self.last_stream = stream_id
        self.streams_opened += 1
        if block.dependency == stream_id:
            raise StreamError(stream_id, PROTOCOL_ERROR, "a stream that depends on itself")
        if too_large:
            self.server.defended("header_list_size")
            self._made_to_reset()
            self._trailers_only(stream_id, RESOURCE_EXHAUSTED, too_large, flags & END_STREAM)
            return
        try:
            request = fields.request(decoded)
        except fields.Malformed as exc:
            raise StreamError(stream_id, PROTOCOL_ERROR, str(exc)) from None
        if self.server.draining or self.goaway_phase == 2:  # after the last stream id was sent
            self._refuse(stream_id)
            return
        limit = self.limits.max_concurrent_streams
        if len(self.streams) >= limit or self.running >= limit:
            self.server.defended("max_streams")
            self._made_to_reset()
            self._refuse(stream_id)
            return
        method = self.server.methods.get(request.path)
        if method is None or request.encoding not in (None, b"identity"):
            why = f"unknown method {request.path[:200]}" if method is None else "compressed"
            self._trailers_only(stream_id, UNIMPLEMENTED, why, flags & END_STREAM)
            return
        self._open(stream_id, method, request.content_length, flags & END_STREAM)

    def _refuse(self, stream_id: int) -> None:
        self._control(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
        self._closed_now(stream_id, BY_US)

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload", "frame_size")
            self.settings_sent_at = None
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS length", "frame_size")
        if len(payload) // 6 > self.limits.max_settings_entries:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "too many SETTINGS entries", "settings_flood")
        window = None
        for at in range(0, len(payload), 6):
            ident, value = struct.unpack_from(">HI", payload, at)
            if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE too large")
                window = value
            elif ident == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= 16777215:
                    raise ConnectionError_(PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
                self.max_frame = value
            elif ident == SETTINGS_ENABLE_PUSH:
                if value > 1:
                    raise ConnectionError_(PROTOCOL_ERROR, "bad SETTINGS_ENABLE_PUSH")
            elif ident == SETTINGS_HEADER_TABLE_SIZE:
                self.codec.peer_table_size(value)
        if window is not None:  # the last value counts (each change is applied in order; the sum is the same)
            delta, self.peer_initial_window = window - self.peer_initial_window, window
            for stream in self.streams.values():
                stream.window += delta
                if stream.window > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "a stream window past 2^31-1")
        self.got_settings = True
        self._control(frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE length", "frame_size")
        self.window_updates += 1
        if self.window_updates > self.limits.max_window_updates_per_data * (self.data_sent + 10):
            raise ConnectionError_(ENHANCE_YOUR_CALM, "WINDOW_UPDATE flood", "window_update_flood")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            if not increment:
                raise ConnectionError_(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "connection window past 2^31-1")
            self._flush_all()
            return
        if stream_id > self.last_stream:
            raise ConnectionError_(PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
        stream = self.streams.get(stream_id)
        if stream is None:
            return  # a closed stream: it may have been in flight
        if not increment:
            raise StreamError(stream_id, PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        stream.window += increment
        if stream.window > MAX_WINDOW:
            raise StreamError(stream_id, FLOW_CONTROL_ERROR, "stream window past 2^31-1")
        self._flush(stream)

    def _ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ConnectionError_(FRAME_SIZE_ERROR, "PING of other than 8 bytes", "frame_size")
        if not flags & ACK:
            self._control(frame(PING, ACK, 0, payload))
        elif payload == GOAWAY_PING and self.goaway_phase == 1:
            self._final_goaway()

    def _rst_stream(self, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "RST_STREAM length", "frame_size")
        if stream_id > self.last_stream:
            raise ConnectionError_(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        if not stream.started and not self.resets.take():  # reset before any answer: Rapid Reset's pattern
            raise ConnectionError_(ENHANCE_YOUR_CALM, "streams reset too fast", "rapid_reset")
        self._reset(stream)
        self._remove(stream, BY_PEER)

    def _priority(self, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "PRIORITY on stream 0")
        self.priorities += 1
        if self.priorities > self.limits.max_priority_per_stream * (1 + self.streams_opened):
            raise ConnectionError_(ENHANCE_YOUR_CALM, "PRIORITY flood", "priority_flood")
        if len(payload) != 5:
            raise StreamError(stream_id, FRAME_SIZE_ERROR, "PRIORITY length")
        if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
            raise StreamError(stream_id, PROTOCOL_ERROR, "a stream that depends on itself")

    # -- errors, resets, closing -----------------------------------------------------------------
    def _made_to_reset(self) -> None:
        """The peer made the filter reset or refuse a stream (MadeYouReset): a token, or the connection."""
        if not self.resets.take():
            raise ConnectionError_(ENHANCE_YOUR_CALM, "the peer made too many streams fail", "rapid_reset")

    def _stream_error(self, exc: StreamError) -> None:
        self.server.defended("stream_error")
        self._made_to_reset()
        self._control(frame(RST_STREAM, 0, exc.stream_id, exc.code.to_bytes(4, "big")))
        stream = self.streams.get(exc.stream_id)
        if stream is not None:
            self._reset(stream)
            self._remove(stream, BY_US)
        else:
            self._closed_now(exc.stream_id, BY_US)

    def _closed_now(self, stream_id: int, how: int) -> None:
        closed = self.closed
        closed[stream_id] = how
        if len(closed) > RECENTLY_CLOSED:
            del closed[next(iter(closed))]

    def _remove(self, stream, how: int) -> None:
        if self.streams.pop(stream.id, None) is not None:
            self._closed_now(stream.id, how)
            if not self.streams:
                self.idle_since = self.loop.time()
                if self.goaway_phase == 2 or (self.goaway_phase and self.server.draining):
                    self._close()

    # -- timers (the server's sweep) -------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Once a second: the preface, SETTINGS ACK, idle and keepalive timeouts."""
        if self.ending or self.transport is None or self.transport.is_closing():
            return
        limits = self.limits
        if self.reads != self.seen_reads:
            self.seen_reads = self.reads
            self.silent_since = now
            self.pinged = False
        if not self.got_settings:
            if now - self.opened > limits.preface_timeout:
                self.fail(ConnectionError_(PROTOCOL_ERROR, "no connection preface in time", "preface_timeout"))
            return
        if self.settings_sent_at is not None and now - self.settings_sent_at > limits.settings_timeout:
            self.fail(ConnectionError_(SETTINGS_TIMEOUT, "SETTINGS not acknowledged in time", "settings_timeout"))
            return
        silent = now - self.silent_since
        if self.pinged and silent > limits.keepalive_time + limits.keepalive_timeout:
            self.fail(ConnectionError_(NO_ERROR, "the peer went silent (keepalive)", "keepalive_timeout"))
            return
        if silent > limits.keepalive_time and not self.pinged:
            self.pinged = True
            self._control(frame(PING, 0, 0, KEEPALIVE))
        if self.goaway_phase == 1 and now - self.idle_since > limits.idle_timeout + 2:
            self._final_goaway()  # the PING's answer did not come: a round trip is long past
        elif not self.goaway_phase and not self.streams and now - self.idle_since > limits.idle_timeout:
            self.server.defended("idle_timeout")
            self.goaway_phase = 1  # RFC 9113 6.8: "no new streams, soon", a round trip, then the last id
            self.goaway(NO_ERROR, LAST_STREAM)
            self._control(frame(PING, 0, 0, GOAWAY_PING))

    def _final_goaway(self) -> None:
        self.goaway_phase = 2
        self.goaway(NO_ERROR)
        if not self.streams:
            self._close()
