"""A raw HTTP/2 peer for the ext_proc port's conformance and attack tests: it sends any frame,
well formed or not, and reads what the server answers, frame by frame.

Blocking sockets, one connection per ``Peer``; header blocks are encoded and decoded with the
``hpack`` package, each direction's table kept as a conforming peer keeps it.
"""

from __future__ import annotations

import os
import socket
import ssl
import time
from dataclasses import dataclass

from hpack import Decoder, Encoder

from derender.extproc.http2 import wire
from derender.extproc.http2.wire import frame

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH = "/grpc.health.v1.Health/Check"
ERRORS = {v: k for k, v in vars(wire).items() if k.isupper() and k.endswith(("_ERROR", "_STREAM", "_CALM", "_TIMEOUT",
                                                                               "_CLOSED", "NO_ERROR", "CANCEL"))
          and k not in ("RST_STREAM", "END_STREAM", "LAST_STREAM") and isinstance(v, int)}
NAMES = {wire.DATA: "DATA", wire.HEADERS: "HEADERS", wire.PRIORITY: "PRIORITY", wire.RST_STREAM: "RST_STREAM",
         wire.SETTINGS: "SETTINGS", wire.PUSH_PROMISE: "PUSH_PROMISE", wire.PING: "PING", wire.GOAWAY: "GOAWAY",
         wire.WINDOW_UPDATE: "WINDOW_UPDATE", wire.CONTINUATION: "CONTINUATION"}


class Closed(Exception):
    """The server closed the connection."""


@dataclass
class Frame:
    kind: int
    flags: int
    stream: int
    payload: bytes
    fields: list | None = None  # a header block's decoded fields (HEADERS with its CONTINUATIONs)

    def __repr__(self) -> str:
        name = NAMES.get(self.kind, str(self.kind))
        extra = ""
        if self.kind in (wire.RST_STREAM, wire.GOAWAY):
            extra = " " + self.error
        elif self.fields is not None:
            extra = " " + repr(self.fields)
        return f"<{name} s={self.stream} f={self.flags:#x} len={len(self.payload)}{extra}>"

    @property
    def error(self) -> str:
        code = int.from_bytes(self.payload[-4:] if self.kind == wire.RST_STREAM else self.payload[4:8], "big")
        return ERRORS.get(code, str(code))

    def field(self, name: str) -> str | None:
        for k, v in self.fields or ():
            if k == name:
                return v
        return None


def grpc_message(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


def request_fields(path: str = HEALTH, extra: list | None = None) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "derender"),
            ("content-type", "application/grpc"), ("te", "trailers"), *(extra or [])]


class Frames:
    """A peer's frames out: its HPACK encoder and its stream ids."""

    def __init__(self) -> None:
        self.encoder = Encoder()
        self.next_stream = 1

    def stream_id(self) -> int:
        sid, self.next_stream = self.next_stream, self.next_stream + 2
        return sid

    def block(self, fields: list[tuple[str, str]]) -> bytes:
        return self.encoder.encode(fields)

    def headers(self, stream_id: int, path: str = HEALTH, end_stream: bool = False, extra: list | None = None,
                fields: list | None = None, flags: int = wire.END_HEADERS) -> bytes:
        block = self.block(fields if fields is not None else request_fields(path, extra))
        return frame(wire.HEADERS, flags | (wire.END_STREAM if end_stream else 0), stream_id, block)

    def message(self, stream_id: int, message: bytes, end_stream: bool = True) -> bytes:
        return frame(wire.DATA, wire.END_STREAM if end_stream else 0, stream_id, grpc_message(message))


