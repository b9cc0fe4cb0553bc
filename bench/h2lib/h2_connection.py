"""The ext_proc server's connection on python-hyper's ``h2`` state machine instead of the filter's own
frame layer, for ``bench/h2_frame_layer.py``: the same ``Server``, handlers, limits and gRPC framing
(a message's length judged first, the windows given back as handlers read), with the frames parsed,
checked and written by ``h2``. Loaded into a filter by this folder's ``sitecustomize.py``.
"""

from __future__ import annotations

import asyncio
from collections import deque

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from grpc.aio import EOF

from derender.extproc.http2 import wire
from derender.extproc.http2.handlers import serve_handler

RESPONSE_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]


class Stream:
    __slots__ = ("id", "parse", "buffer", "inbox", "waiter", "task", "pending", "started", "ended", "remote_closed",
                 "trailers", "drained")

    def __init__(self, stream_id: int, parse) -> None:
        self.id = stream_id
        self.parse = parse
        self.buffer = bytearray()
        self.inbox: deque = deque()
        self.waiter: asyncio.Future | None = None
        self.task: asyncio.Task | None = None
        self.pending = bytearray()
        self.started = self.ended = self.remote_closed = False
        self.trailers: tuple[int, str] | None = None
        self.drained: asyncio.Future | None = None


def writer(connection, stream):
    """A stream's ``write(message)``: the reply goes out as far as the windows allow; while the peer's
    window holds it back, or the socket's writes are paused, the handler waits."""

    async def write(message) -> None:
        if stream.ended:
            raise ConnectionResetError("the ext_proc stream is closed")
        connection._send(stream, message.SerializeToString())
        if stream.pending:
            stream.drained = drained = connection.loop.create_future()
            await drained
        if connection.paused is not None:
            await asyncio.shield(connection.paused)

    return write


