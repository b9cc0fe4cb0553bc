"""The ext_proc server's bounds one by one, on a real ``http2.Server`` on loopback (its own event loop
in a thread, uvloop as in the filter) with small ``Limits`` and handlers that do what each test needs
(never read, read on demand, write a lot): the timeouts, the windows given back as messages are read,
the message budgets, resets, connections, backpressure on replies, and header blocks split at the
peer's frame size."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest
from h2peer import Peer
from stack import free_port, wait_for

from derender.extproc import http2
from derender.extproc.http2 import wire
from derender.extproc.http2.wire import (
    ACK, DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, PING, RST_STREAM, WINDOW_UPDATE, frame,
)
from derender.extproc.health import Http2Health

SMALL = http2.Limits(max_concurrent_streams=4, max_message=1024, max_buffered=4096, max_buffered_total=6144,
                     reset_burst=10, reset_rate=0.001, max_connections=3, preface_timeout=2.0, settings_timeout=2.0,
                     idle_timeout=30, keepalive_time=30, keepalive_timeout=30)


class Raw:
    """A message as bytes: what a handler gets, and what it writes."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf method's name
        return self.data


class Handlers:
    """The methods the test server serves; ``gate`` lets ``/t/on-demand`` read one message per release."""

    def __init__(self) -> None:
        self.gate: asyncio.Semaphore | None = None
        self.cancelled = 0
        self.read_count = 0
        self.hold = 0.0  # seconds a cancelled /t/stubborn handler keeps running

    async def never_reads(self, read, write) -> None:
        await asyncio.sleep(3600)

    async def on_demand(self, read, write) -> None:
        while True:
            await self.gate.acquire()
            message = await read()
            if message is http2.EOF:
                return
            self.read_count += 1
            await write(Raw(b"ok"))

    async def echo(self, read, write) -> None:
        while (message := await read()) is not http2.EOF:
            await write(message)

    async def big_replies(self, read, write) -> None:
        await read()
        for _ in range(1000):
            await write(Raw(bytes(256 << 10)))

    async def stubborn(self, read, write) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            await asyncio.shield(asyncio.sleep(self.hold))
            raise

    async def fails(self, read, write) -> None:
        await read()
        raise http2.Status(http2.UNKNOWN, "why " * 2000 + "100% \u00e9")


class Running:
    def __init__(self, limits: http2.Limits) -> None:
        self.port = free_port()
        self.handlers = Handlers()
        self.limits = limits
        self.server: http2.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.errors: list = []
        ready = threading.Event()

        def run() -> None:
            import uvloop

            self.loop = uvloop.new_event_loop()
            self.loop.set_exception_handler(lambda loop, context: self.errors.append(context))
            asyncio.set_event_loop(self.loop)
            h = self.handlers
            parse = lambda data: Raw(data)  # noqa: E731
            self.handlers.gate = asyncio.Semaphore(0)
            methods = {f"/t/{name}": (parse, getattr(h, name.replace("-", "_")))
                       for name in ("never-reads", "on-demand", "echo", "big-replies", "stubborn", "fails")}
            methods.update(Http2Health(("",)).methods())
            self.server = http2.Server(methods, limits)
            self.loop.run_until_complete(self.server.start("127.0.0.1", self.port))
            ready.set()
            self.loop.run_until_complete(self.server.wait_for_termination())

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(10)

    def call(self, fn):
        """``fn()`` on the server's loop; its result."""
        done = threading.Event()
        out = []
        self.loop.call_soon_threadsafe(lambda: (out.append(fn()), done.set()))
        done.wait(5)
        return out[0]

    def release(self, n: int = 1) -> None:
        self.call(lambda: [self.handlers.gate.release() for _ in range(n)])

    def peer(self, **kw) -> Peer:
        return Peer.connect(self.port, **kw)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.thread.join(10)


@pytest.fixture()
def server(request):
    limits = getattr(request, "param", SMALL)
    s = Running(limits)
    yield s
    s.stop()
    assert not s.errors, s.errors


