"""One HTTP/2 connection's protocol, without I/O: bytes in (``receive``), the handlers' calls in
(``read``, ``send``, ``finish``), the time in (``tick``); events (``events``) and bytes
(``data_to_send``) out. ``connection.Connection`` runs it on a socket; tests drive it directly.

Every frame is checked against RFC 9113 and the ``Limits``. What a peer can make the connection
hold is bounded: streams (REFUSED_STREAM past ``max_concurrent_streams``, counting handlers still
ending after a reset), message bytes (``inbound``), header blocks (bytes and CONTINUATION frames),
control replies (a peer that leaves more than ``max_control_queue`` of them unread is closed), and
frames that make no progress (empty frames, PRIORITY, WINDOW_UPDATE, SETTINGS entries). Resets the
peer makes before an answer, and resets it makes the server send, draw on a token bucket (Rapid
Reset, MadeYouReset). A frame that breaks one stream resets that stream only; one that breaks the
connection's state (HPACK, flow control, framing) gets GOAWAY with the code RFC 9113 names.

One class, longer than 400 lines: RFC 9113's frames act on the connection and
its streams together (a SETTINGS frame changes every stream's window, a stream's end may end a
graceful GOAWAY), and reading them in one place is reading the RFC's state machine. What stands
alone is apart: header blocks (``headers``), control frames as values and closed streams
(``control``), messages in (``inbound``), frames out (``outbound``), the clocks (``timers``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container

from .control import (
    BY_PEER,
    BY_US,
    ENDED,
    GOAWAY_PING,
    KEEPALIVE,
    Recent,
    peer_settings,
    settings_frame,
    window_increment,
)
from .events import Close, Defended, Drained, Ended, Opened
from .headers import Gatherer, Malformed, request, trailers
from .inbound import Budget, Inbound, Refused
from .outbound import Outbound
from .stream import Stream
from .timers import Due, Timers
from .wire import (
    ACK,
    CANCEL,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INTERNAL_ERROR,
    LAST_STREAM,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RESOURCE_EXHAUSTED,
    RST_STREAM,
    SETTINGS,
    SETTINGS_TIMEOUT,
    STREAM_CLOSED,
    UNIMPLEMENTED,
    WINDOW_UPDATE,
    ConnectionError_,
    Limits,
    StreamError,
    TokenBucket,
    frame,
)

MAX_FRAME_IN = 16384  # the server never raises SETTINGS_MAX_FRAME_SIZE


class Machine:
    def __init__(
        self,
        limits: Limits,
        budget: Budget,
        paths: Container[str],
        clock: Callable[[], float],
        draining: bool = False,
        plain: bool = False,
    ) -> None:
        self.limits = limits
        self.paths = paths  # the methods served: another path is answered UNIMPLEMENTED
        # Plain HTTP (the response leg's listener): any path, no request body, the reply's head given
        # by its handler (``respond``), its DATA as it is, and its end an empty DATA with END_STREAM.
        self.plain = plain
        self.clock = clock
        self.draining = draining  # the server stops: no new streams
        self.events: deque = deque()
        self.outbound = Outbound(limits, plain)
        self.inbound = Inbound(limits, budget, self.outbound)
        self.handed = self.inbound.handed  # (stream id, message or EOF): ``events.Message``'s, as pairs
        self.headers = Gatherer(limits.max_header_list, limits.max_header_block, limits.max_continuations)
        self.buffer = bytearray()
        self.preface = False
        self.got_settings = False  # the peer's first SETTINGS (the end of its preface)
        self.streams: dict[int, Stream] = {}
        self.recent = Recent()  # how recently closed streams ended
        self.last_stream = 0
        self.streams_opened = 0
        self.running = 0  # handlers not yet returned (a reset stream's may still be ending)
        # Accounting of what makes no progress.
        self.resets = TokenBucket(limits.reset_burst, limits.reset_rate, clock)
        self.empty_run = 0
        self.priorities = 0
        self.window_updates = 0
        self.timers = Timers(limits, clock())
        self.goaway_phase = 0  # 1: "no new streams soon" sent, 2: the last stream id sent
        self.ending = False  # GOAWAY for an error sent, or the socket gone: nothing more is read
        self.closed = False  # the socket closes (or has): nothing more is written

    # -- the socket's side ------------------------------------------------------------------------
    def initiate(self) -> None:
        """The server's preface: its SETTINGS, and the connection window it grants."""
        limits = self.limits
        self.outbound.write(settings_frame(limits))
        self.outbound.write(frame(WINDOW_UPDATE, 0, 0, (self.inbound.recv_window - DEFAULT_WINDOW).to_bytes(4, "big")))
        self.timers.settings_sent_at = self.clock()
        if self.draining:
            self.goaway()

    def refuse(self) -> None:
        """A connection past the server's limit: closed at once."""
        self.ending = True
        self.outbound.write(
            frame(SETTINGS, 0, 0) + frame(GOAWAY, 0, 0, bytes(4) + ENHANCE_YOUR_CALM.to_bytes(4, "big"))
        )
        self.close()

    def data_to_send(self) -> bytes:
        return self.outbound.take()

    def sent_all(self) -> None:
        """The peer has read everything written (the socket's buffer is empty)."""
        self.outbound.control_queued = 0

    def lost(self) -> None:
        """The socket is gone."""
        self.ending = self.closed = self.outbound.shut = True
        self.outbound.out.clear()
        self._end_all()

    def close(self) -> None:
        """Close after what is written (``Close``); nothing more is written."""
        if not self.closed:
            self.closed = self.ending = True
            self.outbound.shut = True
            self.events.append(Close())

    def drain(self) -> None:
        """The server stops: GOAWAY, no new streams."""
        self.draining = True
        self.goaway()

    def retire(self) -> None:
        """A graceful GOAWAY (RFC 9113 6.8): "no new streams, soon", a round trip, then the last id; the
        open streams finish, then the connection closes. The peer opens another for its next streams."""
        if self.goaway_phase or self.ending or self.draining:
            return
        self.goaway_phase = 1
        self.goaway(NO_ERROR, LAST_STREAM)
        self.outbound.control(frame(PING, 0, 0, GOAWAY_PING))

    def goaway(self, code: int = NO_ERROR, last: int | None = None) -> None:
        if not self.closed:
            payload = (self.last_stream if last is None else last).to_bytes(4, "big") + code.to_bytes(4, "big")
            self.outbound.write(frame(GOAWAY, 0, 0, payload))

    def fail(self, exc: ConnectionError_) -> None:
        """End the connection for ``exc``: GOAWAY with its code, the streams ended, the socket closed."""
        if self.ending:
            return
        self.events.append(Defended(exc.defence, f"HTTP/2 connection closed: {exc}"))
        self.goaway(exc.code)
        self.close()
        self._end_all()

    def _end_all(self) -> None:
        for stream in list(self.streams.values()):
            self._end(stream)
        self.streams.clear()

    # -- bytes in ---------------------------------------------------------------------------------
    def receive(self, data: bytes) -> None:
        if self.ending:
            return
        self.timers.reads += 1
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
        outbound, max_control = self.outbound, self.limits.max_control_queue
        try:
            while size - at >= 9:
                length = int.from_bytes(buffer[at : at + 3], "big")
                if length > MAX_FRAME_IN:
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
                if outbound.control_queued > max_control:
                    raise ConnectionError_(ENHANCE_YOUR_CALM, "control frames left unread", "control_flood")
                if self.ending:
                    return
        except ConnectionError_ as exc:
            self.fail(exc)
        finally:
            del buffer[:at]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.headers.block is not None and kind != CONTINUATION:
            raise ConnectionError_(PROTOCOL_ERROR, "a header block interrupted")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif not self.got_settings and kind != SETTINGS:
            raise ConnectionError_(PROTOCOL_ERROR, "the preface's SETTINGS missing")
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self.headers.more(stream_id, payload)
            if payload:
                self.empty_run = 0
            elif not flags & END_HEADERS:
                self._empty()
            self.headers.bound()
            if flags & END_HEADERS:
                self._header_block_done()
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
            # The peer opens no more streams; the open ones go on, and the timers end the connection.
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
        inbound = self.inbound
        if size > inbound.recv_window:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "DATA past the connection window")
        inbound.recv_window -= size
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            inbound.give_back(size)
            if stream_id == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "DATA on stream 0")
            if stream_id > self.last_stream:
                raise ConnectionError_(PROTOCOL_ERROR, "DATA on an idle stream")
            if stream is not None:
                raise StreamError(stream_id, STREAM_CLOSED, "DATA after the end of the stream")
            self._closed_stream(stream_id, DATA)
            return
        if size > stream.recv_window:
            inbound.give_back(size)
            raise StreamError(stream_id, FLOW_CONTROL_ERROR, "DATA past the stream window")
        stream.recv_window -= size
        if flags & PADDED:
            body = self._unpad(flags, payload)
            inbound.give_back(size - len(body), stream)  # padding counts against the windows, and is returned at once
        else:
            body = payload
        if body and self.plain:
            inbound.give_back(size)
            self.events.append(Defended("body"))  # the response leg counts it as leg_body
            raise StreamError(stream_id, CANCEL, "a request body")
        try:
            if body:
                self.empty_run = 0
                if stream.content_length is not None:
                    stream.received += len(body)
                    if stream.received > stream.content_length:
                        inbound.give_back(len(body))
                        raise StreamError(stream_id, PROTOCOL_ERROR, "DATA past content-length")
                if not stream.buffer and len(body) >= 5 and len(body) == int.from_bytes(body[1:5], "big") + 5:
                    inbound.message(stream, body)
                else:
                    inbound.assemble(stream, body)
            elif not flags & END_STREAM:
                self._empty()
            if flags & END_STREAM and stream.id in self.streams:
                self._end_of_input(stream)
        except Refused as exc:
            self._abort(stream, exc.status, str(exc), exc.defence)

    def _end_of_input(self, stream: Stream) -> None:
        if stream.remote_closed:
            return
        if stream.content_length is not None and stream.content_length != stream.received:
            raise StreamError(stream.id, PROTOCOL_ERROR, "DATA does not add up to content-length")
        self.inbound.end(stream)

    # -- header blocks ------------------------------------------------------------------------------
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
        if self.headers.start(stream_id, flags, body, dependency):
            self._header_block_done()

    def _header_block_done(self) -> None:
        """A whole block, judged: trailers end a stream; a new stream is opened, refused or answered at once."""
        block, decoded, too_large = self.headers.done()
        stream_id, flags = block.stream_id, block.flags
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers
            if stream.remote_closed:
                raise StreamError(stream_id, STREAM_CLOSED, "HEADERS after the end of the stream")
            if not flags & END_STREAM:
                raise StreamError(stream_id, PROTOCOL_ERROR, "HEADERS without END_STREAM on an open stream")
            if too_large:
                raise StreamError(stream_id, PROTOCOL_ERROR, too_large)
            try:
                trailers(decoded)
            except Malformed as exc:
                raise StreamError(stream_id, PROTOCOL_ERROR, str(exc)) from None
            try:
                self._end_of_input(stream)
            except Refused as exc:
                self._abort(stream, exc.status, str(exc), exc.defence)
            return
        if stream_id <= self.last_stream:
            self._closed_stream(stream_id, HEADERS)
            return
        self.last_stream = stream_id
        self.streams_opened += 1
        if block.dependency == stream_id:
            raise StreamError(stream_id, PROTOCOL_ERROR, "a stream that depends on itself")
        ended = flags & END_STREAM
        if too_large:
            self.events.append(Defended("header_list_size"))
            self._take_reset()
            self._trailers_only(stream_id, RESOURCE_EXHAUSTED, too_large, ended)
            return
        try:
            asked = request(decoded)
        except Malformed as exc:
            raise StreamError(stream_id, PROTOCOL_ERROR, str(exc)) from None
        if self.draining or self.goaway_phase == 2:  # after the last stream id was sent
            self._refuse(stream_id)
            return
        limit = self.limits.max_concurrent_streams
        if len(self.streams) >= limit or self.running >= limit:
            self.events.append(Defended("max_streams"))
            self._take_reset()
            self._refuse(stream_id)
            return
        if not self.plain and (asked.path not in self.paths or asked.encoding not in (None, b"identity")):
            why = f"unknown method {asked.path[:200]}" if asked.path not in self.paths else "compressed"
            self._trailers_only(stream_id, UNIMPLEMENTED, why, ended)
            return
        stream = Stream(stream_id, self.outbound.peer_initial_window, self.inbound.stream_window, asked.content_length)
        self.streams[stream_id] = stream
        self.running += 1
        self.events.append(Opened(stream_id, asked.path, asked.metadata, asked.method))
        if ended:
            self._end_of_input(stream)

    # -- control frames -----------------------------------------------------------------------------
    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload", "frame_size")
            self.timers.settings_sent_at = None
            return
        outbound = self.outbound
        window, max_frame, table_size = peer_settings(payload, self.limits.max_settings_entries)
        if max_frame is not None:
            outbound.max_frame = max_frame
        if table_size is not None:
            outbound.fields.peer_table_size(table_size)
        if window is not None:  # the last value counts (each change is applied in order; the sum is the same)
            delta, outbound.peer_initial_window = window - outbound.peer_initial_window, window
            for stream in self.streams.values():
                stream.window += delta
                if stream.window > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "a stream window past 2^31-1")
        self.got_settings = True
        outbound.control(frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        increment = window_increment(payload)
        self.window_updates += 1
        if self.window_updates > self.limits.max_window_updates_per_data * (self.outbound.data_sent + 10):
            raise ConnectionError_(ENHANCE_YOUR_CALM, "WINDOW_UPDATE flood", "window_update_flood")
        if stream_id == 0:
            if not increment:
                raise ConnectionError_(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.outbound.send_window += increment
            if self.outbound.send_window > MAX_WINDOW:
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
            self.outbound.control(frame(PING, ACK, 0, payload))
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
        self._end(stream)
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

    # -- closed streams, resets ---------------------------------------------------------------------
    def _closed_stream(self, stream_id: int, kind: int) -> None:
        """DATA or HEADERS for a stream no longer open (RFC 9113 section 5.1)."""
        how = self.recent.how(stream_id)
        if how == BY_US:
            return  # it may have been in flight when the server reset the stream
        if how is None:
            if kind == HEADERS:
                raise ConnectionError_(PROTOCOL_ERROR, f"stream {stream_id} is not new")
            return  # closed long ago: nothing to tell
        raise StreamError(stream_id, STREAM_CLOSED, "frame on a closed stream")

    def _refuse(self, stream_id: int) -> None:
        self.outbound.control(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
        self.recent.add(stream_id, BY_US)

    def _take_reset(self, why: str = "the peer made too many streams fail") -> None:
        """A stream the peer reset before its answer (Rapid Reset), or made the server reset or refuse
        (MadeYouReset): a token of the reset budget, or the connection."""
        if not self.resets.take():
            raise ConnectionError_(ENHANCE_YOUR_CALM, why, "rapid_reset")

    def _stream_error(self, exc: StreamError) -> None:
        self.events.append(Defended("stream_error"))
        self._take_reset()
        self.outbound.control(frame(RST_STREAM, 0, exc.stream_id, exc.code.to_bytes(4, "big")))
        stream = self.streams.get(exc.stream_id)
        if stream is not None:
            self._end(stream)
            self._remove(stream, BY_US)
        else:
            self.recent.add(exc.stream_id, BY_US)

    def _remove(self, stream: Stream, how: int) -> None:
        if self.streams.pop(stream.id, None) is not None:
            self.recent.add(stream.id, how)
            if not self.streams:
                self.timers.idle_since = self.clock()
                if self.goaway_phase == 2:
                    self.close()

    def _end(self, stream: Stream) -> None:
        """The stream is over before its trailers (reset, or the connection went): its handler is cancelled."""
        stream.ended = True
        stream.remote_closed = True
        stream.pending.clear()
        stream.blocked = False
        self.inbound.discard(stream)
        self.events.append(Ended(stream.id))

    def _abort(self, stream: Stream, status: int, why: str, defence: str) -> None:
        """A stream the server cannot go on with: its status to the peer, its handler cancelled."""
        self.events.append(Defended(defence))
        stream.pending.clear()
        stream.blocked = False
        self.inbound.discard(stream)
        self.events.append(Ended(stream.id))
        self.finish(stream.id, status, why)
        self._take_reset()

    # -- a handler's calls --------------------------------------------------------------------------
    def read(self, stream_id: int) -> object | None:
        """The stream's next message (bytes, or EOF); None: a ``Message`` brings it once it comes."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.ended:
            return None
        if not stream.inbox and not stream.reading:  # as at production pacing: the handler waits
            stream.reading = True
            return None
        item = self.inbound.read(stream)
        if self.outbound.control_queued > self.limits.max_control_queue:
            self.fail(ConnectionError_(ENHANCE_YOUR_CALM, "control frames left unread", "control_flood"))
        return item

    def stop_reading(self, stream_id: int) -> None:
        """The handler no longer waits (its read was cancelled)."""
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.reading = False

    def unread(self, stream_id: int, item: object) -> None:
        """A ``Message`` that found no handler waiting: kept for the next read."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.ended:
            return
        try:
            self.inbound.unread(stream, item)
        except Refused as exc:
            try:
                self._abort(stream, exc.status, str(exc), exc.defence)
            except ConnectionError_ as error:
                self.fail(error)

    def send(self, stream_id: int, message: bytes) -> bool:
        """A reply; False if part of it waits for the peer's windows (a ``Drained`` says when it left)."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.ended:
            raise ConnectionResetError("the stream is closed")
        if self.outbound.send(stream, message):
            return True
        stream.blocked = True
        return False

    def is_open(self, stream_id: int) -> bool:
        """The stream may still be answered (it was not reset, nor its connection lost)."""
        stream = self.streams.get(stream_id)
        return stream is not None and not stream.ended

    def respond(self, stream_id: int, fields: list[tuple[str, str]]) -> None:
        """Plain HTTP: the reply's head (its DATA follows with ``send``, its end with ``finish``)."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.ended:
            raise ConnectionResetError("the stream is closed")
        stream.started = True
        self.outbound.write(self.outbound.fields.frames(stream_id, fields, 0, self.outbound.max_frame))

    def reset(self, stream_id: int) -> None:
        """Break a stream off (RST_STREAM INTERNAL_ERROR): the peer resets its client's stream."""
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        self.outbound.control(frame(RST_STREAM, 0, stream_id, INTERNAL_ERROR.to_bytes(4, "big")))
        stream.ended = True
        stream.pending.clear()
        self.inbound.discard(stream)
        self._remove(stream, BY_US)

    def finish(self, stream_id: int, status: int, why: str) -> None:
        """The handler is done: its trailers, after whatever DATA still waits for a window."""
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        stream.ended = True
        stream.trailers = (status, why)
        if not stream.pending:
            self._write_trailers(stream)

    def handler_done(self) -> None:
        """A handler returned (one cancelled before it ran counts too)."""
        self.running -= 1

    # -- frames out ---------------------------------------------------------------------------------
    def _flush(self, stream: Stream) -> None:
        """Send what a stream has waiting, as far as the windows allow; then its trailers if due."""
        if not self.outbound.flush(stream):
            return
        if stream.blocked:
            stream.blocked = False
            self.events.append(Drained(stream.id))
        if stream.trailers is not None and stream.id in self.streams:
            self._write_trailers(stream)

    def _flush_all(self) -> None:
        for stream in list(self.streams.values()):
            if stream.pending:
                self._flush(stream)

    def _trailers_only(self, stream_id: int, status: int, why: str, ended: int) -> None:
        """A stream answered by its status alone; reset as well if the peer is still sending on it."""
        self.outbound.trailers_only(stream_id, status, why)
        if not ended:
            self.outbound.control(frame(RST_STREAM, 0, stream_id, NO_ERROR.to_bytes(4, "big")))
        self.recent.add(stream_id, ENDED if ended else BY_US)

    def _write_trailers(self, stream: Stream) -> None:
        status, why = stream.trailers or (0, "")
        self.inbound.discard(stream)
        if self.closed:
            self._remove(stream, BY_US)
            return
        if not stream.started:
            self._trailers_only(stream.id, status, why, stream.remote_closed)
            self._remove(stream, ENDED if stream.remote_closed else BY_US)
            return
        self.outbound.trailers(stream.id, status, why)
        if stream.remote_closed:
            self._remove(stream, ENDED)
        else:  # answered before the peer was done: it may stop sending (RFC 9113 8.1)
            self.outbound.control(frame(RST_STREAM, 0, stream.id, NO_ERROR.to_bytes(4, "big")))
            self._remove(stream, BY_US)

    # -- timers ---------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Once a second or so: the preface, SETTINGS ACK, idle and keepalive timeouts."""
        if self.ending:
            return
        for due in self.timers.due(now, self.got_settings, not self.streams, self.goaway_phase):
            if due is Due.PREFACE_LATE:
                self.fail(ConnectionError_(PROTOCOL_ERROR, "no connection preface in time", due.value))
            elif due is Due.SETTINGS_LATE:
                self.fail(ConnectionError_(SETTINGS_TIMEOUT, "SETTINGS not acknowledged in time", due.value))
            elif due is Due.SILENT:
                self.fail(ConnectionError_(NO_ERROR, "the peer went silent (keepalive)", due.value))
            elif due is Due.PING:
                self.outbound.control(frame(PING, 0, 0, KEEPALIVE))
            elif due is Due.FINAL_GOAWAY:
                self._final_goaway()
            elif due is Due.IDLE:
                self.events.append(Defended(due.value))
                self.retire()
        if self.outbound.control_queued > self.limits.max_control_queue:
            self.fail(ConnectionError_(ENHANCE_YOUR_CALM, "control frames left unread", "control_flood"))

    def _final_goaway(self) -> None:
        self.goaway_phase = 2
        self.goaway(NO_ERROR)
        if not self.streams:
            self.close()
