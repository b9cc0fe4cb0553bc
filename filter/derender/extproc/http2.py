"""gRPC over HTTP/2 on the event loop's own thread: the ext_proc stream and the health check.

Why not grpc.aio: at production pacing every token is one ext_proc message and one reply, and
grpc.aio hands each of them between three threads (gRPC's I/O thread, its completion-queue poller,
the event loop, woken through a socket pair): a fifth of a worker's CPU went to context switches. An
echo ext_proc at 64 streams paced one token per 20 ms cost 145 us of server CPU per token on grpc.aio
and 44 us here (``bench/PACED.md``, ``bench/echo_extproc.py --transport``). Here one
``asyncio.Protocol`` per connection parses the frames where they arrive and a stream's coroutine gets
its messages through a future. What a connection writes in one loop turn leaves in one send at the
turn's end: with several streams per connection (``envoy/local.yaml``), a GPU's batch of events
arrives in a few reads and its replies leave in a few sends.

What it speaks is what Envoy's gRPC client (and gRPC's health-check clients) send over cleartext
HTTP/2 (h2c, prior knowledge): SETTINGS, PING, WINDOW_UPDATE both ways (flow control is kept on what
is sent; what arrives is acknowledged as it arrives, its size bounded by ``max_message``), HEADERS +
CONTINUATION (HPACK by the ``hpack`` package), DATA (padding allowed), RST_STREAM, GOAWAY.
Unknown methods get UNIMPLEMENTED, a handler's exception UNKNOWN, as gRPC's servers answer. No TLS,
no compression (a compressed message gets UNIMPLEMENTED), no server push.
``derender serve --transport grpcio`` keeps grpc.aio.

Longer than 400 lines: one wire protocol, whose frames in and out share a connection's windows and
a stream's state; split, each half would reach into the other's.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from typing import Awaitable, Callable

from grpc.aio import EOF  # the same end-of-stream marker the servicer checks on both transports
from hpack import Decoder, Encoder
from hpack.exceptions import HPACKError

log = logging.getLogger("derender.http2")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = 0, 1, 3, 7, 9
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 4, 5
OK, CANCELLED, UNKNOWN, NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED = 0, 1, 2, 5, 8, 12

# A gRPC response's headers (a trailers-only response adds the status to them).
RESPONSE_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]

# What the filter lets a peer send ahead of its reads: per stream and per connection.
STREAM_WINDOW = 4 << 20
CONNECTION_WINDOW = 16 << 20
MAX_WINDOW = (1 << 31) - 1

# handler(read, write): read() -> the next request message, or EOF once the peer is done sending;
# write(message) sends one reply. It returns (or raises) to end the stream.
Handler = Callable[[Callable[[], Awaitable[object]], Callable[[object], Awaitable[None]]], Awaitable[None]]
# path -> (the request type's ``FromString``, the handler)
Methods = dict[str, tuple[Callable[[bytes], object], Handler]]


class ConnectionError_(Exception):
    """The peer broke HTTP/2: GOAWAY with ``code``, then close."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