def with_limits(**changes):
    return pytest.mark.parametrize("server", [replace(SMALL, **changes)], indirect=True)


def stream(peer: Peer, path: str, end: bool = False) -> int:
    sid = peer.stream_id()
    peer.send(peer.headers(sid, path, end_stream=end))
    return sid


# -- timeouts ----------------------------------------------------------------------------------
def test_a_connection_that_sends_nothing_is_closed_after_the_preface_timeout(server):
    with Peer(server.port, preface=False) as peer:
        assert peer.wait_closed(5)
        assert peer.goaway() is not None and peer.goaway().error == "PROTOCOL_ERROR"
    with Peer(server.port, preface=False) as peer:
        peer.send(wire.PREFACE)  # the magic only: no SETTINGS
        assert peer.wait_closed(5)
    assert server.server.defences["preface_timeout"] == 2


def test_settings_never_acknowledged_close_the_connection(server):
    with Peer(server.port) as peer:  # the preface sent; the server's SETTINGS never acknowledged
        assert peer.wait_closed(5)
        assert peer.goaway().error == "SETTINGS_TIMEOUT"
    assert server.server.defences["settings_timeout"] == 1


@with_limits(idle_timeout=1.0)
def test_an_idle_connection_is_closed_gracefully_and_a_stream_in_flight_is_served(server):
    with server.peer() as peer:
        first = peer.frames(5, until=lambda f: f.kind == GOAWAY)[-1]
        assert first.kind == GOAWAY and first.error == "NO_ERROR"
        assert int.from_bytes(first.payload[:4], "big") == wire.LAST_STREAM  # "no more streams, soon"
        ping = peer.frames(2, until=lambda f: f.kind == PING and not f.flags & ACK)[-1]
        sid = peer.stream_id()  # sent before the peer saw the GOAWAY: still served (RFC 9113 6.8)
        peer.send(peer.headers(sid, "/t/echo"), peer.message(sid, b"late"), frame(PING, ACK, 0, ping.payload))
        seen = peer.frames(5)
        assert peer.closed
        final = [f for f in seen if f.kind == GOAWAY]
        assert final and int.from_bytes(final[-1].payload[:4], "big") == sid
        assert any(f.kind == DATA and f.stream == sid and f.payload.endswith(b"late") for f in seen)
    assert server.server.defences["idle_timeout"] == 1


@with_limits(keepalive_time=1.0, keepalive_timeout=1.5)
def test_a_silent_peer_is_pinged_then_closed_and_one_that_answers_stays(server):
    with server.peer() as silent, server.peer() as answering:
        stream(silent, "/t/never-reads")
        stream(answering, "/t/never-reads")
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:  # the answering peer answers PINGs, as Envoy does
            for f in answering.frames(0.1):
                if f.kind == PING and not f.flags & ACK:
                    answering.send(frame(PING, ACK, 0, f.payload))
        assert silent.wait_closed(2) or silent.closed
        assert any(f.kind == PING and f.payload == b"derender" for f in silent.received)
        assert answering.alive()
    assert server.server.defences["keepalive_timeout"] >= 1


# -- windows and budgets -------------------------------------------------------------------------
def test_windows_come_back_as_messages_are_read_not_as_they_arrive(server):
    stream_window = SMALL.stream_window  # 2 x (1024 + 5)
    with server.peer() as peer:
        sid = stream(peer, "/t/on-demand")
        message = peer.message(sid, bytes(1000), end_stream=False)
        peer.send(message)
        assert not [f for f in peer.frames(0.5) if f.kind == WINDOW_UPDATE and f.stream == sid]
        peer.send(message)  # 2 x 1005 bytes held: the stream's window is nearly spent
        assert server.call(lambda: server.server.reserved) == 2 * (1000 + 64)
        peer.send(message)  # past the window: the peer broke flow control
        seen = peer.frames(2, until=lambda f: f.kind == RST_STREAM)
        assert seen and seen[-1].error == "FLOW_CONTROL_ERROR"
        assert server.call(lambda: server.server.reserved) == 0  # a reset stream's messages are let go
    with server.peer() as peer:
        sid = stream(peer, "/t/on-demand")
        for _ in range(2):
            peer.send(peer.message(sid, bytes(1000), end_stream=False))
        server.release(2)  # the handler reads both: 2010 bytes read, past half the window
        seen = peer.frames(3, until=lambda f: f.kind == WINDOW_UPDATE and f.stream == sid)
        assert seen and int.from_bytes(seen[-1].payload, "big") == 2010 >= stream_window // 2
        assert server.call(lambda: server.server.reserved) == 0


