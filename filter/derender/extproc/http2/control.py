"""The frames that steer a connection (SETTINGS, WINDOW_UPDATE, PING, RST_STREAM, PRIORITY, GOAWAY),
what the server remembers of closed streams, its reset accounting, and the connection's timers.

``ControlSide`` is the half of ``connection.Connection`` that does not carry a stream's data.
"""

from __future__ import annotations

import struct

from .state import ConnectionState
from .wire import (
    ACK,
    DEFAULT_MAX_FRAME,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    HEADERS,
    LAST_STREAM,
    MAX_WINDOW,
    NO_ERROR,
    PING,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_HEADER_TABLE_SIZE,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_TIMEOUT,
    STREAM_CLOSED,
    ConnectionError_,
    StreamError,
    frame,
)

# How a recently closed stream ended, for the frames that may still come on it (RFC 9113 5.1).
BY_US, BY_PEER, ENDED = 1, 2, 3
RECENTLY_CLOSED = 128  # streams remembered per connection
KEEPALIVE = b"derender"  # a keepalive PING's payload
GOAWAY_PING = b"goaway!!"  # the PING between a graceful GOAWAY's two frames


class ControlSide(ConnectionState):
    """Control frames, closed streams, resets and timers of a ``Connection`` (whose attributes these use)."""

    # -- control frames ---------------------------------------------------------------------------
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
        if not stream.started:  # reset before any answer: Rapid Reset's pattern
            self._take_reset("streams reset too fast")
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

    def _goaway_frame(self, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "GOAWAY on a stream")
        if len(payload) < 8:
            raise ConnectionError_(FRAME_SIZE_ERROR, "short GOAWAY", "frame_size")
        # The peer opens no more streams; the open ones go on, and the connection's timers end it.

    # -- closed streams, resets ---------------------------------------------------------------------
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

    def _refuse(self, stream_id: int) -> None:
        self._control(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
        self._closed_now(stream_id, BY_US)

    def _take_reset(self, why: str = "the peer made too many streams fail") -> None:
        """A stream the peer reset before its answer (Rapid Reset), or made the filter reset or refuse
        (MadeYouReset): a token of the reset budget, or the connection."""
        if not self.resets.take():
            raise ConnectionError_(ENHANCE_YOUR_CALM, why, "rapid_reset")

    def _stream_error(self, exc: StreamError) -> None:
        self.server.defended("stream_error")
        self._take_reset()
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
                if self.goaway_phase == 2:
                    self._close()

    # -- timers (the server's sweep) ----------------------------------------------------------------
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
