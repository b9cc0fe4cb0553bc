"""The conformance suite of the ext_proc port, on raw frames: h2spec's sections of RFC 9113 (3-8) and
RFC 7541 (HPACK), written as cases, and the bounds of ``extproc.http2.Limits`` that answer at once.

Each case sends its frames on a fresh connection (preface and SETTINGS exchanged first, except
where the preface is the point) and returns what the server did, as one word or two:
``GOAWAY <code>`` (a connection error), ``RST_STREAM <code>`` (a stream error), ``closed`` (the
connection closed without GOAWAY), ``alive`` (nothing, and a PING still gets its ACK), or what the
case itself reads (``response``, ``DATA 1``, ...). ``expect`` lists what RFC 9113 allows, as h2spec
does (a connection error may also show as the connection closed without GOAWAY); the first is what
the filter's server answers.

``tests/test_http2_conformance.py`` runs every case against the filter; ``bench/http2_suite.py``
runs them against both transports for the table in docs/operations.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from h2peer import HEALTH, PROCESS, Closed, Frame, Peer, request_fields
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

from derender.extproc.http2 import wire
from derender.extproc.http2.wire import (
    ACK, CONTINUATION, DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, PADDED, PING, PRIORITY, PRIORITY_FLAG,
    PUSH_PROMISE, RST_STREAM, SETTINGS, WINDOW_UPDATE, frame,
)

EMPTY = b""  # a HealthCheckRequest for the server's overall health: an empty message


@dataclass
class Case:
    section: str
    title: str
    run: Callable[[Peer], str]
    expect: tuple[str, ...]
    handshake: bool = True


CASES: list[Case] = []


def case(section: str, title: str, *expect: str, handshake: bool = True):
    if expect[0].startswith("GOAWAY") and "closed" not in expect:
        expect = (*expect, "closed")  # h2spec takes a closed connection for a connection error too
    def add(run: Callable[[Peer], str]) -> Callable[[Peer], str]:
        CASES.append(Case(section, title, run, expect, handshake))
        return run
    return add


def outcome(peer: Peer, stream: int | None = None, timeout: float = 2.0) -> str:
    """What the server did after the case's frames: an error on the connection or on ``stream``."""
    def decisive(f: Frame) -> bool:
        return (f.kind == GOAWAY and f.error != "NO_ERROR") or (f.kind == RST_STREAM and f.stream == stream)
    seen = peer.frames(timeout, until=decisive)
    for f in seen:
        if f.kind == GOAWAY and f.error != "NO_ERROR":
            return f"GOAWAY {f.error}"
        if f.kind == RST_STREAM and f.stream == stream:
            return f"RST_STREAM {f.error}"
    if peer.closed:
        return "closed"
    return "alive" if peer.alive() else "closed"


def answer(peer: Peer, stream: int, timeout: float = 5.0) -> str:
    """``response`` once the stream's trailers arrive (grpc-status present), else the error seen."""
    seen = peer.frames(timeout, until=lambda f: (f.kind == HEADERS and f.stream == stream and f.flags & END_STREAM)
                       or (f.kind == RST_STREAM and f.stream == stream) or f.kind == GOAWAY)
    for f in seen:
        if f.kind == HEADERS and f.stream == stream and f.flags & END_STREAM and f.field("grpc-status") is not None:
            return "response"
        if f.kind == RST_STREAM and f.stream == stream:
            return f"RST_STREAM {f.error}"
        if f.kind == GOAWAY:
            return f"GOAWAY {f.error}"
    return "closed" if peer.closed else "no answer"


def health(peer: Peer, stream: int | None = None, **kw) -> tuple[int, bytes]:
    sid = stream or peer.stream_id()
    return sid, peer.headers(sid, HEALTH, **kw) + peer.message(sid, EMPTY)


def settings(*pairs: tuple[int, int]) -> bytes:
    return b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in pairs)


def open_stream(peer: Peer) -> int:
    """An ext_proc stream left open (its handler waits for the request headers)."""
    sid = peer.stream_id()
    peer.send(peer.headers(sid, PROCESS))
    return sid


