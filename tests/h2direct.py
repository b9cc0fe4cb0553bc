"""Peers for the HTTP/2 limit tests without a thread.

``Direct``: a peer whose other end is a ``Machine`` in memory (the protocol without I/O) on a clock
the test moves: what the peer sends is received at once, what the machine writes is read back as
frames, and its events are kept. The test plays the handlers through the machine's own calls
(``read``, ``send``, ``finish``, ``handler_done``).

``Socket``: a raw peer on a non-blocking socket, for what only a socket shows (paused reads,
refused connections), driven from the event loop that also runs the server.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter

from h2peer import Closed, Frame, Frames, Peer
from hpack import Decoder

from derender.extproc import http2
from derender.extproc.http2 import events, wire
from derender.extproc.http2.wire import frame


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Direct(Peer):
    def __init__(self, limits: http2.Limits, budget: http2.Budget | None = None, paths=("/t/echo",),
                 preface: bool = True, settings: bytes = b"", handshake: bool = True) -> None:
        Frames.__init__(self)
        self.decoder = Decoder()
        self.buffer = b""
        self.received: list[Frame] = []
        self.closed = False
        self.closing = False
        self.clock = Clock()
        self.machine = http2.Machine(limits, budget or http2.Budget(limits.max_buffered_total), paths, self.clock)
        self.events: list = []
        self.machine.initiate()
        if preface:
            self.send(wire.PREFACE + frame(wire.SETTINGS, 0, 0, settings))
            if handshake:
                self.handshake()

    def send(self, *data: bytes) -> None:
        self.machine.receive(b"".join(data))
        self._collect()

    def _collect(self) -> None:
        self.buffer += self.machine.data_to_send()
        for stream_id, item in self.machine.handed:
            self.events.append(events.Message(stream_id, item))
        self.machine.handed.clear()
        machine_events = self.machine.events
        while machine_events:
            event = machine_events.popleft()
            self.events.append(event)
            if isinstance(event, events.Close):
                self.closing = True

    def _read(self, deadline: float) -> bool:
        before = len(self.buffer)
        self._collect()
        if len(self.buffer) > before:
            return True
        if self.closing:
            self.closed = True
            raise Closed()
        return False

    def close(self) -> None:
        pass

    def wait_closed(self, timeout: float = 0.0) -> bool:
        """Whether the machine closed the connection (after the frames it wrote, read here)."""
        try:
            while self.read_frame(0) is not None:
                pass
        except Closed:
            return True
        return False

    # -- the test's hands ----------------------------------------------------------------------------
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        self.machine.tick(self.clock.now)
        self._collect()

    def call(self, fn, *args):
        """One of the machine's calls, as a handler makes it; what it writes and says is collected."""
        out = fn(*args)
        self._collect()
        return out

    def seen(self, kind) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def defences(self) -> Counter:
        return Counter(e.name for e in self.seen(events.Defended))

    def opened(self) -> list[int]:
        return [e.stream_id for e in self.seen(events.Opened)]

    def handed(self, stream_id: int) -> list:
        return [e.item for e in self.seen(events.Message) if e.stream_id == stream_id]


class Socket(Frames):
    """A raw peer on a non-blocking socket of the running event loop; ``pump`` reads what came, then
    ``frames`` parses it as ``Peer`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.reader = Peer.__new__(Peer)  # Peer's frame parser over our buffer
        self.reader.decoder = Decoder()
        self.reader.buffer = b""
        self.reader.received = []
        self.reader.closed = False
        self.reader._read = lambda deadline: False
        self.sock: socket.socket | None = None
        self.eof = False

    @classmethod
    async def connect(cls, port: int | str, rcvbuf: int | None = None, settings: bytes = b"") -> Socket:
        """To ``port`` on loopback, or to the Unix socket at ``port`` if it is a path."""
        peer = cls()
        unix = isinstance(port, str)
        sock = peer.sock = socket.socket(socket.AF_UNIX if unix else socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connecting: the window the kernel offers is fixed then
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, port if unix else ("127.0.0.1", port))
        await peer.send(wire.PREFACE + frame(wire.SETTINGS, 0, 0, settings))
        return peer

    async def send(self, *data: bytes, timeout: float = 5.0) -> bool:
        """Send; False if the server stopped reading for ``timeout`` or closed the connection."""
        assert self.sock is not None
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_sendall(self.sock, b"".join(data)), timeout)
            return True
        except (TimeoutError, OSError):
            return False

    async def pump(self, timeout: float) -> None:
        """Read what the server sends for ``timeout`` seconds, or until it closes the connection."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.eof and (left := deadline - loop.time()) > 0:
            try:
                data = await asyncio.wait_for(loop.sock_recv(self.sock, 1 << 20), left)
            except TimeoutError:
                return
            except OSError:
                data = b""
            if not data:
                self.eof = True
            self.reader.buffer += data

    def frames(self) -> list[Frame]:
        return self.reader.frames(0)

    def goaway(self) -> Frame | None:
        return self.reader.goaway()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
