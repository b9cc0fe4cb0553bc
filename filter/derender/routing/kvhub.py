"""One subscriber per filter process: the hub reads every producer's KV cache events once and relays
them to the process's workers, decoded and named (``derender serve --routing kv-events``).

Each worker used to subscribe itself: every worker decoded every batch with vLLM's msgpack types and
named every stored block (``kvnames.Namer``), 8.8 us an event of 4 blocks on the worker's own loop
(``bench/kv_events.py``). The hub, a process of its own forked with the workers, does that once; a
worker only applies what it relays: blocks already in vLLM's external form and their names, to its
``KvIndex`` and its names (``KvRouting.relayed``). The view stays in each worker (a decision reads
it without leaving the process), so it is the same in every worker and every filter process fed
the same events.

The channel is a Unix socket in a folder only the filter's user can enter. A frame is 4 bytes of
length (big-endian) and ``marshal`` data. A worker sends one frame, its subscriptions
(``[(replica, endpoint, replay, topic, block_size), ...]``); the hub answers with frames of batches,
``[(replica, ops, batches), ...]`` (``batches``: how many of the replica's batches the ops stand for), each op ``(STORED, blocks, names or None)``, ``(REMOVED, blocks)``,
``(CLEARED,)`` or ``(LEFT,)`` (the hub's feed left the index: a flood). A worker that subscribes
after the events began first gets what the hub knows of each replica (``CLEARED``, then its blocks).
A worker that reads too slowly (``MAX_UNREAD`` bytes waiting) is disconnected, and connects again
for a fresh copy. If the hub cannot be reached or its connection ends, the worker reads the
producers' events itself, as without a hub (its feeds learn the history from the replay sockets).
"""

from __future__ import annotations

import asyncio
import logging
import marshal
import os
import signal
import socket
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Protocol

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from .kvfeed import Feed, FeedSpec, Standing
from .kvindex import MASK, KvIndex, external
from .kvnames import Namer

log = logging.getLogger("derender.kvevents")

STORED, REMOVED, CLEARED, LEFT = 1, 2, 3, 4
MAX_SUBSCRIBE = 1 << 20  # bytes of a worker's subscriptions
SUBSCRIBE_S = 10.0  # seconds a connection may take to send them
MAX_FRAME = 256 << 20  # bytes of one frame from the hub (a snapshot of a full index: ~30 MB)
MAX_UNREAD = 64 << 20  # bytes a worker leaves unread before the hub disconnects it
CHECK_S = 1.0  # a worker checks its replicas' standing (stale: ``Standing.check``) this often


def frame(value: Any) -> bytes:
    data = marshal.dumps(value)
    return len(data).to_bytes(4, "big") + data


def blocks_of(hashes: Sequence[object]) -> list[int]:
    return [h & MASK if type(h) is int else external(h) for h in hashes]


class Relay:
    """The hub's ``kvfeed.Sink`` for the replicas of one block size: names the stored blocks, keeps
    what each replica holds (for a late subscriber's copy) and hands each batch's ops to the hub."""

    def __init__(self, hub: Hub, block_size: int, max_blocks: int = 1 << 20) -> None:
        self.hub = hub
        self.block_size = block_size
        self.index = KvIndex(max_blocks)
        self.namer = Namer(block_size, max_blocks)
        self.batches: dict[str, int] = {}  # replica -> batches applied (what a copy of it stands for)

    @property
    def entries(self) -> int:
        return self.index.entries

    def apply(self, replica: str, events: list) -> None:
        ops: list[tuple] = []
        index, learn = self.index, self.namer.learn
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                names = learn(event)
                blocks = blocks_of(event.block_hashes)
                index.stored(replica, blocks)
                ops.append((STORED, blocks, names))
            elif kind is BlockRemoved:
                blocks = blocks_of(event.block_hashes)
                index.removed(replica, blocks)
                ops.append((REMOVED, blocks))
            elif kind is AllBlocksCleared:
                index.cleared(replica)
                ops.append((CLEARED,))
        self.batches[replica] = self.batches.get(replica, 0) + 1
        self.hub.send(self.block_size, replica, ops, 1)  # no ops: the replica is alive all the same

    def cleared(self, replica: str) -> None:
        self.index.cleared(replica)
        self.hub.send(self.block_size, replica, [(CLEARED,)], 0)

    def left(self, replica: str) -> None:
        self.index.cleared(replica)
        self.hub.send(self.block_size, replica, [(LEFT,)], 0)

    def snapshot(self, replica: str, in_index: bool) -> list[tuple]:
        """What the hub knows of ``replica``, as ops for a worker that knows nothing of it yet."""
        if not in_index:
            return [(LEFT,)]
        bit, name_of = self.index.bit(replica), self.namer.name_of
        named: list[int] = []
        names: list[int] = []
        plain: list[int] = []
        for block, owners in self.index.holders.items():
            if owners & bit:
                name = name_of.get(block)
                if name is None:
                    plain.append(block)
                else:
                    named.append(block)
                    names.append(name)
        ops: list[tuple] = [(CLEARED,)]
        if named:
            ops.append((STORED, named, names))
        if plain:
            ops.append((STORED, plain, None))
        return ops