def huffman(text: bytes, symbols: list[int] | None = None, pad_bits: int | None = None, pad_ones: bool = True) -> bytes:
    value, bits = 0, 0
    for s in (symbols if symbols is not None else list(text)):
        value = (value << REQUEST_CODES_LENGTH[s]) | REQUEST_CODES[s]
        bits += REQUEST_CODES_LENGTH[s]
    pad = (-bits) % 8 if pad_bits is None else pad_bits
    value = (value << pad) | ((1 << pad) - 1 if pad_ones else 0)
    bits += pad
    return value.to_bytes(bits // 8, "big")


def literal_huffman(name: bytes, value: bytes) -> bytes:
    return b"\x00" + bytes([len(name)]) + name + bytes([0x80 | len(value)]) + value


def raw_block(peer: Peer, tail: bytes, head: bytes = b"") -> bytes:
    """A request's header block with raw HPACK bytes before and after well-formed fields."""
    return head + peer.block(request_fields(HEALTH)) + tail


# -- 3.5 the connection preface --------------------------------------------------------------
@case("3.5/1", "a valid connection preface", "SETTINGS", handshake=False)
def _(peer):
    peer.send(wire.PREFACE + frame(SETTINGS, 0, 0))
    seen = peer.frames(3, until=lambda f: f.kind == SETTINGS)
    return "SETTINGS" if seen and seen[-1].kind == SETTINGS and not seen[-1].flags & ACK else outcome(peer)


@case("3.5/2", "an invalid connection preface", "GOAWAY PROTOCOL_ERROR", "closed", handshake=False)
def _(peer):
    peer.send(b"INVALID CONNECTION PREFACE\r\n\r\n")
    return outcome(peer)


@case("3.5/3", "a preface whose first frame is not SETTINGS", "GOAWAY PROTOCOL_ERROR", "closed", handshake=False)
def _(peer):
    peer.send(wire.PREFACE + frame(PING, 0, 0, b"12345678"))
    return outcome(peer)


# -- 4 frames --------------------------------------------------------------------------------
@case("4.1/1", "a frame of an unknown type is ignored", "alive")
def _(peer):
    peer.send(frame(0x16, 0, 0, b"unknown"))
    return outcome(peer)


@case("4.1/2", "undefined flags are ignored", "alive")
def _(peer):
    peer.send(frame(PING, 0x16, 0, b"12345678"))
    return outcome(peer)


@case("4.1/3", "the reserved bit of a stream id is ignored", "response")
def _(peer):
    sid, data = health(peer)
    data = bytearray(data)
    data[5] |= 0x80  # the HEADERS frame's R bit
    peer.send(bytes(data))
    return answer(peer, sid)


@case("4.2/1", "a DATA frame of 16,384 bytes", "response")
def _(peer):
    sid = peer.stream_id()
    from grpc_health.v1 import health_pb2
    message = health_pb2.HealthCheckRequest(service="x" * (16384 - 5 - 3)).SerializeToString()
    assert len(message) + 5 == 16384
    peer.send(peer.headers(sid, HEALTH), peer.message(sid, message))
    return answer(peer, sid)


@case("4.2/2", "a DATA frame past SETTINGS_MAX_FRAME_SIZE", "GOAWAY FRAME_SIZE_ERROR", "RST_STREAM FRAME_SIZE_ERROR")
def _(peer):
    sid = peer.stream_id()
    peer.send(peer.headers(sid, HEALTH), frame(DATA, END_STREAM, sid, bytes(16385)))
    return outcome(peer, sid)


@case("4.2/3", "a HEADERS frame past SETTINGS_MAX_FRAME_SIZE", "GOAWAY FRAME_SIZE_ERROR")
def _(peer):
    sid = peer.stream_id()
    block = peer.encoder.encode(request_fields(HEALTH, [("x-big", "a" * 16400)]), huffman=False)
    peer.send(frame(HEADERS, END_HEADERS | END_STREAM, sid, block))
    return outcome(peer, sid)


@case("4.3/1", "an invalid header block fragment", "GOAWAY COMPRESSION_ERROR")
def _(peer):
    peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x00\x01"))  # a literal whose name never comes
    return outcome(peer, 1)


@case("4.3/2", "a PRIORITY frame inside a header block", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(HEADERS, 0, 1, peer.block(request_fields(HEALTH))), frame(PRIORITY, 0, 1, bytes(5)))
    return outcome(peer, 1)


@case("4.3/3", "HEADERS of another stream inside a header block", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(HEADERS, 0, 1, peer.block(request_fields(HEALTH))), peer.headers(3, HEALTH))
    return outcome(peer, 1)


# -- 5.1 stream states -----------------------------------------------------------------------
@case("5.1/1", "idle: DATA", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(DATA, 0, 1, b"\x00\x00\x00\x00\x00"))
    return outcome(peer, 1)


@case("5.1/2", "idle: RST_STREAM", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(RST_STREAM, 0, 1, bytes(4)))
    return outcome(peer, 1)


@case("5.1/3", "idle: WINDOW_UPDATE", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(WINDOW_UPDATE, 0, 1, (100).to_bytes(4, "big")))
    return outcome(peer, 1)


@case("5.1/4", "idle: CONTINUATION", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(CONTINUATION, END_HEADERS, 1, peer.block(request_fields(HEALTH))))
    return outcome(peer, 1)


@case("5.1/5", "half-closed (remote): DATA", "RST_STREAM STREAM_CLOSED", "GOAWAY STREAM_CLOSED")
def _(peer):
    sid = peer.stream_id()
    peer.send(peer.headers(sid, PROCESS, end_stream=True), frame(DATA, 0, sid, bytes(5)))
    return outcome(peer, sid)


@case("5.1/6", "half-closed (remote): HEADERS", "RST_STREAM STREAM_CLOSED", "GOAWAY STREAM_CLOSED")
def _(peer):
    sid = peer.stream_id()
    peer.send(peer.headers(sid, PROCESS, end_stream=True), peer.headers(sid, PROCESS, end_stream=True))
    return outcome(peer, sid)


@case("5.1/7", "half-closed (remote): CONTINUATION", "GOAWAY PROTOCOL_ERROR", "RST_STREAM STREAM_CLOSED")
def _(peer):
    sid = peer.stream_id()
    peer.send(peer.headers(sid, PROCESS, end_stream=True), frame(CONTINUATION, END_HEADERS, sid, b""))
    return outcome(peer, sid)


@case("5.1/8", "closed: DATA after the peer's RST_STREAM", "RST_STREAM STREAM_CLOSED", "GOAWAY STREAM_CLOSED")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(RST_STREAM, 0, sid, wire.CANCEL.to_bytes(4, "big")), frame(DATA, 0, sid, bytes(5)))
    return outcome(peer, sid)


