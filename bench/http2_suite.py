"""The ext_proc port's conformance cases and attacks against both transports, side by side.

    .venv/bin/python bench/http2_suite.py --out docs/ext-proc-port.md

Starts the simulator and a filter per transport (``--transport http2``, the default, and
``--transport grpcio``, each one worker with the filter's own limits), then runs on raw frames every
case of ``tests/h2cases.py`` (h2spec's sections of RFC 9113 and RFC 7541, and the bounds that answer
at once) and the attacks of ``tests/test_http2_attacks.py``, each on fresh connections: what the
server did, its peak memory growth (RSS, sampled every 20 ms), and whether a health check on another
connection was answered during the attack. With ``--out``, the table replaces the part of that page
between its ``suite`` markers.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from h2cases import CASES, run  # noqa: E402
from h2peer import HEALTH, PROCESS, Peer, serving  # noqa: E402
from stack import PeakRss, start_target  # noqa: E402

from derender.extproc.http2 import wire  # noqa: E402
from derender.extproc.http2.wire import CONTINUATION, DATA, HEADERS, PING, RST_STREAM, SETTINGS, frame  # noqa: E402
from derender.ops import assets  # noqa: E402

MiB = 1 << 20
BEGIN, END = "<!-- suite: begin (bench/http2_suite.py) -->", "<!-- suite: end -->"


def server_said(peer: Peer, wait: float = 5.0) -> str:
    """GOAWAY's code, or how the connection ended, after an attack."""
    seen = peer.frames(wait, until=lambda f: f.kind == wire.GOAWAY)
    goaway = next((f for f in seen + peer.received if f.kind == wire.GOAWAY), None)
    if goaway is not None:
        return f"GOAWAY {goaway.error}" + (", closed" if peer.wait_closed(3) else ", left open")
    return "closed without GOAWAY" if peer.closed else "nothing, connection open"


def flood(port: int, data: bytes, rcvbuf: int | None = None, total: int = 1, wait: float = 5.0) -> str:
    with Peer.connect(port, rcvbuf=rcvbuf) as peer:
        for _ in range(total):
            if not peer.try_send(data):
                break
        return server_said(peer, wait)


def stream_flood(port: int) -> str:
    with Peer.connect(port) as peer:
        peer.try_send(b"".join(peer.headers(peer.stream_id(), PROCESS) for _ in range(5000)))
        seen = peer.frames(5, until=lambda f: f.kind == wire.GOAWAY)
        refused = sum(1 for f in seen if f.kind == RST_STREAM)
        return f"{refused} refused, {server_said(peer, 1)}"


def pairs(port: int, second) -> str:
    with Peer.connect(port) as peer:
        chunk = b""
        for _ in range(2000):
            sid = peer.stream_id()
            chunk += peer.headers(sid, PROCESS) + second(sid)
        for _ in range(100):  # 200,000 pairs
            if not peer.try_send(chunk):
                break
        return server_said(peer)


def big_messages(port: int, size: int, count: int, send: int) -> str:
    with Peer.connect(port) as peer:
        sids = [peer.stream_id() for _ in range(count)]
        chunk = bytes(16000)
        peer.send(*(peer.headers(sid, PROCESS) for sid in sids))
        peer.send(*(frame(DATA, 0, sid, b"\x00" + size.to_bytes(4, "big") + chunk) for sid in sids))
        for _ in range(send // 16000):
            if not peer.try_send(*(frame(DATA, 0, sid, chunk) for sid in sids)):
                break
        refused = sum(1 for f in peer.frames(3) if f.kind == HEADERS and f.field("grpc-status") == "8")
        return f"{refused} of {count} refused RESOURCE_EXHAUSTED" + ("" if peer.alive() else ", connection lost")


def silent_connections(port: int) -> str:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(500)]
    for s in socks:
        s.setblocking(False)
    open_ = set(socks)
    started = time.monotonic()
    closed_at = None
    while time.monotonic() - started < 75:
        time.sleep(1)
        for s in list(open_):
            try:
                while s.recv(65536):  # what the server sent (its SETTINGS, a GOAWAY), read and dropped
                    pass
                open_.discard(s)  # end of stream: closed by the server
            except BlockingIOError:
                pass
            except OSError:
                open_.discard(s)
        if not open_:
            closed_at = time.monotonic() - started
            break
    for s in socks:
        s.close()
    return f"all closed after {closed_at:.0f} s" if closed_at else "still open after 75 s"