def test_message_bytes_held_past_the_budgets_are_refused(server):
    with server.peer() as one, server.peer() as two:
        held = []
        for _ in range(3):  # 3 x (1000 + 64) of the connection's 4096
            sid = stream(one, "/t/on-demand")
            one.send(one.message(sid, bytes(1000), end_stream=False))
            held.append(sid)
        sid = stream(one, "/t/on-demand")
        one.send(one.message(sid, bytes(1000), end_stream=False))
        seen = one.frames(3, until=lambda f: f.kind == HEADERS and f.stream == sid and f.flags & END_STREAM)
        assert seen and seen[-1].field("grpc-status") == "8"  # RESOURCE_EXHAUSTED
        for sid in [stream(two, "/t/on-demand") for _ in range(3)]:  # the third past the worker's 6144
            two.send(two.message(sid, bytes(1000), end_stream=False))
        seen = two.frames(3, until=lambda f: f.kind == HEADERS and f.flags & END_STREAM)
        assert seen and seen[-1].field("grpc-status") == "8"
        server.release(20)  # the handlers read what they hold: the budget comes back
        wait_for(lambda: server.call(lambda: server.server.reserved) == 0, "budget back", 5)
        sid = stream(one, "/t/on-demand")
        one.send(one.message(sid, bytes(1000), end_stream=False))
        assert one.frames(3, until=lambda f: f.kind == DATA and f.stream == sid)[-1].kind == DATA
    assert server.server.defences["buffer_full"] == 2


def test_a_message_longer_than_the_limit_is_refused_before_it_is_kept(server):
    with server.peer() as peer:
        sid = stream(peer, "/t/echo")
        peer.send(frame(DATA, 0, sid, b"\x00" + (1025).to_bytes(4, "big") + bytes(100)))
        seen = peer.frames(3, until=lambda f: f.kind == HEADERS and f.flags & END_STREAM)
        assert seen[-1].field("grpc-status") == "8" and "1024" in seen[-1].field("grpc-message")
        assert any(f.kind == RST_STREAM and f.stream == sid for f in peer.frames(1))  # the peer may stop sending
        assert server.call(lambda: server.server.reserved) == 0
        peer.send(frame(DATA, 0, sid, bytes(1000)))  # what was in flight is dropped, the connection goes on
        assert peer.alive()


# -- replies wait for the peer's window ----------------------------------------------------------
def test_a_write_waits_while_the_peers_window_holds_its_last_reply(server):
    with server.peer(settings=b"\x00\x04\x00\x00\x00\x00") as peer:  # SETTINGS_INITIAL_WINDOW_SIZE 0
        sid = stream(peer, "/t/big-replies")
        peer.send(peer.message(sid, b"go", end_stream=False))
        time.sleep(0.5)
        pending = server.call(lambda: [len(s.pending) for c in server.server.connections for s in c.streams.values()])
        assert pending == [(256 << 10) + 5]  # one reply waits; the handler waits with it
        peer.send(frame(WINDOW_UPDATE, 0, sid, (300 << 10).to_bytes(4, "big")),
                  frame(WINDOW_UPDATE, 0, 0, (300 << 10).to_bytes(4, "big")))
        got = sum(len(f.payload) for f in peer.frames(1) if f.kind == DATA)
        assert got == 300 << 10  # exactly the window: the rest waits again
        pending = server.call(lambda: [len(s.pending) for c in server.server.connections for s in c.streams.values()])
        assert pending and pending[0] <= (256 << 10) + 5