class Status(Exception):
    """Raised by a handler: the stream ends with this gRPC status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


class Stream:
    __slots__ = ("id", "parse", "buffer", "inbox", "waiter", "task", "window", "pending", "started", "ended",
                 "remote_closed", "unacked", "trailers")

    def __init__(self, stream_id: int, parse: Callable[[bytes], object], window: int) -> None:
        self.id = stream_id
        self.parse = parse
        self.buffer = bytearray()  # gRPC's length-prefixed messages, as DATA frames bring them
        self.inbox: deque = deque()  # whole messages (bytes) or EOF, not yet read
        self.waiter: asyncio.Future | None = None
        self.task: asyncio.Task | None = None
        self.window = window  # what the peer lets us send on this stream
        self.pending = bytearray()  # DATA that waits for a window
        self.started = False  # response headers sent
        self.ended = False  # trailers sent (or the stream reset)
        self.remote_closed = False
        self.unacked = 0  # bytes received on this stream not yet given back in a WINDOW_UPDATE
        self.trailers: tuple[int, str] | None = None  # (grpc-status, grpc-message) once the handler is done


class Connection(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface = False
        self.decoder = Decoder()
        self.decoder.max_header_list_size = 64 << 10
        self.encoder = Encoder()
        self.streams: dict[int, Stream] = {}
        self.last_stream = 0
        self.header_block: list | None = None  # [stream id, flags, bytes] until END_HEADERS
        self.send_window = 65535
        self.peer_initial_window = 65535
        self.max_frame = 16384
        self.unacked = 0
        self.paused: asyncio.Future | None = None
        self.out: list[bytes] = []  # frames of this loop turn, sent together at its end

    def _write(self, data: bytes) -> None:
        if not self.out:
            self.loop.call_soon(self._flush_out)
        self.out.append(data)

    def _flush_out(self) -> None:
        out, self.out = self.out, []
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out) if len(out) > 1 else out[0])

    def _close(self) -> None:
        self._flush_out()
        self.transport.close()

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        settings = struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, STREAM_WINDOW)
        transport.write(frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, (CONNECTION_WINDOW - 65535).to_bytes(4, "big")))
        if self.server.draining:
            self.goaway()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.out.clear()
        for stream in list(self.streams.values()):
            self._reset(stream)
        self.streams.clear()
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)

    def pause_writing(self) -> None:
        if self.paused is None:
            self.paused = self.loop.create_future()

    def resume_writing(self) -> None:
        paused, self.paused = self.paused, None
        if paused is not None and not paused.done():
            paused.set_result(None)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        if not self.preface:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    self._close()
                return
            if buffer[:len(PREFACE)] != PREFACE:
                self._close()
                return
            del buffer[:len(PREFACE)]
            self.preface = True
        at, size = 0, len(buffer)
        try:
            while size - at >= 9:
                length = int.from_bytes(buffer[at:at + 3], "big")
                if length > 16384 + (1 << 20):  # far past any frame size the filter allows
                    raise ConnectionError_(PROTOCOL_ERROR, "frame too large")
                if size - at - 9 < length:
                    break
                kind, flags = buffer[at + 3], buffer[at + 4]
                stream_id = int.from_bytes(buffer[at + 5:at + 9], "big") & 0x7FFFFFFF
                payload = bytes(buffer[at + 9:at + 9 + length])
                at += 9 + length
                self._frame(kind, flags, stream_id, payload)
        except ConnectionError_ as exc:
            log.warning("HTTP/2 connection closed: %s", exc)
            self.goaway(exc.code)
            self._close()
        finally:
            del buffer[:at]

    # -- frames in ---------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.header_block is not None and kind != CONTINUATION:
            raise ConnectionError_(PROTOCOL_ERROR, "expected CONTINUATION")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            if stream_id == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on stream 0")
            payload = self._unpad(flags, payload)
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            self.header_block = [stream_id, flags, bytearray(payload)]
            if flags & END_HEADERS:
                self._headers()
        elif kind == CONTINUATION:
            if self.header_block is None or self.header_block[0] != stream_id:
                raise ConnectionError_(PROTOCOL_ERROR, "unexpected CONTINUATION")
            self.header_block[2] += payload
            if len(self.header_block[2]) > 256 << 10:
                raise ConnectionError_(PROTOCOL_ERROR, "header block too large")
            if flags & END_HEADERS:
                self._headers()
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == PING:
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            stream = self.streams.pop(stream_id, None)
            if stream is not None:
                self._reset(stream)
        elif kind == PUSH_PROMISE:
            raise ConnectionError_(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # GOAWAY (the peer opens no more streams here; the open ones go on), PRIORITY and unknown
        # frame types need nothing.

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ConnectionError_(PROTOCOL_ERROR, "bad padding")
        return payload[1:len(payload) - payload[0]]

    def _headers(self) -> None:
        stream_id, flags, block = self.header_block
        self.header_block = None
        try:
            headers = self.decoder.decode(bytes(block), raw=False)
        except (HPACKError, UnicodeDecodeError) as exc:
            raise ConnectionError_(COMPRESSION_ERROR, f"HPACK: {exc}") from None
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client: only the end of its stream counts
            if flags & END_STREAM:
                self._end_of_input(stream)
            return
        if stream_id <= self.last_stream or stream_id % 2 == 0:
            return  # a stream already over (reset, or answered before it was done)
        self.last_stream = stream_id
        if self.server.draining:
            self._write(frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big")))
            return
        path = next((v for k, v in headers if k == ":path"), "")
        method = self.server.methods.get(path)
        if method is None or any(k == "grpc-encoding" and v != "identity" for k, v in headers):
            self._trailers_only(stream_id, UNIMPLEMENTED, f"unknown method {path}" if method is None else "compressed")
            return
        stream = Stream(stream_id, method[0], self.peer_initial_window)
        self.streams[stream_id] = stream
        stream.task = self.loop.create_task(self._run(stream, method[1]))
        if flags & END_STREAM:
            self._end_of_input(stream)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        self.unacked += len(payload)
        if self.unacked >= CONNECTION_WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, 0, self.unacked.to_bytes(4, "big")))
            self.unacked = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            return
        stream.unacked += len(payload)
        if stream.unacked >= STREAM_WINDOW // 2 and not flags & END_STREAM:
            self._write(frame(WINDOW_UPDATE, 0, stream_id, stream.unacked.to_bytes(4, "big")))
            stream.unacked = 0
        payload = self._unpad(flags, payload)
        if payload:
            buffer = stream.buffer
            buffer += payload
            while len(buffer) >= 5:
                length = int.from_bytes(buffer[1:5], "big")
                if length > self.server.max_message:
                    self._abort(stream, RESOURCE_EXHAUSTED, f"message larger than {self.server.max_message} bytes")
                    return
                if len(buffer) < 5 + length:
                    break
                if buffer[0]:
                    self._abort(stream, UNIMPLEMENTED, "compressed message")
                    return
                message = bytes(buffer[5:5 + length])
                del buffer[:5 + length]
                self._deliver(stream, message)
        if flags & END_STREAM:
            self._end_of_input(stream)

    def _settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise ConnectionError_(PROTOCOL_ERROR, "bad SETTINGS")
        for i in range(0, len(payload), 6):
            ident, value = struct.unpack(">HI", payload[i:i + 6])
            if ident == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "window too large")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for stream in self.streams.values():
                    stream.window += delta
            elif ident == SETTINGS_MAX_FRAME_SIZE:
                if not 16384 <= value <= 16777215:
                    raise ConnectionError_(PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
                self.max_frame = value
        self._write(frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(PROTOCOL_ERROR, "bad WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "window overflow")
            self._flush_all()
        else:
            stream = self.streams.get(stream_id)
            if stream is not None:
                stream.window += increment
                self._flush(stream)

    # -- a stream's messages in ----------------------------------------------------------------
    def _deliver(self, stream: Stream, item: object) -> None:
        waiter = stream.waiter
        if waiter is not None and not stream.inbox:
            stream.waiter = None
            if not waiter.done():
                waiter.set_result(item)
                return
        stream.inbox.append(item)

    def _end_of_input(self, stream: Stream) -> None:
        if not stream.remote_closed:
            stream.remote_closed = True
            self._deliver(stream, EOF)

    def _reset(self, stream: Stream) -> None:
        """The peer reset the stream (or the connection went): its handler is cancelled, as grpc.aio does."""
        stream.ended = True
        stream.remote_closed = True
        stream.pending.clear()
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()

    async def _run(self, stream: Stream, handler: Handler) -> None:
        async def read() -> object:
            if stream.inbox:
                item = stream.inbox.popleft()
            else:
                if stream.waiter is not None:
                    raise RuntimeError("read() while another read() waits")
                stream.waiter = self.loop.create_future()
                item = await stream.waiter
            return item if item is EOF else stream.parse(item)

        async def write(message) -> None:
            if stream.ended:
                raise ConnectionResetError("the ext_proc stream is closed")
            self._send(stream, message.SerializeToString())
            if self.paused is not None:
                await asyncio.shield(self.paused)

        status, why = OK, ""
        try:
            await handler(read, write)
        except asyncio.CancelledError:
            if stream.ended:  # reset by the peer: nothing more to send
                return
            status, why = CANCELLED, "cancelled"
            raise
        except Status as exc:
            status, why = exc.code, str(exc)
        except Exception as exc:  # noqa: BLE001 - the handler's failure is the stream's status
            status, why = UNKNOWN, f"{type(exc).__name__}: {exc}"
        finally:
            if not stream.ended:
                self._finish(stream, status, why)

    # -- frames out ----------------------------------------------------------------------------
    def _response_headers(self, stream: Stream) -> bytes:
        stream.started = True
        block = self.encoder.encode(RESPONSE_HEADERS)
        return frame(HEADERS, END_HEADERS, stream.id, block)

    def _send(self, stream: Stream, message: bytes) -> None:
        head = b"" if stream.started else self._response_headers(stream)
        data = b"\x00" + len(message).to_bytes(4, "big") + message
        size = len(data)
        if not stream.pending and size <= stream.window and size <= self.send_window and size <= self.max_frame:
            stream.window -= size
            self.send_window -= size
            self._write(head + frame(DATA, 0, stream.id, data))
            return
        if head:
            self._write(head)
        stream.pending += data
        self._flush(stream)

    def _flush(self, stream: Stream) -> None:
        """Send what a stream has waiting, as far as the windows allow; then its trailers if due."""
        pending = stream.pending
        while pending:
            size = min(len(pending), stream.window, self.send_window, self.max_frame)
            if size <= 0:
                break
            self._write(frame(DATA, 0, stream.id, bytes(pending[:size])))  # the turn's one send joins them
            del pending[:size]
            stream.window -= size
            self.send_window -= size
        if not pending and stream.trailers is not None and stream.id in self.streams:
            self._write_trailers(stream)

    def _flush_all(self) -> None:
        for stream in list(self.streams.values()):
            if stream.pending:
                self._flush(stream)

    def _trailers_only(self, stream_id: int, status: int, why: str) -> None:
        block = self.encoder.encode([*RESPONSE_HEADERS, ("grpc-status", str(status)), ("grpc-message", _percent(why))])
        self._write(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block))

    def _finish(self, stream: Stream, status: int, why: str) -> None:
        """The handler is done: its trailers, after whatever DATA still waits for a window."""
        stream.ended = True
        stream.trailers = (status, why)
        if not stream.pending:
            self._write_trailers(stream)

    def _write_trailers(self, stream: Stream) -> None:
        status, why = stream.trailers
        self.streams.pop(stream.id, None)
        if self.transport.is_closing():
            return
        if not stream.started:
            self._trailers_only(stream.id, status, why)
        else:
            fields = [("grpc-status", str(status))] + ([("grpc-message", _percent(why))] if why else [])
            self._write(frame(HEADERS, END_HEADERS | END_STREAM, stream.id, self.encoder.encode(fields)))
        if not stream.remote_closed:  # answered before the peer was done: it may stop sending (RFC 9113 8.1)
            self._write(frame(RST_STREAM, 0, stream.id, NO_ERROR.to_bytes(4, "big")))

    def _abort(self, stream: Stream, status: int, why: str) -> None:
        """A stream the filter cannot go on with: its status to the peer, its handler cancelled."""
        stream.pending.clear()
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        self._finish(stream, status, why)

    def goaway(self, code: int = NO_ERROR) -> None:
        if self.transport is not None and not self.transport.is_closing():
            payload = self.last_stream.to_bytes(4, "big") + code.to_bytes(4, "big")
            self._write(frame(GOAWAY, 0, 0, payload))


class Server:
    """The listening socket, its connections, and the methods they serve."""

    def __init__(self, methods: Methods, max_message: int = 256 << 20) -> None:
        self.methods = methods
        self.max_message = max_message
        self.connections: set[Connection] = set()
        self.draining = False
        self._server: asyncio.base_events.Server | None = None
        self._stopped = asyncio.Event()

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self), host.strip("[]") or None, port,
                                                reuse_port=reuse_port, backlog=1024)

    def streams(self) -> int:
        return sum(len(c.streams) for c in self.connections)

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new connections and streams (GOAWAY), give the open streams ``grace`` seconds, then cut them."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.goaway()
        if grace:
            deadline = asyncio.get_running_loop().time() + grace
            while self.streams() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        tasks = []
        for connection in list(self.connections):
            for stream in list(connection.streams.values()):
                if stream.task is not None and not stream.task.done():
                    stream.task.cancel()
                    tasks.append(stream.task)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for connection in list(self.connections):
            connection._close()
        self._stopped.set()


def _percent(text: str) -> str:
    """grpc-message's percent-encoding."""
    return "".join(c if " " <= c <= "~" and c != "%" else "".join(f"%{b:02X}" for b in c.encode()) for c in text)