def mixed_streams(port: int) -> str:
    """A non-UTF-8 header value on one stream beside a health check on another."""
    with Peer.connect(port) as peer:
        bad, good = peer.stream_id(), peer.stream_id()
        block = peer.block([(":method", "POST"), (":scheme", "http"), (":path", HEALTH), (":authority", "x"),
                            ("content-type", "application/grpc"), ("te", "trailers")]) + b"\x00\x06x-bin1\x02\xff\xfe"
        peer.send(frame(HEADERS, wire.END_HEADERS, bad, block), peer.message(bad, b""),
                  peer.headers(good, HEALTH), peer.message(good, b""))
        seen = peer.frames(3, until=lambda f: f.kind == HEADERS and f.stream == good and f.flags & wire.END_STREAM)
        other = any(f.kind == HEADERS and f.stream == good and f.field("grpc-status") == "0" for f in seen)
        first = any(f.kind == HEADERS and f.stream == bad and f.field("grpc-status") == "0" for f in seen + peer.received)
        return f"that stream {'answered' if first else 'refused'}, the other {'answered' if other else 'lost'}"


def empty_data(port: int) -> str:
    with Peer.connect(port) as peer:
        peer.try_send(peer.headers(1, PROCESS) + frame(DATA, 0, 1) * 1000)
        return server_said(peer)