@with_limits(keepalive_time=0.6, keepalive_timeout=0.6)
def test_a_peer_that_stops_reading_is_not_read_either_and_is_closed(server):
    with server.peer(rcvbuf=4096) as peer:
        sid = stream(peer, "/t/big-replies")
        peer.send(peer.message(sid, b"go", end_stream=False),
                  frame(WINDOW_UPDATE, 0, sid, (1 << 30).to_bytes(4, "big")),
                  frame(WINDOW_UPDATE, 0, 0, (1 << 30).to_bytes(4, "big")))
        wait_for(lambda: server.call(lambda: [c.paused is not None for c in server.server.connections]) == [True],
                 "writes paused", 5)
        sent = 0
        while sent < 4 << 20 and peer.try_send(frame(PING, 0, 0, bytes(8)) * 1000):  # never reading the ACKs
            sent += 17000
        wait_for(lambda: not server.call(lambda: len(server.server.connections)), "the connection closed", 10)
    assert server.server.defences["read_paused"] >= 1
    assert server.server.defences["keepalive_timeout"] + server.server.defences["control_flood"] >= 1


# -- resets and streams -------------------------------------------------------------------------
@with_limits(max_concurrent_streams=100)
def test_rapid_reset_ends_the_connection_but_resets_after_an_answer_do_not_count(server):
    with server.peer() as peer:  # Envoy's way: a stream reset after its answer, many times
        for _ in range(30):
            sid = stream(peer, "/t/echo")
            peer.send(peer.message(sid, b"x", end_stream=False))
            assert peer.frames(2, until=lambda f: f.kind == DATA and f.stream == sid)[-1].kind == DATA
            peer.send(frame(RST_STREAM, 0, sid, wire.CANCEL.to_bytes(4, "big")))
        assert peer.alive()
    with server.peer() as peer:  # HEADERS and RST_STREAM, before any answer
        pairs = b""
        for _ in range(50):
            sid = peer.stream_id()
            pairs += peer.headers(sid, "/t/never-reads") + frame(RST_STREAM, 0, sid, wire.CANCEL.to_bytes(4, "big"))
        peer.send(pairs)
        assert peer.wait_closed(3)
        assert peer.goaway().error == "ENHANCE_YOUR_CALM"
    assert server.server.defences["rapid_reset"] == 1


@with_limits(max_concurrent_streams=100)
def test_resets_the_server_is_made_to_send_count_too(server):
    with server.peer() as peer:  # MadeYouReset: WINDOW_UPDATE of 0 makes the server reset each stream
        frames_ = b""
        for _ in range(50):
            sid = peer.stream_id()
            frames_ += peer.headers(sid, "/t/never-reads") + frame(WINDOW_UPDATE, 0, sid, bytes(4))
        peer.send(frames_)
        assert peer.wait_closed(3)
        assert peer.goaway().error == "ENHANCE_YOUR_CALM"
        assert sum(1 for f in peer.received if f.kind == RST_STREAM and f.error == "PROTOCOL_ERROR") == 10


def test_handlers_still_ending_after_a_reset_count_against_the_stream_limit(server):
    server.handlers.hold = 1.0
    with server.peer() as peer:
        sids = [stream(peer, "/t/stubborn") for _ in range(4)]
        time.sleep(0.2)
        sid = stream(peer, "/t/echo")
        seen = peer.frames(1, until=lambda f: f.kind == RST_STREAM)
        assert seen and seen[-1].stream == sid and seen[-1].error == "REFUSED_STREAM"  # 4 streams open
        for s in sids:
            peer.send(frame(RST_STREAM, 0, s, wire.CANCEL.to_bytes(4, "big")))
        sid = stream(peer, "/t/echo")  # their handlers still run (1 s): still refused
        seen = peer.frames(0.5, until=lambda f: f.kind == RST_STREAM)
        assert seen and seen[-1].stream == sid and seen[-1].error == "REFUSED_STREAM"
        time.sleep(1.2)
        sid = stream(peer, "/t/echo")
        peer.send(peer.message(sid, b"now"))
        assert any(f.kind == DATA and f.stream == sid for f in peer.frames(2, until=lambda f: f.kind == DATA))
    assert server.handlers.cancelled == 4