class Subscriber:
    """One worker's connection: the batches for it, sent once per turn of the hub's loop."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.pending: list[tuple[str, list, int]] = []
        self.closed = False

    def add(self, replica: str, ops: list, batches: int) -> None:
        if self.closed:
            return
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self.pending.append((replica, ops, batches))

    def flush(self) -> None:
        if self.closed or not self.pending:
            return
        pending, self.pending = self.pending, []
        self.writer.write(frame(pending))
        if self.writer.transport.get_write_buffer_size() > MAX_UNREAD:
            log.warning("kv-events hub: a worker left %d bytes unread; disconnected", MAX_UNREAD)
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.transport.abort()


class Hub:
    """The feeds of every replica any worker subscribes to, each read once (``kvfeed.Feed``)."""

    def __init__(self, max_blocks: int = 1 << 20) -> None:
        self.max_blocks = max_blocks
        self.relays: dict[int, Relay] = {}  # by block size
        self.feeds: dict[tuple[int, str], Feed] = {}  # (block size, replica) -> its feed
        self.subscribers: dict[tuple[int, str], list[Subscriber]] = {}

    def send(self, block_size: int, replica: str, ops: list, batches: int) -> None:
        for subscriber in self.subscribers.get((block_size, replica), ()):
            subscriber.add(replica, ops, batches)

    def subscribe(self, subscriber: Subscriber, wanted: object) -> None:
        if not isinstance(wanted, list):
            raise TypeError("subscriptions are a list")
        for item in wanted:
            replica, endpoint, replay, topic, size = item
            if not (isinstance(replica, str) and isinstance(endpoint, str) and isinstance(topic, str)):
                raise TypeError("a subscription is (replica, endpoint, replay, topic, block size)")
            if not (replay is None or isinstance(replay, str)) or not isinstance(size, int) or size < 1:
                raise ValueError("a subscription is (replica, endpoint, replay, topic, block size)")
            key = (size, replica)
            feed = self.feeds.get(key)
            if feed is None:
                relay = self.relays.get(size) or self.relays.setdefault(size, Relay(self, size, self.max_blocks))
                feed = self.feeds[key] = Feed(FeedSpec(replica, endpoint, replay, topic), relay, block_size=size)
                feed.start()
            else:
                relay = self.relays[size]
                subscriber.add(replica, relay.snapshot(replica, feed.in_index), relay.batches.get(replica, 0))
            self.subscribers.setdefault(key, []).append(subscriber)

    async def connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        subscriber = Subscriber(writer)
        try:
            wanted = await asyncio.wait_for(self._subscriptions(reader), SUBSCRIBE_S)
            self.subscribe(subscriber, wanted)
            await reader.read(1)  # a worker sends nothing more: until it goes
        except (OSError, EOFError, ValueError, TypeError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.warning("kv-events hub: a worker's connection ended: %s", exc or type(exc).__name__)
        finally:
            for subscribers in self.subscribers.values():
                if subscriber in subscribers:
                    subscribers.remove(subscriber)
            subscriber.close()

    @staticmethod
    async def _subscriptions(reader: asyncio.StreamReader) -> object:
        size = int.from_bytes(await reader.readexactly(4), "big")
        if size > MAX_SUBSCRIBE:
            raise ValueError(f"subscriptions of {size} bytes")
        return marshal.loads(await reader.readexactly(size))

    async def serve(self, sock: socket.socket) -> None:
        server = await asyncio.start_unix_server(self.connected, sock=sock)
        async with server:
            await server.serve_forever()


def start() -> tuple[str, int]:
    """Fork the hub (before the workers); its socket's path and its pid. Its socket is bound and
    listening before this returns, so a worker's first connection is never refused."""
    folder = tempfile.mkdtemp(prefix="derender-kv-hub-")  # 0700: only this user
    path = os.path.join(folder, "hub.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(64)
    parent = os.getpid()
    pid = os.fork()
    if pid:
        sock.close()
        log.info("kv-events hub: pid %d reads the producers' events for the workers (%s)", pid, path)
        return path, pid
    code = 0
    try:  # the hub: never returns into the parent's code
        from ..extproc.workers import _die_with_parent, new_event_loop

        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        _die_with_parent()
        if os.getppid() != parent:
            os._exit(0)
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(Hub().serve(sock))
    except BaseException:
        log.exception("kv-events hub failed")
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)


class Relayed(Protocol):
    """What a worker's client feeds (``kvroute.KvRouting``)."""

    specs: list[FeedSpec]
    hasher: Any
    feeds: Any

    def relayed(self, batches: list) -> None: ...

    def read_feeds(self) -> dict[str, Feed]: ...


class HubClient:
    """A worker's connection to its process's hub."""

    def __init__(self, path: str, routing: Relayed) -> None:
        self.path = path
        self.routing = routing
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._run(), name="kv-events hub"), loop.create_task(self._check())]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []

    async def _check(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            now = time.monotonic()
            for standing in list(self.routing.feeds.values()):
                standing.check(now)

    async def _run(self) -> None:
        routing = self.routing
        size = routing.hasher.block_size
        try:
            reader, writer = await asyncio.open_unix_connection(self.path)
        except OSError as exc:
            self._alone(f"cannot reach the hub ({exc})")
            return
        why = "the hub closed the connection"
        try:
            writer.write(frame([(s.replica, s.endpoint, s.replay, s.topic, size) for s in routing.specs]))
            while True:
                length = int.from_bytes(await reader.readexactly(4), "big")
                if length > MAX_FRAME:
                    raise ValueError(f"a frame of {length} bytes")
                routing.relayed(marshal.loads(await reader.readexactly(length)))
        except asyncio.IncompleteReadError:
            pass
        except (OSError, EOFError, ValueError, TypeError) as exc:
            why = f"the hub's connection failed ({exc})"
        finally:
            writer.close()
        self._alone(why)

    def _alone(self, why: str) -> None:
        """The hub is gone: this worker reads the events itself from now on."""
        log.warning("kv-events routing: %s; this worker reads the producers' events itself", why)
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        for standing in self.routing.feeds.values():
            if isinstance(standing, Standing):
                standing.sink.cleared(standing.replica)
        for feed in self.routing.read_feeds().values():
            feed.start()