ATTACKS = [
    ("5,000 HEADERS without DATA (stream flood)", stream_flood),
    ("200,000 HEADERS + RST_STREAM (Rapid Reset, CVE-2023-44487)",
     lambda p: pairs(p, lambda sid: frame(RST_STREAM, 0, sid, wire.CANCEL.to_bytes(4, "big")))),
    ("200,000 HEADERS + WINDOW_UPDATE 0 (MadeYouReset, CVE-2025-8671)",
     lambda p: pairs(p, lambda sid: frame(wire.WINDOW_UPDATE, 0, sid, bytes(4)))),
    ("4 messages announcing 200 MiB", lambda p: big_messages(p, 200 * MiB, 4, 0)),
    ("10 messages of 16 MiB, 8 MiB of each sent", lambda p: big_messages(p, 16 * MiB, 10, 8 * MiB)),
    ("8-byte PINGs, never reading the ACKs (CVE-2019-9512)",
     lambda p: flood(p, frame(PING, 0, 0, bytes(8)) * 4096, rcvbuf=4096, total=1000, wait=20)),
    ("1 MiB PINGs", lambda p: flood(p, frame(PING, 0, 0, bytes(MiB)), rcvbuf=4096, total=300, wait=20)),
    ("empty SETTINGS, never reading the ACKs (CVE-2019-9515)",
     lambda p: flood(p, frame(SETTINGS, 0, 0) * 4096, rcvbuf=4096, total=1000, wait=20)),
    ("30,000 empty CONTINUATION frames (2024 CONTINUATION flood)",
     lambda p: flood(p, frame(HEADERS, 0, 1, b"\x82") + frame(CONTINUATION, 0, 1) * 30000)),
    ("CONTINUATION frames of 16 KB without end", lambda p: flood(
        p, frame(HEADERS, 0, 1, b"\x82") + frame(CONTINUATION, 0, 1, b"\x00\x01a\x7f\x81\x7f" + bytes(16000)) * 200)),
    ("1,000 PRIORITY frames (CVE-2019-9513)", lambda p: flood(p, frame(wire.PRIORITY, 0, 1, b"\x00\x00\x00\x03\x10") * 1000)),
    ("1,000 WINDOW_UPDATE frames", lambda p: flood(p, frame(wire.WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big")) * 1000)),
    ("1,000 empty DATA frames (CVE-2019-9518)", empty_data),
    ("a 16,385-byte frame", lambda p: flood(p, frame(DATA, 0, 1, bytes(16385)))),
    ("a non-UTF-8 header value beside another stream", mixed_streams),
    ("500 connections sending nothing", silent_connections),
]


class Peak:
    """While an attack runs: the server's peak RSS (``stack.PeakRss``) and a health check on another
    connection every 0.5 s."""

    def __init__(self, target) -> None:
        self.target = target
        self.rss = PeakRss(target.filter.popen.pid)
        self.stop = threading.Event()
        self.health: list[bool] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.health.append(serving(self.target.port))
            if self.stop.wait(0.5):
                return

    def done(self) -> tuple[float, bool]:
        self.stop.set()
        self.thread.join(10)
        return self.rss.stop() / MiB, all(self.health) and bool(self.health)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="a page with the suite's markers to write the tables into")
    args = parser.parse_args()
    model = str(assets.fetch("qwen3"))
    transports = ("http2", "grpcio")
    cases: dict[str, list[str]] = {}
    attacks: dict[str, list[str]] = {}
    for transport in transports:
        target = start_target(model, transport=transport)
        try:
            for case in CASES:
                cases.setdefault(f"{case.section}|{case.title}|{case.expect[0]}", []).append(run(case, target.port))
            for name, attack in ATTACKS:
                peak = Peak(target)
                try:
                    said = attack(target.port)
                except OSError as exc:
                    said = f"{type(exc).__name__}"
                grew, served = peak.done()
                attacks.setdefault(name, []).append(
                    f"{said}; +{grew:.0f} MiB; {'others served' if served else 'others NOT served'}")
                print(f"{transport}: {name}: {attacks[name][-1]}", flush=True)
        finally:
            target.stop()
    expected = {f"{c.section}|{c.title}|{c.expect[0]}": c.expect for c in CASES}
    passed = {t: sum(1 for k, got in cases.items() if got[i] in expected[k]) for i, t in enumerate(transports)}
    lines = [
        BEGIN,
        f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC with "
        "`.venv/bin/python bench/http2_suite.py --out docs/ext-proc-port.md`: one filter worker per transport on "
        "loopback, its own limits (grpc.aio gets those it has: `extproc.listen.Listener.grpc_options`).",
        "",
        f"**Conformance** (RFC 9113 and RFC 7541, as h2spec's sections; a case passes when the answer is one "
        f"RFC 9113 allows): `http2` {passed['http2']} of {len(CASES)}, `grpcio` {passed['grpcio']} of {len(CASES)}.",
        "",
        "| case | expected | `http2` (the filter's) | `grpcio` (grpc.aio) |",
        "|---|---|---|---|",
    ]
    for key, got in cases.items():
        section, title, first = key.split("|")
        marks = [g if g in expected[key] else f"**{g}**" for g in got]
        lines.append(f"| {section} {title} | {first} | {marks[0]} | {marks[1]} |")
    lines += ["", "**Attacks** (what the server did; its peak memory growth; a health check on another connection "
              "every 0.5 s during the attack):", "", "| attack | `http2` (the filter's) | `grpcio` (grpc.aio) |",
              "|---|---|---|"]
    lines += [f"| {name} | {got[0]} | {got[1]} |" for name, got in attacks.items()]
    lines.append(END)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        page = Path(args.out).read_text()
        start, stop = page.index(BEGIN), page.index(END) + len(END) + 1
        Path(args.out).write_text(page[:start] + text + page[stop:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
