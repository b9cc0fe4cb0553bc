"""The classic HTTP/2 attacks against the filter's ext_proc port, each with its bound: a real filter
(one worker, so its process is the server), raw frames from an attacker on loopback, and Envoy's
clients going on meanwhile.

For each: what the server sent the attacker, the filter's memory at its peak during the attack
against before it (RSS, sampled every 20 ms), the defence's count on the metrics port, and chat
requests through Envoy to the same worker, during and after, all answered with the right text.
The bounds are the ones ``http2.Limits`` sets (docs/operations.md, "The ext_proc port")."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from h2peer import PROCESS, Peer, serving
from stack import PeakRss, wait_for

from derender.extproc.http2 import wire
from derender.extproc.http2.wire import CONTINUATION, DATA, HEADERS, PING, RST_STREAM, SETTINGS, frame

MiB = 1 << 20


class Watch:
    """During an attack: how far the filter's RSS grew at its peak, and Envoy's clients asking all along."""

    def __init__(self, target) -> None:
        self.target = target
        self.answers: list[tuple[int, str]] = []
        self.stop = threading.Event()
        self.asking = threading.Thread(target=self._ask, daemon=True)
        self.grew = 0

    def _ask(self) -> None:
        with httpx.Client(base_url=self.target.envoy_url, timeout=30) as client:
            i = 0
            while not self.stop.is_set():
                i += 1
                text = f"still answering {i}"
                body = {"model": "qwen3", "messages": [{"role": "user", "content": text}], "stream": i % 2 == 0}
                try:
                    r = client.post("/v1/chat/completions", json=body)
                    got = _streamed(r.text) if body["stream"] else r.json()["choices"][0]["message"]["content"]
                    self.answers.append((r.status_code, "ok" if got == text else r.text[:200]))
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    self.answers.append((0, repr(exc)))

    def __enter__(self) -> "Watch":
        self.rss = PeakRss(self.target.filter.popen.pid)
        self.asking.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.3)  # a few answers after the attack too
        self.stop.set()
        self.grew = self.rss.stop()
        self.asking.join(30)

    def check(self, growth: int) -> None:
        grew = self.grew
        assert grew < growth, f"the filter grew by {grew / MiB:.0f} MiB (bound {growth / MiB:.0f} MiB)"
        assert len(self.answers) >= 2, self.answers
        assert all(status == 200 and ok == "ok" for status, ok in self.answers), self.answers


def _streamed(sse: str) -> str:
    import json

    out = []
    for line in sse.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                out.append(choice.get("delta", {}).get("content") or "")
    return "".join(out)


def attacker(target, **kw) -> Peer:
    return Peer.connect(target.port, **kw)


def defences_after(target, before: dict, name: str) -> float:
    return target.defences().get(name, 0) - before.get(name, 0)


def healthy(target) -> None:
    assert serving(target.port)
    log = target.filter.log.read_text(errors="replace")
    assert "Traceback" not in log and "never retrieved" not in log, log[-3000:]


def test_stream_flood_is_refused_past_the_limit(h2_target):
    """5,000 HEADERS opening streams without DATA (they were all held open): 100 are, the rest are
    refused, and refusing them spends the reset budget: GOAWAY ENHANCE_YOUR_CALM."""
    before = h2_target.defences()
    with Watch(h2_target) as watch, attacker(h2_target) as peer:
        frames_ = b"".join(peer.headers(peer.stream_id(), PROCESS) for _ in range(5000))
        peer.try_send(frames_)
        seen = peer.frames(10, until=lambda f: f.kind == wire.GOAWAY)
        refused = [f for f in seen if f.kind == RST_STREAM and f.error == "REFUSED_STREAM"]
        assert 100 <= len(refused) <= 1100
        assert seen[-1].kind == wire.GOAWAY and seen[-1].error == "ENHANCE_YOUR_CALM"
        assert peer.wait_closed(5)
    watch.check(48 * MiB)
    assert defences_after(h2_target, before, "max_streams") >= 100
    healthy(h2_target)


def test_rapid_reset_is_stopped_after_the_reset_budget(h2_target):
    """200,000 HEADERS + RST_STREAM pairs (CVE-2023-44487): the connection ends with GOAWAY
    ENHANCE_YOUR_CALM after about a thousand; the last stream it took says how many."""
    before = h2_target.defences()
    with Watch(h2_target) as watch, attacker(h2_target) as peer:
        cancel = wire.CANCEL.to_bytes(4, "big")
        chunk = b""
        for _ in range(2000):
            sid = peer.stream_id()
            chunk += peer.headers(sid, PROCESS) + frame(RST_STREAM, 0, sid, cancel)
        sent = 0
        while sent < 200_000 and peer.try_send(chunk):
            sent += 2000
            if peer.closed:
                break
        goaway = peer.frames(10, until=lambda f: f.kind == wire.GOAWAY)[-1]
        assert goaway.kind == wire.GOAWAY and goaway.error == "ENHANCE_YOUR_CALM"
        last = int.from_bytes(goaway.payload[:4], "big")
        assert last <= 2 * 1200, f"the server took {last // 2} streams"
        assert peer.wait_closed(5)
    watch.check(32 * MiB)
    assert defences_after(h2_target, before, "rapid_reset") == 1
    healthy(h2_target)


def test_made_you_reset_is_stopped_too(h2_target):
    """Streams the peer makes the server reset (WINDOW_UPDATE of 0, CVE-2025-8671), counted as resets."""
    with Watch(h2_target) as watch, attacker(h2_target) as peer:
        frames_ = b""
        for _ in range(3000):
            sid = peer.stream_id()
            frames_ += peer.headers(sid, PROCESS) + frame(wire.WINDOW_UPDATE, 0, sid, bytes(4))
        peer.try_send(frames_)
        goaway = peer.frames(10, until=lambda f: f.kind == wire.GOAWAY)[-1]
        assert goaway.kind == wire.GOAWAY and goaway.error == "ENHANCE_YOUR_CALM"
    watch.check(32 * MiB)
    healthy(h2_target)


def test_huge_messages_are_refused_before_they_are_kept(h2_target):
    """Four streams announcing 200 MiB messages: RESOURCE_EXHAUSTED before any byte is kept. Then
    ten announcing 16 MiB (under the limit) and sending 8 MiB each: what the connection may hold
    (64 MiB) is held, the rest refused."""
    before = h2_target.defences()
    with Watch(h2_target) as watch, attacker(h2_target) as peer:
        sids = [peer.stream_id() for _ in range(4)]
        for sid in sids:
            peer.send(peer.headers(sid, PROCESS),
                      frame(DATA, 0, sid, b"\x00" + (200 * MiB).to_bytes(4, "big") + bytes(16000)))
        seen = peer.frames(5, until=lambda f: sum(1 for g in peer.received if g.kind == HEADERS
                                                  and g.field("grpc-status") == "8") == 4)
        assert sum(1 for f in seen if f.kind == HEADERS and f.field("grpc-status") == "8") == 4
        sids = [peer.stream_id() for _ in range(10)]
        peer.send(*(peer.headers(sid, PROCESS) for sid in sids))
        chunk = bytes(16000)
        for sid in sids:
            peer.send(frame(DATA, 0, sid, b"\x00" + (16 * MiB).to_bytes(4, "big") + chunk))
        for _ in range(8 * MiB // 16000):
            if not peer.try_send(*(frame(DATA, 0, sid, chunk) for sid in sids)):
                break
        refused = [f for f in peer.frames(5) if f.kind == HEADERS and f.field("grpc-status") == "8"]
        assert 6 <= len(refused) <= 7  # 3 of 17 MiB fit the connection's 64 MiB
        assert peer.alive()
    watch.check(96 * MiB)
    assert defences_after(h2_target, before, "message_size") == 4
    assert defences_after(h2_target, before, "buffer_full") >= 6
    healthy(h2_target)


@pytest.mark.parametrize("flood", ["ping", "settings"])
def test_a_peer_that_never_reads_its_control_replies_is_closed(h2_target, flood):
    """PING or SETTINGS frames without reading the ACKs (CVE-2019-9512, 9515): the server stops
    reading a peer that does not read and closes it once its replies pile up."""
    before = h2_target.defences()
    unit = frame(PING, 0, 0, bytes(8)) if flood == "ping" else frame(SETTINGS, 0, 0)
    with Watch(h2_target) as watch, attacker(h2_target, rcvbuf=4096) as peer:
        chunk = unit * 4096
        sent = 0
        while sent < 64 * MiB and peer.try_send(chunk):
            sent += len(chunk)
        wait_for(lambda: defences_after(h2_target, before, "control_flood") >= 1, "the flooding peer closed", 20)
    watch.check(32 * MiB)
    healthy(h2_target)


def test_continuation_floods_end_the_connection(h2_target):
    """A header block that never ends (the 2024 CONTINUATION flood): of empty frames, the second
    in a row ends it; of filled ones, the 33rd frame or the 64th KiB."""
    before = h2_target.defences()
    with Watch(h2_target) as watch:
        with attacker(h2_target) as peer:
            peer.try_send(frame(HEADERS, 0, 1, peer.block([(":method", "POST")])) + frame(CONTINUATION, 0, 1) * 30000)
            assert peer.frames(5, until=lambda f: f.kind == wire.GOAWAY)[-1].error == "ENHANCE_YOUR_CALM"
        with attacker(h2_target) as peer:
            peer.try_send(frame(HEADERS, 0, 1, b"\x00\x01a\x01b") + frame(CONTINUATION, 0, 1, b"\x00\x01a\x01b") * 30000)
            assert peer.frames(5, until=lambda f: f.kind == wire.GOAWAY)[-1].error == "ENHANCE_YOUR_CALM"
        with attacker(h2_target) as peer:
            peer.try_send(frame(HEADERS, 0, 1, b"\x00\x01a\x01b")
                          + frame(CONTINUATION, 0, 1, b"\x00\x01a\x82" + bytes(2) + b"\x00\x01a" + bytes(16000)) * 10)
            assert peer.frames(5, until=lambda f: f.kind == wire.GOAWAY)[-1].error == "ENHANCE_YOUR_CALM"
    watch.check(16 * MiB)
    assert defences_after(h2_target, before, "empty_frames") == 1
    assert defences_after(h2_target, before, "continuation_flood") == 2
    healthy(h2_target)


@pytest.mark.parametrize("flood, defence", [
    (lambda p: frame(wire.PRIORITY, 0, 1, b"\x00\x00\x00\x03\x10") * 1000, "priority_flood"),
    (lambda p: frame(wire.WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big")) * 1000, "window_update_flood"),
    (lambda p: p.headers(1, PROCESS) + frame(DATA, 0, 1) * 1000, "empty_frames"),
    (lambda p: frame(SETTINGS, 0, 0, bytes(6 * 40)), "settings_flood"),
], ids=["priority", "window-update", "empty-data", "settings-entries"])
def test_frames_that_make_no_progress_end_the_connection(h2_target, flood, defence):
    """PRIORITY churn (CVE-2019-9513), WINDOW_UPDATE and empty DATA floods (CVE-2019-9518), a
    SETTINGS frame of many entries: GOAWAY ENHANCE_YOUR_CALM."""
    before = h2_target.defences()
    with Watch(h2_target) as watch, attacker(h2_target) as peer:
        peer.try_send(flood(peer))
        assert peer.frames(5, until=lambda f: f.kind == wire.GOAWAY)[-1].error == "ENHANCE_YOUR_CALM"
    watch.check(16 * MiB)
    assert defences_after(h2_target, before, defence) == 1
    healthy(h2_target)


def test_silent_connections_are_closed_by_the_timeouts(h2_target):
    """500 connections sending nothing, 100 the magic only, 100 the whole preface without
    acknowledging the server's SETTINGS, 100 idle after a full handshake: each closed by its
    timeout (preface 10 s, SETTINGS 10 s, idle 5 s in this filter, whichever comes first), the file
    descriptors given back."""
    import psutil

    process = psutil.Process(h2_target.filter.popen.pid)
    fds = process.num_fds()
    before = h2_target.defences()
    with Watch(h2_target) as watch:
        silent = [socket.create_connection(("127.0.0.1", h2_target.port)) for _ in range(500)]
        magic = [socket.create_connection(("127.0.0.1", h2_target.port)) for _ in range(100)]
        for s in magic:
            s.sendall(wire.PREFACE)
        unacked = [Peer(h2_target.port) for _ in range(100)]
        idle = [attacker(h2_target) for _ in range(100)]
        wait_for(lambda: process.num_fds() > fds + 700, "the connections open", 10)
        wait_for(lambda: process.num_fds() <= fds + 5, "the connections closed", 40)
    watch.check(32 * MiB)
    got = h2_target.defences()
    assert got.get("preface_timeout", 0) - before.get("preface_timeout", 0) == 600
    # The SETTINGS never acknowledged and the idle ones: whichever timeout comes first (idle, here).
    closed = sum(got.get(k, 0) - before.get(k, 0) for k in ("settings_timeout", "idle_timeout"))
    assert closed >= 200
    for s in silent + magic:
        s.close()
    for p in unacked + idle:
        p.close()
    healthy(h2_target)


def test_envoys_own_traffic_triggers_no_defence(h2_target):
    """The filter's bounds leave Envoy alone: streamed and buffered requests, refusals, and clients
    that leave mid-stream (Envoy then resets the ext_proc stream) count nothing but idle closes."""
    before = h2_target.defences()
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "word " * 50}]}
    with httpx.Client(base_url=h2_target.envoy_url, timeout=30) as client:
        for i in range(30):
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert client.post("/v1/chat/completions", json={**body, "stream": True}).status_code == 200
            assert client.post("/v1/chat/completions", json={"model": "qwen3", "messages": 1}).status_code == 400
            assert client.get("/v1/models").status_code == 200
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                next(r.iter_bytes())  # and leave
    after = h2_target.defences()
    acted = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) and k != "idle_timeout"}
    assert not acted, acted