def test_connections_past_the_limit_are_closed_at_once(server):
    peers = [server.peer() for _ in range(3)]
    with Peer(server.port) as extra:
        assert extra.wait_closed(3)
        assert extra.goaway().error == "ENHANCE_YOUR_CALM"
    assert all(p.alive() for p in peers)
    for p in peers:
        p.close()
    assert server.server.defences["max_connections"] == 1


# -- what the server sends ------------------------------------------------------------------------
def test_header_blocks_are_split_at_the_peers_frame_size():
    from derender.extproc.http2.headers import Codec
    from hpack import Decoder

    codec = Codec(64 << 10)
    fields = [("grpc-status", "2"), ("x-long", "v" * 40000)]
    data = codec.frames(7, fields, END_STREAM, 16384)
    frames_, at = [], 0
    while at < len(data):
        length = int.from_bytes(data[at:at + 3], "big")
        frames_.append((data[at + 3], data[at + 4], data[at + 9:at + 9 + length]))
        at += 9 + length
    assert [k for k, _, _ in frames_] == [HEADERS] + [wire.CONTINUATION] * (len(frames_) - 1) and len(frames_) >= 2
    assert all(len(p) <= 16384 for _, _, p in frames_)
    assert frames_[0][1] == END_STREAM and frames_[-1][1] == END_HEADERS
    assert Decoder().decode(b"".join(p for _, _, p in frames_)) == fields


def test_a_status_message_is_bounded_and_percent_encoded(server):
    with server.peer() as peer:
        sid = stream(peer, "/t/fails")
        peer.send(peer.message(sid, b"x"))
        seen = peer.frames(3, until=lambda f: f.kind == HEADERS and f.flags & END_STREAM)
        message = seen[-1].field("grpc-message")
        assert len(message) <= SMALL.max_status_message and message.endswith("...")
    assert wire.percent("100% \u00e9 \n") == "100%25 %C3%A9 %0A"


def test_a_health_check_through_the_test_server(server):
    with server.peer() as peer:
        assert peer.serving()


@pytest.mark.parametrize("flags, message", [
    ([], 17 << 20),  # Envoy's 16 MiB body buffer, plus the message's framing
    (["--max-producer-body-bytes", str(32 << 20)], 33 << 20),  # derender up then gives Envoy 32 MiB
    (["--max-message-bytes", str(1 << 20)], 1 << 20),
])
def test_the_message_limit_follows_envoys_body_buffer(flags, message):
    from derender.cli import build_parser
    from derender.extproc.listen import listener

    limits = listener(build_parser().parse_args(["serve", *flags])).limits
    assert limits.max_message == message
    assert limits.max_buffered >= message + 5 and limits.max_buffered_total >= limits.max_buffered
    assert limits.stream_window >= 2 * (message + 5) or limits.stream_window == wire.MAX_WINDOW


def test_a_streams_metadata_is_handed_up_as_its_fields_are():
    """The transport names no header but its own: the request's other fields go up to the handler as
    gRPC's custom metadata (the tracing stage reads ``traceparent`` there), pseudo-headers,
    content-length and te left out."""
    from derender.extproc.http2.headers import request

    asked = request(
        [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
            (b"te", b"trailers"),
            (b"content-type", b"application/grpc"),
            (b"content-length", b"0"),
            (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            (b"x-custom", b"\xe9t\xe9"),
        ]
    )
    assert asked.path == "/envoy.service.ext_proc.v3.ExternalProcessor/Process" and asked.content_length == 0
    assert asked.metadata == {
        "content-type": "application/grpc",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "x-custom": "\xe9t\xe9",
    }