@case("5.1/9", "closed: HEADERS after the peer's RST_STREAM", "RST_STREAM STREAM_CLOSED", "GOAWAY STREAM_CLOSED")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(RST_STREAM, 0, sid, wire.CANCEL.to_bytes(4, "big")), peer.headers(sid, PROCESS, end_stream=True))
    return outcome(peer, sid)


@case("5.1/10", "closed: CONTINUATION after the peer's RST_STREAM", "GOAWAY PROTOCOL_ERROR", "RST_STREAM STREAM_CLOSED")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(RST_STREAM, 0, sid, wire.CANCEL.to_bytes(4, "big")), frame(CONTINUATION, END_HEADERS, sid, b""))
    return outcome(peer, sid)


@case("5.1/11", "closed: DATA on a stream both ends ended", "RST_STREAM STREAM_CLOSED", "GOAWAY STREAM_CLOSED")
def _(peer):
    sid, data = health(peer)
    peer.send(data)
    assert answer(peer, sid) == "response"
    peer.send(frame(DATA, 0, sid, bytes(5)))
    return outcome(peer, sid)


@case("5.1/12", "closed: HEADERS on a stream both ends ended", "RST_STREAM STREAM_CLOSED", "GOAWAY STREAM_CLOSED")
def _(peer):
    sid, data = health(peer)
    peer.send(data)
    assert answer(peer, sid) == "response"
    peer.send(peer.headers(sid, HEALTH, end_stream=True))
    return outcome(peer, sid)


