"""The ext_proc server's bounds one by one, with small ``Limits``. Most are the protocol's own and are
tested on its state machine directly (``h2direct.Direct``: a ``Machine`` in memory on a clock the test
moves, the test playing the handlers through the machine's calls): the timeouts, the windows given back
as messages are read, the message budgets, resets, replies waiting for the peer's window, header blocks
split at the peer's frame size. What only a socket shows (paused reads, refused connections, a health
check end to end) runs on a real ``http2.Server`` on loopback, on the test's own event loop."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from dataclasses import replace
from pathlib import Path

import pytest
import uvloop
from h2direct import Direct, Socket
from h2peer import HEALTH, grpc_message

from derender.extproc import http2, listen
from derender.extproc.health import Http2Health
from derender.extproc.http2 import events, wire
from derender.extproc.http2.wire import (
    ACK, DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, PING, RST_STREAM, WINDOW_UPDATE, frame,
)

SMALL = http2.Limits(max_concurrent_streams=4, max_message=1024, max_buffered=4096, max_buffered_total=6144,
                     reset_burst=10, reset_rate=0.001, max_connections=3, preface_timeout=2.0, settings_timeout=2.0,
                     idle_timeout=30, keepalive_time=30, keepalive_timeout=30)
PATHS = ("/t/echo", "/t/on-demand", "/t/big-replies")


def stream(peer, path: str, end: bool = False) -> int:
    sid = peer.stream_id()
    peer.send(peer.headers(sid, path, end_stream=end))
    return sid


def drain(peer: Direct, sid: int) -> list:
    """What a handler reads of ``sid`` until nothing waits."""
    got = []
    while (item := peer.call(peer.machine.read, sid)) is not None:
        got.append(item)
    peer.machine.stop_reading(sid)
    return got


# -- timeouts ----------------------------------------------------------------------------------
def test_a_connection_that_sends_nothing_is_closed_after_the_preface_timeout():
    peer = Direct(SMALL, preface=False)
    peer.tick(1.9)
    assert not peer.closing
    peer.tick(0.2)
    assert peer.wait_closed(0) and peer.goaway().error == "PROTOCOL_ERROR"
    assert peer.defences()["preface_timeout"] == 1
    peer = Direct(SMALL, preface=False)
    peer.send(wire.PREFACE)  # the magic only: no SETTINGS
    peer.tick(2.1)
    assert peer.wait_closed(0) and peer.defences()["preface_timeout"] == 1


def test_settings_never_acknowledged_close_the_connection():
    peer = Direct(SMALL, handshake=False)  # the preface sent; the server's SETTINGS never acknowledged
    peer.tick(2.1)
    assert peer.wait_closed(0) and peer.goaway().error == "SETTINGS_TIMEOUT"
    assert peer.defences()["settings_timeout"] == 1
    peer = Direct(SMALL)  # acknowledged: it stays
    peer.tick(2.1)
    assert peer.alive(0) and not peer.defences()


def test_an_idle_connection_is_closed_gracefully_and_a_stream_in_flight_is_served():
    peer = Direct(replace(SMALL, idle_timeout=1.0), paths=PATHS)
    peer.tick(0.9)
    assert not peer.frames(0)
    peer.tick(0.2)
    seen = peer.frames(0)
    first = next(f for f in seen if f.kind == GOAWAY)
    assert first.error == "NO_ERROR" and int.from_bytes(first.payload[:4], "big") == wire.LAST_STREAM  # "soon"
    ping = next(f for f in seen if f.kind == PING and not f.flags & ACK)
    sid = peer.stream_id()  # sent before the peer saw the GOAWAY: still served (RFC 9113 6.8)
    peer.send(peer.headers(sid, "/t/echo"), peer.message(sid, b"late"), frame(PING, ACK, 0, ping.payload))
    final = [f for f in peer.frames(0) if f.kind == GOAWAY]
    assert final and int.from_bytes(final[-1].payload[:4], "big") == sid and not peer.closing
    assert drain(peer, sid) == [b"late", http2.EOF]
    peer.call(peer.machine.send, sid, b"late")
    peer.call(peer.machine.finish, sid, 0, "")
    seen = peer.frames(0)
    assert any(f.kind == DATA and f.stream == sid and f.payload.endswith(b"late") for f in seen)
    assert peer.wait_closed(0)  # its last stream done: the connection closes
    assert peer.defences()["idle_timeout"] == 1


def test_a_silent_peer_is_pinged_then_closed_and_one_that_answers_stays():
    limits = replace(SMALL, keepalive_time=1.0, keepalive_timeout=1.5)
    silent, answering = Direct(limits, paths=PATHS), Direct(limits, paths=PATHS)
    stream(silent, "/t/on-demand")
    stream(answering, "/t/on-demand")
    for _ in range(8):  # 4 s in half seconds; the answering peer answers PINGs, as Envoy does
        for peer in (silent, answering):
            peer.tick(0.5)
        for f in answering.frames(0):
            if f.kind == PING and not f.flags & ACK:
                answering.send(frame(PING, ACK, 0, f.payload))
    assert silent.wait_closed(0)
    assert any(f.kind == PING and f.payload == b"derender" for f in silent.received)
    assert silent.defences()["keepalive_timeout"] == 1
    assert answering.alive(0) and not answering.closing
    assert any(f.kind == PING and f.payload == b"derender" for f in answering.received)


# -- windows and budgets -------------------------------------------------------------------------
def test_windows_come_back_as_messages_are_read_not_as_they_arrive():
    stream_window = SMALL.stream_window  # 2 x (1024 + 5)
    budget = http2.Budget(SMALL.max_buffered_total)
    peer = Direct(SMALL, budget, paths=PATHS)
    sid = stream(peer, "/t/on-demand")
    message = peer.message(sid, bytes(1000), end_stream=False)
    peer.send(message)
    assert not [f for f in peer.frames(0) if f.kind == WINDOW_UPDATE and f.stream == sid]
    peer.send(message)  # 2 x 1005 bytes held: the stream's window is nearly spent
    assert budget.reserved == 2 * (1000 + 64)
    peer.send(message)  # past the window: the peer broke flow control
    seen = peer.frames(0, until=lambda f: f.kind == RST_STREAM)
    assert seen and seen[-1].error == "FLOW_CONTROL_ERROR"
    assert budget.reserved == 0  # a reset stream's messages are let go
    assert peer.seen(events.Ended)[-1].stream_id == sid  # and its handler cancelled
    sid = stream(peer, "/t/on-demand")
    for _ in range(2):
        peer.send(peer.message(sid, bytes(1000), end_stream=False))
    assert drain(peer, sid) == [bytes(1000)] * 2  # the handler reads both: 2010 bytes, past half the window
    seen = peer.frames(0, until=lambda f: f.kind == WINDOW_UPDATE and f.stream == sid)
    assert seen and int.from_bytes(seen[-1].payload, "big") == 2010 >= stream_window // 2
    assert budget.reserved == 0


def test_a_message_handed_to_a_waiting_handler_gives_its_window_back_at_once_and_one_it_stopped_waiting_for_waits():
    budget = http2.Budget(SMALL.max_buffered_total)
    peer = Direct(SMALL, budget, paths=PATHS)
    sid = stream(peer, "/t/on-demand")
    assert peer.call(peer.machine.read, sid) is None  # the handler waits
    peer.send(peer.message(sid, bytes(1000), end_stream=False))
    assert peer.handed(sid) == [bytes(1000)] and budget.reserved == 0  # straight to it, nothing held
    assert peer.call(peer.machine.read, sid) is None
    peer.machine.stop_reading(sid)  # its read was cancelled: the next message waits, reserved
    peer.send(peer.message(sid, bytes(500), end_stream=False))
    assert peer.handed(sid) == [bytes(1000)] and budget.reserved == 500 + 64
    assert peer.call(peer.machine.read, sid) == bytes(500) and budget.reserved == 0
    assert peer.call(peer.machine.read, sid) is None
    peer.send(peer.message(sid, b"late", end_stream=False))  # handed, but the read was cancelled meanwhile
    peer.call(peer.machine.unread, sid, peer.handed(sid)[-1])
    assert budget.reserved == 4 + 64 and peer.call(peer.machine.read, sid) == b"late"


def test_message_bytes_held_past_the_budgets_are_refused():
    budget = http2.Budget(SMALL.max_buffered_total)
    one, two = Direct(SMALL, budget, paths=PATHS), Direct(SMALL, budget, paths=PATHS)
    for _ in range(3):  # 3 x (1000 + 64) of the connection's 4096
        sid = stream(one, "/t/on-demand")
        one.send(one.message(sid, bytes(1000), end_stream=False))
    sid = stream(one, "/t/on-demand")  # the fourth: past the connection's budget
    one.send(one.message(sid, bytes(1000), end_stream=False))
    seen = one.frames(0, until=lambda f: f.kind == HEADERS and f.stream == sid and f.flags & END_STREAM)
    assert seen and seen[-1].field("grpc-status") == "8"  # RESOURCE_EXHAUSTED
    for sid in [stream(two, "/t/on-demand") for _ in range(3)]:  # the third past the worker's 6144
        two.send(two.message(sid, bytes(1000), end_stream=False))
    seen = two.frames(0, until=lambda f: f.kind == HEADERS and f.flags & END_STREAM)
    assert seen and seen[-1].field("grpc-status") == "8"
    for peer in (one, two):  # the refused streams' handlers end
        assert len(peer.seen(events.Ended)) == 1
        peer.call(peer.machine.handler_done)
    for peer in (one, two):  # the handlers read what they hold: the budget comes back
        for sid in list(peer.machine.streams):
            drain(peer, sid)
    assert budget.reserved == 0
    sid = stream(one, "/t/on-demand")
    one.send(one.message(sid, bytes(1000), end_stream=False))
    assert drain(one, sid) == [bytes(1000)]
    assert one.defences()["buffer_full"] == 1 and two.defences()["buffer_full"] == 1


def test_a_message_longer_than_the_limit_is_refused_before_it_is_kept():
    budget = http2.Budget(SMALL.max_buffered_total)
    peer = Direct(SMALL, budget)
    sid = stream(peer, "/t/echo")
    peer.send(frame(DATA, 0, sid, b"\x00" + (1025).to_bytes(4, "big") + bytes(100)))
    seen = peer.frames(0)
    status = [f for f in seen if f.kind == HEADERS and f.flags & END_STREAM]
    assert status[-1].field("grpc-status") == "8" and "1024" in status[-1].field("grpc-message")
    assert any(f.kind == RST_STREAM and f.stream == sid for f in seen)  # the peer may stop sending
    assert budget.reserved == 0 and peer.defences()["message_size"] == 1
    peer.send(frame(DATA, 0, sid, bytes(1000)))  # what was in flight is dropped, the connection goes on
    assert peer.alive(0)


# -- replies wait for the peer's window ----------------------------------------------------------
def test_a_write_waits_while_the_peers_window_holds_its_last_reply():
    peer = Direct(SMALL, paths=PATHS, settings=b"\x00\x04\x00\x00\x00\x00")  # SETTINGS_INITIAL_WINDOW_SIZE 0
    sid = stream(peer, "/t/big-replies")
    big = bytes(256 << 10)
    assert peer.call(peer.machine.send, sid, big) is False  # it waits: the handler waits with it
    assert [len(s.pending) for s in peer.machine.streams.values()] == [(256 << 10) + 5]
    assert not [f for f in peer.frames(0) if f.kind == DATA]
    peer.send(frame(WINDOW_UPDATE, 0, sid, (300 << 10).to_bytes(4, "big")),
              frame(WINDOW_UPDATE, 0, 0, (300 << 10).to_bytes(4, "big")))
    assert peer.seen(events.Drained) == [events.Drained(sid)]  # the handler writes its next reply
    assert peer.call(peer.machine.send, sid, big) is False
    got = sum(len(f.payload) for f in peer.frames(0) if f.kind == DATA)
    assert got == 300 << 10  # exactly the window: the rest waits again
    assert [len(s.pending) for s in peer.machine.streams.values()] == [2 * ((256 << 10) + 5) - (300 << 10)]


# -- resets and streams -------------------------------------------------------------------------
def test_rapid_reset_ends_the_connection_but_resets_after_an_answer_do_not_count():
    limits = replace(SMALL, max_concurrent_streams=100)
    peer = Direct(limits)  # Envoy's way: a stream reset after its answer, many times
    for _ in range(30):
        sid = stream(peer, "/t/echo")
        peer.send(peer.message(sid, b"x", end_stream=False))
        assert drain(peer, sid) == [b"x"]
        peer.call(peer.machine.send, sid, b"x")
        assert any(f.kind == DATA and f.stream == sid for f in peer.frames(0))
        peer.send(frame(RST_STREAM, 0, sid, wire.CANCEL.to_bytes(4, "big")))
        peer.call(peer.machine.handler_done)  # cancelled, it returns
    assert peer.alive(0)
    peer = Direct(limits)  # HEADERS and RST_STREAM, before any answer
    pairs = b""
    for _ in range(50):
        sid = peer.stream_id()
        pairs += peer.headers(sid, "/t/echo") + frame(RST_STREAM, 0, sid, wire.CANCEL.to_bytes(4, "big"))
    peer.send(pairs)
    assert peer.wait_closed(0) and peer.goaway().error == "ENHANCE_YOUR_CALM"
    assert peer.defences()["rapid_reset"] == 1


def test_resets_the_server_is_made_to_send_count_too():
    peer = Direct(replace(SMALL, max_concurrent_streams=100))
    frames_ = b""
    for _ in range(50):  # MadeYouReset: WINDOW_UPDATE of 0 makes the server reset each stream
        sid = peer.stream_id()
        frames_ += peer.headers(sid, "/t/echo") + frame(WINDOW_UPDATE, 0, sid, bytes(4))
    peer.send(frames_)
    assert peer.wait_closed(0) and peer.goaway().error == "ENHANCE_YOUR_CALM"
    assert sum(1 for f in peer.received if f.kind == RST_STREAM and f.error == "PROTOCOL_ERROR") == 10


def test_handlers_still_ending_after_a_reset_count_against_the_stream_limit():
    peer = Direct(SMALL)
    sids = [stream(peer, "/t/echo") for _ in range(4)]
    sid = stream(peer, "/t/echo")
    seen = peer.frames(0, until=lambda f: f.kind == RST_STREAM)
    assert seen and seen[-1].stream == sid and seen[-1].error == "REFUSED_STREAM"  # 4 streams open
    for s in sids:
        peer.send(frame(RST_STREAM, 0, s, wire.CANCEL.to_bytes(4, "big")))
    assert [e.stream_id for e in peer.seen(events.Ended)] == sids  # their handlers are cancelled...
    sid = stream(peer, "/t/echo")  # ...but still run: still refused
    seen = peer.frames(0, until=lambda f: f.kind == RST_STREAM)
    assert seen and seen[-1].stream == sid and seen[-1].error == "REFUSED_STREAM"
    for _ in sids:
        peer.call(peer.machine.handler_done)
    sid = stream(peer, "/t/echo")
    peer.send(peer.message(sid, b"now"))
    assert sid in peer.opened() and drain(peer, sid) == [b"now", http2.EOF]


# -- on a socket ------------------------------------------------------------------------------------
class Handlers:
    async def echo(self, read, write) -> None:
        while (message := await read()) is not http2.EOF:
            await write(message)

    async def big_replies(self, read, write) -> None:
        await read()
        for _ in range(1000):
            await write(Raw(bytes(256 << 10)))


class Raw:
    """A message as bytes: what a handler gets, and what it writes."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf method's name
        return self.data