class H2Connection(asyncio.Protocol):
    """Runs where ``http2.Connection`` does: ``Server`` asks it the same (``calls``, ``machine.streams``,
    ``drain``, ``close``, ``tick``)."""

    def __init__(self, server) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self.h2 = h2.connection.H2Connection(config=config)
        self.streams: dict[int, Stream] = {}
        self.transport: asyncio.Transport | None = None
        self.paused: asyncio.Future | None = None
        self.scheduled = False
        self.machine = self  # what the server counts: ``machine.streams``
        self.calls = self.streams  # what the server cancels when it stops: their ``task``

    def pause_writing(self) -> None:
        if self.paused is None:
            self.paused = self.loop.create_future()
            if self.transport is not None:
                self.transport.pause_reading()

    def resume_writing(self) -> None:
        paused, self.paused = self.paused, None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
        if paused is not None and not paused.done():
            paused.set_result(None)

    # -- writing: what h2 has to send leaves once per loop turn ---------------------------------
    def _flush_soon(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._flush_out)

    def _flush_out(self) -> None:
        self.scheduled = False
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        limits = self.limits
        self.h2.update_settings({
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: limits.stream_window,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list,
        })
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(limits.connection_window - 65535)
        transport.write(self.h2.data_to_send())

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        for stream in list(self.streams.values()):
            self._cancel(stream)
        self.streams.clear()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            self._flush_out()
            self.transport.close()
            return
        for event in events:
            kind = type(event)
            if kind is h2.events.DataReceived:
                self._data(event)
            elif kind is h2.events.RequestReceived:
                self._request(event)
            elif kind is h2.events.StreamEnded:
                stream = self.streams.get(event.stream_id)
                if stream is not None:
                    stream.remote_closed = True
                    self._deliver(stream, EOF)
            elif kind is h2.events.StreamReset:
                stream = self.streams.pop(event.stream_id, None)
                if stream is not None:
                    self._cancel(stream)
            elif kind in (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged):
                for stream in list(self.streams.values()):
                    if stream.pending:
                        self._flush(stream)
            elif kind is h2.events.ConnectionTerminated:
                self.transport.close()
        self._flush_soon()

    # -- a stream's messages in ----------------------------------------------------------------
    def _request(self, event) -> None:
        path = next((v for k, v in event.headers if k == b":path"), b"").decode("latin-1")
        method = self.server.methods.get(path)
        if method is None:
            self._trailers_only(event.stream_id, wire.UNIMPLEMENTED, f"unknown method {path[:200]}")
            return
        stream = Stream(event.stream_id, method[0])
        self.streams[event.stream_id] = stream
        stream.task = self.loop.create_task(self._run(stream, method[1]))

    def _data(self, event) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is None:
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            return
        data = event.data
        buffer = stream.buffer
        if not buffer and len(data) >= 5 and len(data) == int.from_bytes(data[1:5], "big") + 5:
            if len(data) - 5 > self.limits.max_message:
                self._abort(stream, wire.RESOURCE_EXHAUSTED, "message too large")
                return
            waiter = stream.waiter
            if waiter is not None and not stream.inbox and not waiter.done():
                stream.waiter = None
                waiter.set_result(data[5:])
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            else:
                stream.inbox.append((data[5:], event.flow_controlled_length))
            return
        buffer += data
        while len(buffer) >= 5:
            length = int.from_bytes(buffer[1:5], "big")
            if length > self.limits.max_message:
                self._abort(stream, wire.RESOURCE_EXHAUSTED, "message too large")
                return
            if len(buffer) < length + 5:
                break
            message = bytes(buffer[5:length + 5])
            del buffer[:length + 5]
            stream.inbox.append((message, length + 5))
        self._deliver(stream, None)

    def _deliver(self, stream: Stream, item) -> None:
        if item is EOF:
            stream.inbox.append((EOF, 0))
        waiter = stream.waiter
        if waiter is not None and stream.inbox and not waiter.done():
            stream.waiter = None
            message, size = stream.inbox.popleft()
            if size:
                self.h2.acknowledge_received_data(size, stream.id)
            waiter.set_result(message)

    def _cancel(self, stream: Stream) -> None:
        stream.ended = True
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        if stream.drained is not None and not stream.drained.done():
            stream.drained.set_result(None)

    async def _run(self, stream: Stream, handler) -> None:
        async def read():
            if stream.inbox:
                item, size = stream.inbox.popleft()
                if size and not stream.ended:
                    self.h2.acknowledge_received_data(size, stream.id)
                    self._flush_soon()
            else:
                stream.waiter = self.loop.create_future()
                item = await stream.waiter
            return item if item is EOF else stream.parse(item)

        await serve_handler(handler, read, writer(self, stream), stream, self._finish)

    def _finish(self, stream: Stream, status: int, why: str) -> None:
        stream.ended = True
        stream.trailers = (status, why)
        if not stream.pending:
            self._write_trailers(stream)

    # -- frames out ----------------------------------------------------------------------------
    def _send(self, stream: Stream, message: bytes) -> None:
        if not stream.started:
            stream.started = True
            self.h2.send_headers(stream.id, RESPONSE_HEADERS)
        stream.pending += b"\x00" + len(message).to_bytes(4, "big") + message
        self._flush(stream)

    def _flush(self, stream: Stream) -> None:
        pending = stream.pending
        while pending:
            size = min(len(pending), self.h2.local_flow_control_window(stream.id), self.h2.max_outbound_frame_size)
            if size <= 0:
                return
            self.h2.send_data(stream.id, bytes(pending[:size]))
            del pending[:size]
        self._flush_soon()
        if stream.drained is not None and not stream.drained.done():
            stream.drained.set_result(None)
        if stream.trailers is not None and stream.id in self.streams:
            self._write_trailers(stream)

    def _trailers_only(self, stream_id: int, status: int, why: str) -> None:
        fields = [*RESPONSE_HEADERS, (b"grpc-status", str(status).encode()),
                  (b"grpc-message", wire.percent(why).encode())]
        self.h2.send_headers(stream_id, fields, end_stream=True)
        self._flush_soon()

    def _write_trailers(self, stream: Stream) -> None:
        status, why = stream.trailers
        self.streams.pop(stream.id, None)
        if self.transport.is_closing():
            return
        try:
            if not stream.started:
                self._trailers_only(stream.id, status, why)
            else:
                fields = [(b"grpc-status", str(status).encode())]
                if why:
                    fields.append((b"grpc-message", wire.percent(why).encode()))
                self.h2.send_headers(stream.id, fields, end_stream=True)
            if not stream.remote_closed:
                self.h2.reset_stream(stream.id, h2.errors.ErrorCodes.NO_ERROR)
        except h2.exceptions.StreamClosedError:
            pass
        self._flush_soon()

    def _abort(self, stream: Stream, status: int, why: str) -> None:
        stream.pending.clear()
        if stream.task is not None and not stream.task.done():
            stream.task.cancel()
        stream.ended = True
        stream.trailers = (status, why)
        self._write_trailers(stream)

    def goaway(self, code: int = 0) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.h2.close_connection(code)
            self._flush_out()

    def _close(self) -> None:
        self._flush_out()
        if self.transport is not None:
            self.transport.close()

    def tick(self, now: float) -> None:
        pass

    def drain(self) -> None:
        self.goaway()

    def close(self) -> None:
        self._close()
