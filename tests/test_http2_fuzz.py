"""Random frame sequences against the filter's ext_proc port (hypothesis): whatever a peer sends,
the filter never crashes or logs a traceback, its memory stays bounded, and other connections (a
health check, Envoy's clients) are served all along."""

from __future__ import annotations

import json

import httpx
from h2peer import HEALTH, PROCESS, Peer, serving
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from derender.extproc.http2 import wire
from derender.extproc.http2.wire import frame

MiB = 1 << 20
STREAMS = st.sampled_from([0, 1, 1, 3, 3, 5, 2, 7, 0x7FFFFFFF])
KINDS = st.sampled_from(list(range(10)) + [0x10, 0xFF])
PATHS = st.sampled_from([PROCESS, HEALTH, "/unknown", "", "/" + "p" * 300])


@st.composite
def frame_spec(draw):
    """A frame as (kind, flags, stream, payload or a request to encode with the connection's HPACK)."""
    kind = draw(KINDS)
    flags = draw(st.sampled_from([0, wire.END_STREAM, wire.END_HEADERS, wire.END_STREAM | wire.END_HEADERS,
                                  wire.PADDED, wire.PRIORITY_FLAG, 0xFF]))
    stream = draw(STREAMS)
    shape = draw(st.sampled_from(["raw", "typed", "typed"]))
    if shape == "raw":
        return kind, flags, stream, draw(st.binary(max_size=64))
    if kind in (wire.HEADERS, wire.CONTINUATION):
        fields = [(":method", "POST"), (":scheme", "http"), (":path", draw(PATHS)), (":authority", "x"),
                  ("content-type", "application/grpc")]
        fields += draw(st.lists(st.tuples(st.sampled_from(["te", "x-a", "X-Up", ":path", "connection", "grpc-encoding"]),
                                          st.text(max_size=8)), max_size=3))
        return kind, flags, stream, ("hpack", fields)
    if kind == wire.DATA:
        message = draw(st.one_of(st.binary(max_size=40), st.just(b"")))
        length = draw(st.one_of(st.just(len(message)), st.integers(0, 1 << 31)))
        return kind, flags, stream, b"\x00" + (length % (1 << 32)).to_bytes(4, "big") + message
    if kind == wire.SETTINGS:
        entries = draw(st.lists(st.tuples(st.integers(0, 8), st.integers(0, (1 << 32) - 1)), max_size=5))
        return kind, flags, stream, b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in entries)
    if kind in (wire.WINDOW_UPDATE, wire.RST_STREAM):
        return kind, flags, stream, draw(st.integers(0, (1 << 32) - 1)).to_bytes(4, "big")
    if kind == wire.PING:
        return kind, flags, stream, draw(st.binary(min_size=8, max_size=8))
    if kind == wire.PRIORITY:
        return kind, flags, stream, draw(st.binary(min_size=5, max_size=5))
    if kind == wire.GOAWAY:
        return kind, flags, stream, draw(st.binary(min_size=8, max_size=16))
    return kind, flags, stream, draw(st.binary(max_size=32))


def materialize(peer: Peer, spec) -> bytes:
    kind, flags, stream, payload = spec
    if isinstance(payload, tuple):
        payload = peer.block(payload[1])
    return frame(kind, flags, stream, payload)


class Run:
    examples = 0
    peak = 0


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(specs=st.lists(frame_spec(), min_size=1, max_size=25), preface=st.sampled_from(["full", "full", "none", "bad"]))
def test_random_frames_never_break_the_filter(h2_target, specs, preface):
    if not Run.examples:
        Run.before = h2_target.rss()
    Run.examples += 1
    with Peer(h2_target.port, preface=preface == "full") as peer:
        if preface == "bad":
            peer.try_send(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")
        elif preface == "full":
            peer.frames(0.05)
        peer.try_send(b"".join(materialize(peer, s) for s in specs))
        peer.frames(0.1)
    Run.peak = max(Run.peak, h2_target.rss())
    if Run.examples % 40 == 0:
        assert serving(h2_target.port)
        assert Run.peak - Run.before < 64 * MiB, f"grew {(Run.peak - Run.before) / MiB:.0f} MiB"


def test_after_the_random_frames(h2_target):
    """Whatever order the tests ran in, after the random frames: served, bounded, no traceback."""
    assert serving(h2_target.port)
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "after the fuzz"}]}
    r = httpx.post(h2_target.envoy_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and json.loads(r.text)["choices"][0]["message"]["content"] == "after the fuzz"
    log = h2_target.filter.log.read_text(errors="replace")
    assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]