def on_a_socket(limits: http2.Limits, test, unix: str | None = None) -> None:
    """``test(server, port)`` against an ``http2.Server`` on loopback, both on this thread's uvloop;
    nothing the loop reports as an error. With ``unix`` (a path), the server listens on a Unix socket
    there too (``serve --uds``) and ``test`` is given that path for ``port``."""

    async def main() -> None:
        errors: list = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        handlers = Handlers()
        methods = {"/t/echo": (Raw, handlers.echo), "/t/big-replies": (Raw, handlers.big_replies)}
        methods.update(Http2Health(("",)).methods())
        server = http2.Server(methods, limits)
        sock = listen.bind_unix(unix) if unix else None
        await server.start("127.0.0.1", 0, unix=sock)
        port = server._server.sockets[0].getsockname()[1]
        try:
            await test(server, unix or port)
        finally:
            await server.stop()
            if sock is not None:
                listen.unbind_unix(sock)
        assert not errors, errors

    uvloop.run(main())


async def until(condition, seconds: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.mark.parametrize("on", ["tcp", "unix"])
def test_a_peer_that_stops_reading_is_not_read_either_and_is_closed(on, tmp_path):
    async def test(server, port) -> None:
        peer = await Socket.connect(port, rcvbuf=4096)
        sid = peer.stream_id()
        # The server's SETTINGS acknowledged at once (unread, as a peer that stops reading later has
        # done): else the settings timeout could close it first on a busy machine, not what is tested.
        await peer.send(frame(wire.SETTINGS, ACK, 0),
                        peer.headers(sid, "/t/big-replies"), peer.message(sid, b"go", end_stream=False),
                        frame(WINDOW_UPDATE, 0, sid, (1 << 30).to_bytes(4, "big")),
                        frame(WINDOW_UPDATE, 0, 0, (1 << 30).to_bytes(4, "big")))
        assert await until(lambda: [c.paused is not None for c in server.connections] == [True], 5)
        sent = 0
        while sent < 4 << 20 and await peer.send(frame(PING, 0, 0, bytes(8)) * 1000, timeout=1.0):
            sent += 17000  # never reading the ACKs
        assert sent < 4 << 20  # the server stopped reading
        assert await until(lambda: not server.connections, 10)
        peer.close()
        assert server.defences["read_paused"] >= 1
        assert server.defences["keepalive_timeout"] + server.defences["control_flood"] >= 1

    on_a_socket(replace(SMALL, keepalive_time=0.6, keepalive_timeout=0.6), test,
                str(tmp_path / "h2.sock") if on == "unix" else None)


@pytest.mark.parametrize("on", ["tcp", "unix"])
def test_connections_past_the_limit_are_closed_at_once_and_a_health_check_is_served(on, tmp_path):
    """On the TCP port and on the Unix socket (``--uds``) alike."""

    async def test(server, port) -> None:
        peers = [await Socket.connect(port) for _ in range(3)]
        extra = await Socket.connect(port)
        await extra.pump(3)
        extra.frames()
        assert extra.eof and extra.goaway().error == "ENHANCE_YOUR_CALM"
        assert server.defences["max_connections"] == 1
        peer = peers[0]
        await peer.pump(0.2)
        peer.frames()
        await peer.send(frame(wire.SETTINGS, ACK, 0))
        sid = peer.stream_id()
        await peer.send(peer.headers(sid, HEALTH), peer.message(sid, b""))
        await peer.pump(1)
        seen = peer.frames()
        assert any(f.kind == DATA and f.stream == sid and f.payload == grpc_message(b"\x08\x01") for f in seen)
        assert [f.field("grpc-status") for f in seen if f.kind == HEADERS and f.flags & END_STREAM] == ["0"]
        for p in (*peers, extra):
            p.close()

    on_a_socket(SMALL, test, str(tmp_path / "h2.sock") if on == "unix" else None)


# -- what the server sends ------------------------------------------------------------------------
def test_header_blocks_are_split_at_the_peers_frame_size():
    from derender.extproc.http2.headers import FieldEncoder
    from hpack import Decoder

    codec = FieldEncoder()
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


def test_a_status_message_is_bounded_and_percent_encoded():
    peer = Direct(SMALL)
    sid = stream(peer, "/t/echo")
    peer.send(peer.message(sid, b"x"))
    peer.call(peer.machine.finish, sid, http2.UNKNOWN, "why " * 2000 + "100% \u00e9")
    seen = peer.frames(0, until=lambda f: f.kind == HEADERS and f.flags & END_STREAM)
    message = seen[-1].field("grpc-message")
    assert len(message) <= SMALL.max_status_message and message.endswith("...")
    assert wire.percent("100% \u00e9 \n") == "100%25 %C3%A9 %0A"


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


# -- the Unix socket (serve --uds) -----------------------------------------------------------------
def test_a_unix_socket_is_this_users_alone_and_replaces_only_a_stale_one(tmp_path):
    path = str(tmp_path / "ext_proc.sock")
    sock = listen.bind_unix(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with pytest.raises(OSError, match="another process listens there"):
        listen.bind_unix(path)  # a filter still serving there keeps it
    listen.unbind_unix(sock)
    assert not os.path.exists(path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # a filter that was killed: its file, nobody listening
    stale.close()
    listen.unbind_unix(listen.bind_unix(path))
    Path(path).write_text("not a socket")
    with pytest.raises(OSError, match="other than a socket"):
        listen.bind_unix(path)
    assert Path(path).read_text() == "not a socket"
    with pytest.raises(OSError, match="longer than"):
        listen.bind_unix(str(tmp_path / ("x" * 120)))
    first = listen.bind_unix(str(tmp_path / "a.sock"))
    os.unlink(tmp_path / "a.sock")
    newer = listen.bind_unix(str(tmp_path / "a.sock"))  # another filter took the path meanwhile
    listen.unbind_unix(first)
    assert os.path.exists(tmp_path / "a.sock")  # not the stopping filter's to remove
    listen.unbind_unix(newer)