@case("5.1/13", "closed: CONTINUATION on a stream both ends ended", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    sid, data = health(peer)
    peer.send(data)
    assert answer(peer, sid) == "response"
    peer.send(frame(CONTINUATION, END_HEADERS, sid, b""))
    return outcome(peer, sid)


@case("5.1.1/1", "an even stream id", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(peer.headers(2, HEALTH, end_stream=True))
    return outcome(peer, 2)


@case("5.1.1/2", "a stream id below one already used", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    sid, data = health(peer, 5)
    peer.send(data)
    assert answer(peer, 5) == "response"
    peer.send(peer.headers(3, HEALTH, end_stream=True))
    return outcome(peer, 3)


@case("5.1.2/1", "a stream past SETTINGS_MAX_CONCURRENT_STREAMS", "RST_STREAM REFUSED_STREAM", "RST_STREAM PROTOCOL_ERROR")
def _(peer):
    server_settings = next((f for f in peer.received if f.kind == SETTINGS and not f.flags & ACK), None)
    limit = 100
    if server_settings is not None:
        for at in range(0, len(server_settings.payload), 6):
            if int.from_bytes(server_settings.payload[at:at + 2], "big") == wire.SETTINGS_MAX_CONCURRENT_STREAMS:
                limit = int.from_bytes(server_settings.payload[at + 2:at + 6], "big")
    if limit > 1000:
        return "no limit advertised"
    peer.send(*(peer.headers(peer.stream_id(), PROCESS) for _ in range(limit)))
    sid = peer.stream_id()
    peer.send(peer.headers(sid, PROCESS))
    return outcome(peer, sid)


@case("5.3.1/1", "HEADERS depending on its own stream", "RST_STREAM PROTOCOL_ERROR", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    block = (1).to_bytes(4, "big") + b"\x10" + peer.block(request_fields(HEALTH))
    peer.send(frame(HEADERS, END_HEADERS | PRIORITY_FLAG, 1, block))
    return outcome(peer, 1)


@case("5.3.1/2", "PRIORITY depending on its own stream", "RST_STREAM PROTOCOL_ERROR", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(PRIORITY, 0, 1, (1).to_bytes(4, "big") + b"\x10"))
    return outcome(peer, 1)


@case("5.4.1/1", "after a connection error: GOAWAY, then the connection closed", "GOAWAY and closed")
def _(peer):
    peer.send(frame(PING, 0, 0, b"123456"))
    out = outcome(peer)
    return "GOAWAY and closed" if out.startswith("GOAWAY") and peer.wait_closed(5) else out


@case("5.5/1", "an unknown extension frame", "alive")
def _(peer):
    peer.send(frame(0xFF, 0, 0, b"extension"))
    return outcome(peer)


@case("5.5/2", "an unknown extension frame inside a header block", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(HEADERS, 0, 1, peer.block(request_fields(HEALTH))), frame(0xFF, 0, 1, b"extension"))
    return outcome(peer, 1)


# -- 6 frame definitions ----------------------------------------------------------------------
@case("6.1/1", "DATA on stream 0", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(DATA, 0, 0, b"data"))
    return outcome(peer)


@case("6.1/2", "DATA with a pad length past its payload", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(DATA, PADDED, sid, b"\x06data"))
    return outcome(peer, sid)


@case("6.1/3", "DATA with padding, well formed", "response")
def _(peer):
    sid = peer.stream_id()
    peer.send(peer.headers(sid, HEALTH), frame(DATA, PADDED | END_STREAM, sid, b"\x03" + bytes(5) + b"pad"))
    return answer(peer, sid)


@case("6.2/1", "HEADERS on stream 0", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(peer.headers(0, HEALTH, end_stream=True))
    return outcome(peer)


@case("6.2/2", "HEADERS with a pad length past its payload", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    block = peer.block(request_fields(HEALTH))
    peer.send(frame(HEADERS, END_HEADERS | PADDED, 1, bytes([len(block) + 1]) + block))
    return outcome(peer, 1)


@case("6.2/3", "HEADERS with padding and priority, well formed", "response")
def _(peer):
    block = b"\x00\x00\x00\x00\x10" + peer.block(request_fields(HEALTH))
    peer.send(frame(HEADERS, END_HEADERS | PADDED | PRIORITY_FLAG, 1, b"\x04" + block + bytes(4)),
              peer.message(1, EMPTY))
    return answer(peer, 1)


@case("6.3/1", "PRIORITY on stream 0", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(PRIORITY, 0, 0, b"\x00\x00\x00\x01\x10"))
    return outcome(peer)


@case("6.3/2", "PRIORITY of 4 bytes", "RST_STREAM FRAME_SIZE_ERROR", "GOAWAY FRAME_SIZE_ERROR")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(PRIORITY, 0, sid, b"\x00\x00\x00\x03"))
    return outcome(peer, sid)


@case("6.4/1", "RST_STREAM on stream 0", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(RST_STREAM, 0, 0, bytes(4)))
    return outcome(peer)


@case("6.4/2", "RST_STREAM of 3 bytes", "GOAWAY FRAME_SIZE_ERROR")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(RST_STREAM, 0, sid, bytes(3)))
    return outcome(peer, sid)


@case("6.5/1", "SETTINGS ACK with a payload", "GOAWAY FRAME_SIZE_ERROR")
def _(peer):
    peer.send(frame(SETTINGS, ACK, 0, settings((wire.SETTINGS_ENABLE_PUSH, 0))))
    return outcome(peer)


@case("6.5/2", "SETTINGS on a stream", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(SETTINGS, 0, 1, settings((wire.SETTINGS_ENABLE_PUSH, 0))))
    return outcome(peer)


@case("6.5/3", "SETTINGS of 3 bytes", "GOAWAY FRAME_SIZE_ERROR")
def _(peer):
    peer.send(frame(SETTINGS, 0, 0, b"\x00\x02\x00"))
    return outcome(peer)


@case("6.5.2/1", "SETTINGS_ENABLE_PUSH of 2", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(SETTINGS, 0, 0, settings((wire.SETTINGS_ENABLE_PUSH, 2))))
    return outcome(peer)


@case("6.5.2/2", "SETTINGS_INITIAL_WINDOW_SIZE of 2^31", "GOAWAY FLOW_CONTROL_ERROR")
def _(peer):
    peer.send(frame(SETTINGS, 0, 0, settings((wire.SETTINGS_INITIAL_WINDOW_SIZE, 1 << 31))))
    return outcome(peer)


@case("6.5.2/3", "SETTINGS_MAX_FRAME_SIZE of 16,383", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(SETTINGS, 0, 0, settings((wire.SETTINGS_MAX_FRAME_SIZE, 16383))))
    return outcome(peer)


@case("6.5.2/4", "SETTINGS_MAX_FRAME_SIZE of 2^24", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(SETTINGS, 0, 0, settings((wire.SETTINGS_MAX_FRAME_SIZE, 1 << 24))))
    return outcome(peer)


@case("6.5.2/5", "an unknown setting is ignored", "SETTINGS ACK")
def _(peer):
    peer.send(frame(SETTINGS, 0, 0, settings((0xFF, 1))))
    seen = peer.frames(3, until=lambda f: f.kind == SETTINGS and f.flags & ACK or f.kind == GOAWAY)
    return "SETTINGS ACK" if seen and seen[-1].kind == SETTINGS else outcome(peer)


@case("6.5.3/1", "several SETTINGS_INITIAL_WINDOW_SIZE values: the last one counts", "DATA 1")
def _(peer):
    peer.send(frame(SETTINGS, 0, 0, settings((wire.SETTINGS_INITIAL_WINDOW_SIZE, 100),
                                             (wire.SETTINGS_INITIAL_WINDOW_SIZE, 1))))
    return first_data(peer)


@case("6.5.3/2", "SETTINGS are acknowledged", "SETTINGS ACK")
def _(peer):
    peer.send(frame(SETTINGS, 0, 0, settings((wire.SETTINGS_ENABLE_PUSH, 0))))
    seen = peer.frames(3, until=lambda f: f.kind == SETTINGS and f.flags & ACK)
    return "SETTINGS ACK" if seen and seen[-1].kind == SETTINGS else outcome(peer)


def first_data(peer: Peer) -> str:
    sid, data = health(peer)
    peer.send(data)
    seen = peer.frames(3, until=lambda f: f.kind == DATA and f.stream == sid or f.kind in (GOAWAY, RST_STREAM))
    return f"DATA {len(seen[-1].payload)}" if seen and seen[-1].kind == DATA else outcome(peer, sid)


@case("6.7/1", "PING gets an ACK with its payload", "PING ACK")
def _(peer):
    peer.send(frame(PING, 0, 0, b"h2spec!!"))
    seen = peer.frames(3, until=lambda f: f.kind == PING)
    return "PING ACK" if seen and seen[-1].flags & ACK and seen[-1].payload == b"h2spec!!" else outcome(peer)


@case("6.7/2", "a PING ACK gets nothing back", "alive")
def _(peer):
    peer.send(frame(PING, ACK, 0, b"unasked!"))
    seen = peer.frames(0.5)
    return "answered" if any(f.kind == PING and f.payload == b"unasked!" for f in seen) else outcome(peer)


@case("6.7/3", "PING on a stream", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(PING, 0, 1, b"12345678"))
    return outcome(peer)


@case("6.7/4", "PING of 6 bytes", "GOAWAY FRAME_SIZE_ERROR")
def _(peer):
    peer.send(frame(PING, 0, 0, b"123456"))
    return outcome(peer)


@case("6.7/5", "PING of 1 MiB", "GOAWAY FRAME_SIZE_ERROR", "closed")
def _(peer):
    peer.send(frame(PING, 0, 0, bytes(1 << 20)))
    return outcome(peer)


@case("6.8/1", "GOAWAY on a stream", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(GOAWAY, 0, 1, bytes(8)))
    return outcome(peer)


@case("6.9/1", "WINDOW_UPDATE of 0 on the connection", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(WINDOW_UPDATE, 0, 0, bytes(4)))
    return outcome(peer)


@case("6.9/2", "WINDOW_UPDATE of 0 on a stream", "RST_STREAM PROTOCOL_ERROR", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(WINDOW_UPDATE, 0, sid, bytes(4)))
    return outcome(peer, sid)


@case("6.9/3", "WINDOW_UPDATE of 3 bytes", "GOAWAY FRAME_SIZE_ERROR")
def _(peer):
    peer.send(frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"))
    return outcome(peer)


@case("6.9.1/1", "SETTINGS_INITIAL_WINDOW_SIZE of 1: one byte of DATA", "DATA 1")
def _(peer):
    peer.send(frame(SETTINGS, 0, 0, settings((wire.SETTINGS_INITIAL_WINDOW_SIZE, 1))))
    return first_data(peer)


@case("6.9.1/2", "the connection window past 2^31-1", "GOAWAY FLOW_CONTROL_ERROR")
def _(peer):
    peer.send(frame(WINDOW_UPDATE, 0, 0, wire.MAX_WINDOW.to_bytes(4, "big")))
    return outcome(peer)


@case("6.9.1/3", "a stream window past 2^31-1", "RST_STREAM FLOW_CONTROL_ERROR")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(WINDOW_UPDATE, 0, sid, wire.MAX_WINDOW.to_bytes(4, "big")))
    return outcome(peer, sid)


@case("6.9.2/1", "SETTINGS_INITIAL_WINDOW_SIZE raised after the request: the DATA goes on", "DATA 7")
def _(peer):
    peer.send(frame(SETTINGS, 0, 0, settings((wire.SETTINGS_INITIAL_WINDOW_SIZE, 0))))
    sid, data = health(peer)
    peer.send(data)
    peer.frames(0.5, until=lambda f: f.kind == DATA)
    peer.send(frame(SETTINGS, 0, 0, settings((wire.SETTINGS_INITIAL_WINDOW_SIZE, 65535))))
    seen = peer.frames(3, until=lambda f: f.kind == DATA and f.stream == sid)
    return f"DATA {len(seen[-1].payload)}" if seen and seen[-1].kind == DATA else outcome(peer, sid)


@case("6.9.2/2", "a stream window made negative by SETTINGS, then opened", "DATA 1")
def _(peer):
    peer.send(frame(SETTINGS, 0, 0, settings((wire.SETTINGS_INITIAL_WINDOW_SIZE, 3))))
    sid, data = health(peer)
    peer.send(data)
    seen = peer.frames(3, until=lambda f: f.kind == DATA and f.stream == sid)
    if not seen or seen[-1].kind != DATA or len(seen[-1].payload) != 3:
        return outcome(peer, sid)
    peer.send(frame(SETTINGS, 0, 0, settings((wire.SETTINGS_INITIAL_WINDOW_SIZE, 0))),
              frame(WINDOW_UPDATE, 0, sid, (4).to_bytes(4, "big")))
    seen = peer.frames(3, until=lambda f: f.kind == DATA and f.stream == sid)
    return f"DATA {len(seen[-1].payload)}" if seen and seen[-1].kind == DATA else outcome(peer, sid)


@case("6.10/1", "HEADERS and several CONTINUATION frames", "response")
def _(peer):
    block = peer.block(request_fields(HEALTH))
    parts = [block[i:i + 8] for i in range(0, len(block), 8)]
    frames_ = [frame(HEADERS, 0, 1, parts[0])]
    frames_ += [frame(CONTINUATION, END_HEADERS if i == len(parts) - 1 else 0, 1, p) for i, p in enumerate(parts) if i]
    peer.send(*frames_, peer.message(1, EMPTY))
    return answer(peer, 1)


@case("6.10/2", "CONTINUATION followed by a frame of another type", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    block = peer.block(request_fields(HEALTH))
    peer.send(frame(HEADERS, 0, 1, block[:4]), frame(CONTINUATION, 0, 1, block[4:]), frame(DATA, 0, 1, bytes(5)))
    return outcome(peer, 1)


@case("6.10/3", "CONTINUATION on stream 0", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    block = peer.block(request_fields(HEALTH))
    peer.send(frame(HEADERS, 0, 1, block[:4]), frame(CONTINUATION, END_HEADERS, 0, block[4:]))
    return outcome(peer, 1)


@case("6.10/4", "CONTINUATION after HEADERS with END_HEADERS", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(CONTINUATION, END_HEADERS, sid, peer.block([("x-more", "1")])))
    return outcome(peer, sid)


@case("6.10/5", "CONTINUATION after a CONTINUATION with END_HEADERS", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    block = peer.block(request_fields(PROCESS))
    peer.send(frame(HEADERS, 0, 1, block[:4]), frame(CONTINUATION, END_HEADERS, 1, block[4:]),
              frame(CONTINUATION, END_HEADERS, 1, peer.block([("x-more", "1")])))
    return outcome(peer, 1)


@case("6.10/6", "CONTINUATION after DATA", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(DATA, 0, sid, bytes(5)), frame(CONTINUATION, END_HEADERS, sid, peer.block([("x-more", "1")])))
    return outcome(peer, sid)


# -- 7 error codes -----------------------------------------------------------------------------
@case("7/1", "GOAWAY with an unknown error code", "alive")
def _(peer):
    peer.send(frame(GOAWAY, 0, 0, bytes(4) + (0xFF).to_bytes(4, "big")))
    return outcome(peer)


@case("7/2", "RST_STREAM with an unknown error code", "alive")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(RST_STREAM, 0, sid, (0xFF).to_bytes(4, "big")))
    return outcome(peer)


# -- 8 HTTP semantics ---------------------------------------------------------------------------
@case("8.1/1", "a second HEADERS without END_STREAM", "RST_STREAM PROTOCOL_ERROR")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(HEADERS, END_HEADERS, sid, peer.block([("x-trailer", "1")])))
    return outcome(peer, sid)


def malformed(fields: list[tuple[str, str]]) -> Callable[[Peer], str]:
    def run(peer: Peer) -> str:
        sid = peer.stream_id()
        peer.send(frame(HEADERS, END_HEADERS, sid, peer.block(fields)), peer.message(sid, EMPTY))
        return outcome(peer, sid)
    return run


BASE = request_fields(HEALTH)
for section, title, fields_ in [
    ("8.2/1", "an uppercase field name", [*BASE, ("X-Upper", "1")]),
    ("8.2/2", "a field value with a NUL", [*BASE, ("x-nul", "a\x00b")]),
    ("8.2/3", "a field value with CR LF", [*BASE, ("x-crlf", "a\r\nx-injected: 1")]),
    ("8.3/1", "an unknown pseudo-header field", [(":unknown", "1"), *BASE]),
    ("8.3/2", "a response pseudo-header field in a request", [(":status", "200"), *BASE]),
    ("8.3/3", "a pseudo-header field after a regular one", [*BASE, (":authority", "late")]),
    ("8.3/4", "a repeated pseudo-header field", [(":method", "POST"), *BASE]),
    ("8.3/5", "a connection-specific field", [*BASE, ("connection", "keep-alive")]),
    ("8.3/6", "te other than trailers", [*BASE[:-1], ("te", "trailers, deflate")]),
    ("8.3/7", "an empty :path", [(k, "" if k == ":path" else v) for k, v in BASE]),
    ("8.3/8", "no :method", [f for f in BASE if f[0] != ":method"]),
    ("8.3/9", "no :scheme", [f for f in BASE if f[0] != ":scheme"]),
    ("8.3/10", "no :path", [f for f in BASE if f[0] != ":path"]),
]:
    case(section, title, "RST_STREAM PROTOCOL_ERROR")(malformed(fields_))


@case("8.3/11", "a pseudo-header field in trailers", "RST_STREAM PROTOCOL_ERROR")
def _(peer):
    sid = open_stream(peer)
    peer.send(frame(HEADERS, END_HEADERS | END_STREAM, sid, peer.block([(":path", "/trailer")])))
    return outcome(peer, sid)


@case("8.3/12", "DATA longer than content-length", "RST_STREAM PROTOCOL_ERROR")
def _(peer):
    sid = peer.stream_id()
    peer.send(peer.headers(sid, HEALTH, extra=[("content-length", "1")]), peer.message(sid, EMPTY))
    return outcome(peer, sid)


@case("8.3/13", "DATA shorter than content-length", "RST_STREAM PROTOCOL_ERROR")
def _(peer):
    sid = peer.stream_id()
    peer.send(peer.headers(sid, HEALTH, extra=[("content-length", "9")]), peer.message(sid, EMPTY))
    return outcome(peer, sid)


@case("8.4/1", "PUSH_PROMISE from a client", "GOAWAY PROTOCOL_ERROR")
def _(peer):
    peer.send(frame(PUSH_PROMISE, END_HEADERS, 1, (2).to_bytes(4, "big") + peer.block(request_fields(HEALTH))))
    return outcome(peer, 1)


# -- RFC 7541 HPACK -----------------------------------------------------------------------------
def hpack_case(section: str, title: str, tail: bytes = b"", head: bytes = b""):
    @case(section, title, "GOAWAY COMPRESSION_ERROR")
    def _(peer):
        peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, raw_block(peer, tail, head)))
        return outcome(peer, 1)


hpack_case("hpack 2.3.3/1", "an index past the table", tail=b"\xff\x7f")
hpack_case("hpack 4.2/1", "a table size update at the end of a block", tail=b"\x20")
hpack_case("hpack 5.2/1", "a Huffman string with the EOS symbol",
           tail=literal_huffman(b"x", huffman(b"", symbols=[ord("t"), ord("e"), 256])))
hpack_case("hpack 5.2/2", "Huffman padding longer than 7 bits",
           tail=literal_huffman(b"x", huffman(b"test", pad_bits=(-20) % 8 + 8)))
hpack_case("hpack 5.2/3", "Huffman padding not of ones", tail=literal_huffman(b"x", huffman(b"test", pad_ones=False)))
hpack_case("hpack 6.1/1", "index 0", tail=b"\x80")
hpack_case("hpack 6.3/1", "a table size update past SETTINGS_HEADER_TABLE_SIZE", head=b"\x3f\xe2\x1f")


# -- gRPC over HTTP/2, and what a stream error may not reach -------------------------------------
@case("grpc/1", "a health check", "SERVING")
def _(peer):
    sid, data = health(peer)
    peer.send(data)
    seen = peer.frames(5, until=lambda f: f.kind == HEADERS and f.stream == sid and f.flags & END_STREAM)
    body = b"".join(f.payload for f in seen if f.kind == DATA and f.stream == sid)
    return "SERVING" if body == b"\x00\x00\x00\x00\x02\x08\x01" and seen[-1].field("grpc-status") == "0" else outcome(peer, sid)


@case("grpc/2", "an unknown method: UNIMPLEMENTED", "grpc-status 12")
def _(peer):
    sid = peer.stream_id()
    peer.send(peer.headers(sid, "/no.such.Service/Method"), peer.message(sid, EMPTY))
    seen = peer.frames(5, until=lambda f: f.kind == HEADERS and f.stream == sid)
    return f"grpc-status {seen[-1].field('grpc-status')}" if seen and seen[-1].kind == HEADERS else outcome(peer, sid)


@case("grpc/3", "a 20 KB unknown :path: no frame past the peer's frame size, grpc-message bounded",
      "UNIMPLEMENTED, frames <= 16384, message <= 3 KiB")
def _(peer):
    sid = peer.stream_id()
    peer.send(peer.headers(sid, "/" + "p" * 20000), peer.message(sid, EMPTY))
    seen = peer.frames(5, until=lambda f: f.kind in (HEADERS, GOAWAY, RST_STREAM) and f.stream in (0, sid))
    if not seen or seen[-1].kind != HEADERS:
        return outcome(peer, sid)
    message = seen[-1].field("grpc-message") or ""
    largest = max(len(f.payload) for f in peer.received)
    status = "UNIMPLEMENTED" if seen[-1].field("grpc-status") == "12" else seen[-1].field("grpc-status")
    return f"{status}, frames <= 16384, message <= 3 KiB" if largest <= 16384 and len(message) <= 3072 else (
        f"{status}, largest frame {largest}, message of {len(message)}")


@case("grpc/4", "a message announced past the limit: RESOURCE_EXHAUSTED before it is kept", "grpc-status 8")
def _(peer):
    sid = peer.stream_id()
    peer.send(peer.headers(sid, HEALTH), frame(DATA, 0, sid, b"\x00" + (200 << 20).to_bytes(4, "big") + bytes(1000)))
    seen = peer.frames(5, until=lambda f: (f.kind == HEADERS and f.stream == sid and f.flags & END_STREAM)
                       or f.kind in (GOAWAY, RST_STREAM))
    heads = [f for f in seen if f.kind == HEADERS and f.stream == sid and f.flags & END_STREAM]
    return f"grpc-status {heads[-1].field('grpc-status')}" if heads else outcome(peer, sid)


@case("grpc/5", "a non-UTF-8 field value is taken, as grpc-core takes it", "response")
def _(peer):
    sid = peer.stream_id()
    block = peer.block(request_fields(HEALTH)) + b"\x00\x06x-bin1\x02\xff\xfe"
    peer.send(frame(HEADERS, END_HEADERS, sid, block), peer.message(sid, EMPTY))
    return answer(peer, sid)


@case("grpc/6", "a malformed stream beside a good one: only it is reset", "RST_STREAM PROTOCOL_ERROR, other answered")
def _(peer):
    good = open_stream(peer)
    bad = peer.stream_id()
    peer.send(frame(HEADERS, END_HEADERS, bad, peer.block([*request_fields(HEALTH), ("x-nul", "\x00")])))
    result = outcome(peer, bad)
    other, data = health(peer)
    peer.send(data, frame(RST_STREAM, 0, good, wire.CANCEL.to_bytes(4, "big")))
    return f"{result}, other answered" if answer(peer, other) == "response" else f"{result}, other lost"


def run(case: Case, port: int, **peer_options) -> str:
    """One case on a fresh connection to ``port``: its outcome."""
    with Peer(port, preface=case.handshake, **peer_options) as peer:
        try:
            if case.handshake:
                peer.handshake()
            return case.run(peer)
        except Closed:
            return "closed"
        except OSError as exc:
            return f"closed ({type(exc).__name__})"