class Peer(Frames):
    """One connection to the server, the preface already sent unless ``preface=False``."""

    def __init__(self, port: int, host: str = "127.0.0.1", preface: bool = True, settings: bytes = b"",
                 tls: ssl.SSLContext | None = None, rcvbuf: int | None = None, timeout: float = 5.0) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connecting: the window the kernel offers is fixed then
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(timeout)
        sock.connect((host, port))
        self.sock = tls.wrap_socket(sock, server_hostname="localhost") if tls is not None else sock
        super().__init__()
        self.decoder = Decoder()
        self.buffer = b""
        self.received: list[Frame] = []
        self.closed = False
        if preface:
            self.send(wire.PREFACE + frame(wire.SETTINGS, 0, 0, settings))

    # -- sending -------------------------------------------------------------------------------
    def send(self, *data: bytes) -> None:
        self.sock.sendall(b"".join(data))

    def try_send(self, *data: bytes) -> bool:
        """Send, or False once the server has closed the connection."""
        try:
            self.send(*data)
            return True
        except OSError:
            return False

    # -- receiving -----------------------------------------------------------------------------
    def _read(self, deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(1 << 20)
        except (socket.timeout, TimeoutError, BlockingIOError):
            return False
        except (ConnectionResetError, ssl.SSLError, OSError):
            data = b""
        if not data:
            self.closed = True
            raise Closed()
        self.buffer += data
        return True

    def read_frame(self, timeout: float = 5.0) -> Frame | None:
        """The next frame (a header block decoded with its CONTINUATIONs), None after ``timeout``;
        ``Closed`` once the server closed the connection."""
        deadline = time.monotonic() + timeout
        while True:
            if len(self.buffer) >= 9:
                length = int.from_bytes(self.buffer[:3], "big")
                if len(self.buffer) >= 9 + length:
                    f = Frame(self.buffer[3], self.buffer[4], int.from_bytes(self.buffer[5:9], "big") & 0x7FFFFFFF,
                              self.buffer[9:9 + length])
                    self.buffer = self.buffer[9 + length:]
                    if f.kind == wire.HEADERS:
                        self._header_block(f, deadline)
                    self.received.append(f)
                    return f
            if self.closed:
                raise Closed()
            if not self._read(deadline):
                return None

    def _header_block(self, first: Frame, deadline: float) -> None:
        block, flags = first.payload, first.flags
        while not flags & wire.END_HEADERS:
            nxt = self.read_frame(max(0.01, deadline - time.monotonic()))
            if nxt is None or nxt.kind != wire.CONTINUATION:
                raise AssertionError(f"header block interrupted by {nxt}")
            block += nxt.payload
            flags = nxt.flags
        first.fields = [(k.decode(), v.decode("latin-1")) for k, v in self.decoder.decode(block, raw=True)]

    def frames(self, timeout: float = 2.0, until=None) -> list[Frame]:
        """Frames until ``until(frame)`` is true, the connection closes, or ``timeout`` passes."""
        out = []
        deadline = time.monotonic() + timeout
        try:
            while True:
                f = self.read_frame(max(0.0, deadline - time.monotonic()))
                if f is None:
                    return out
                out.append(f)
                if until is not None and until(f):
                    return out
        except Closed:
            return out

    def handshake(self, timeout: float = 5.0) -> list[Frame]:
        """Read the server's SETTINGS (and whatever comes with it), acknowledge them, and see our ACK come back."""
        seen = self.frames(timeout, until=lambda f: f.kind == wire.SETTINGS and f.flags & wire.ACK)
        if any(f.kind == wire.SETTINGS and not f.flags & wire.ACK for f in seen):
            self.send(frame(wire.SETTINGS, wire.ACK, 0))
        return seen

    @classmethod
    def connect(cls, port: int, **options) -> "Peer":
        """A connection whose preface and SETTINGS are exchanged."""
        peer = cls(port, **options)
        peer.handshake()
        return peer

    def serving(self, timeout: float = 5.0) -> bool:
        """A health check on a new stream of this connection is answered SERVING (status 0)."""
        sid = self.stream_id()
        if not self.try_send(self.headers(sid, HEALTH), self.message(sid, b"")):
            return False
        seen = self.frames(timeout, until=lambda f: f.kind == wire.HEADERS and f.stream == sid
                           and f.flags & wire.END_STREAM)
        return bool(seen) and seen[-1].field("grpc-status") == "0" and any(
            f.kind == wire.DATA and f.stream == sid and f.payload == grpc_message(b"\x08\x01") for f in seen)

    def alive(self, timeout: float = 5.0) -> bool:
        """The connection still works: a PING gets its ACK."""
        payload = os.urandom(8)
        if not self.try_send(frame(wire.PING, 0, 0, payload)):
            return False
        seen = self.frames(timeout, until=lambda f: f.kind == wire.PING and f.flags & wire.ACK and f.payload == payload)
        return bool(seen) and seen[-1].kind == wire.PING and seen[-1].payload == payload

    def wait_closed(self, timeout: float = 5.0) -> bool:
        """Read until the server closes the connection; False if it is still open after ``timeout``."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.read_frame(max(0.0, deadline - time.monotonic())) is None:
                    break
        except Closed:
            return True
        return False

    def goaway(self) -> Frame | None:
        return next((f for f in self.received if f.kind == wire.GOAWAY), None)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serving(port: int, timeout: float = 5.0) -> bool:
    """A health check on a new connection to ``port`` is answered SERVING (False if it cannot connect)."""
    try:
        with Peer(port, timeout=timeout) as peer:
            peer.handshake(timeout)
            return peer.serving(timeout)
    except (OSError, Closed):
        return False
