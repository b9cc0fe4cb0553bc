"""One subscriber per filter process: the hub reads every producer's KV cache events once and relays
them to the process's workers, decoded and keyed (``derender serve --routing kv-events``).

A worker reading the events itself decodes every batch with vLLM's msgpack types and names every
stored block (``kvnames.Namer``): about 9 us an event of 4 blocks on its own loop
(``bench/kv_events.py``), in every worker. The hub, a process of its own forked with the workers,
does that once; a worker only applies what it relays, each block already keyed as its ``KvIndex``
keys it, to the index (``KvRouting.relayed``). The view stays in each worker (a decision reads
it without leaving the process), so it is the same in every worker and every filter process fed
the same events.

The channel is a Unix socket in a folder only the filter's user can enter. A frame is 4 bytes of
length (big-endian) and ``marshal`` data. A worker sends a frame of its subscriptions
(``[(replica, endpoint, replay, topic, block_size), ...]``), then, whenever they change (at most
every ``FLUSH_S``), its requests in flight per replica (``{replica: n}``). The hub answers with
frames of ``(batches, others)``: ``batches`` is ``[(replica, ops, n), ...]`` (``n``: how many of the
replica's batches the ops stand for), each op ``(STORED, keys)``, ``(REMOVED, keys)``, ``(CLEARED,)``
or ``(LEFT,)`` (the hub's feed left the index: a flood; ``CLEARED`` or ``LEFT`` comes first, if at all); ``others`` (or None: unchanged) the other
workers' requests in flight, summed, which the load bound counts beside the worker's own
(``balance.Balancer``). A worker that subscribes after the events began first gets what the hub
knows of each replica (``CLEARED``, then its blocks). A worker that reads too slowly (``MAX_UNREAD``
bytes waiting), or sends what is not its subscriptions or loads, is disconnected.
If the hub cannot be reached or its connection ends, the worker reads the
producers' events itself, as without a hub (its feeds learn the history from the replay sockets).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import marshal
import os
import shutil
import socket
import tempfile
from typing import Any

from .kvfeed import COALESCE_S, Feed, FeedSpec
from .kvindex import CLEARED, LEFT, REMOVED, STORED, KvIndex
from .kvnames import Namer

log = logging.getLogger("derender.kvevents")

MAX_SUBSCRIBE = 1 << 20  # bytes of a worker's subscriptions
MAX_LOAD = 64 << 10  # bytes of a worker's frame of its requests in flight
MAX_REPLICAS = 4096  # replicas in one such frame
SUBSCRIBE_S = 10.0  # seconds a connection may take to send them
MAX_FRAME = 256 << 20  # bytes of one frame from the hub (a snapshot of a full index: ~30 MB)
MAX_UNREAD = 64 << 20  # bytes a worker leaves unread before the hub disconnects it
FLUSH_S = COALESCE_S  # batches wait this long for others, to share a frame and a worker's wake-up
CHECK_S = 1.0  # a worker checks its replicas' standing (stale: ``Standing.check``) this often


def frame(value: Any) -> bytes:
    data = marshal.dumps(value)
    return len(data).to_bytes(4, "big") + data


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
        ops = self.namer.ops(events)
        self.index.apply_ops(replica, ops)
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
        bit = self.index.bit(replica)
        return [(CLEARED,), (STORED, [key for key, owners in self.index.holders.items() if owners & bit])]


class Subscriber:
    """One worker's connection."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.closed = False

    def write(self, entries: list, others: dict[str, int] | None = None) -> None:
        if self.closed:
            return
        self.writer.write(frame((entries, others)))
        if self.writer.transport.get_write_buffer_size() > MAX_UNREAD:
            log.warning("kv-events hub: a worker left %d bytes unread; disconnected", MAX_UNREAD)
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.transport.abort()


class Pending:
    """A replica's ops since the last frame, netted: only the last ``CLEARED`` or ``LEFT`` counts (it
    wipes what came before), and each block's last word (stored or removed)."""

    __slots__ = ("batches", "head", "net")

    def __init__(self) -> None:
        self.head: list[tuple] = []
        self.net: dict[int, bool] = {}
        self.batches = 0

    def ops(self) -> list[tuple]:
        ops = list(self.head)
        stored = [key for key, held in self.net.items() if held]
        removed = [key for key, held in self.net.items() if not held]
        if stored:
            ops.append((STORED, stored))
        if removed:
            ops.append((REMOVED, removed))
        return ops


class Hub:
    """The feeds of every replica any worker subscribes to, each read once (``kvfeed.Feed``); what they
    bring is netted per replica and sent to the workers every ``FLUSH_S`` seconds, one frame each."""

    def __init__(self, max_blocks: int = 1 << 20) -> None:
        self.max_blocks = max_blocks
        self.relays: dict[int, Relay] = {}  # by block size
        self.feeds: dict[tuple[int, str], Feed] = {}  # (block size, replica) -> its feed
        self.subscribers: dict[tuple[int, str], list[Subscriber]] = {}
        self.pending: dict[tuple[int, str], Pending] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.loads: dict[Subscriber, dict[str, int]] = {}  # each worker's requests in flight per replica
        self.loads_changed = False

    def load(self, subscriber: Subscriber, load: object) -> None:
        """A worker's requests in flight, per replica: the others get their sum in the next frame."""
        if not isinstance(load, dict) or len(load) > MAX_REPLICAS:
            raise TypeError("a load is a mapping of replicas to requests in flight")
        if not all(isinstance(r, str) and type(n) is int and 0 <= n < 1 << 31 for r, n in load.items()):
            raise TypeError("a load is a mapping of replicas to requests in flight")
        self.loads[subscriber] = load
        self.changed()

    def changed(self) -> None:
        self.loads_changed = True
        self._soon()

    def _soon(self) -> None:
        """A frame to every worker ``FLUSH_S`` from now, with what comes meanwhile."""
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def send(self, block_size: int, replica: str, ops: list, batches: int) -> None:
        key = (block_size, replica)
        if not self.subscribers.get(key):
            return
        pending = self.pending.get(key)
        if pending is None:
            pending = self.pending[key] = Pending()
        net = pending.net
        for op in ops:
            kind = op[0]
            if kind == STORED:
                net.update(dict.fromkeys(op[1], True))
            elif kind == REMOVED:
                net.update(dict.fromkeys(op[1], False))
            else:
                pending.head = [op]
                net.clear()
        pending.batches += batches
        self._soon()

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        pending, self.pending = self.pending, {}
        frames: dict[Subscriber, list] = {}
        for key, what in pending.items():
            entry = (key[1], what.ops(), what.batches)
            for subscriber in self.subscribers.get(key, ()):
                frames.setdefault(subscriber, []).append(entry)
        if self.loads_changed:  # every worker gets the sum of the others' loads
            self.loads_changed = False
            for subscriber in self.loads:
                others: dict[str, int] = {}
                for other, load in self.loads.items():
                    if other is not subscriber:
                        for replica, n in load.items():
                            others[replica] = others.get(replica, 0) + n
                subscriber.write(frames.pop(subscriber, []), others)
        for subscriber, entries in frames.items():
            subscriber.write(entries)

    def subscribe(self, subscriber: Subscriber, wanted: object) -> None:
        if not isinstance(wanted, list):
            raise TypeError("subscriptions are a list")
        self.flush()  # what is pending goes to the others first: a copy below already holds it
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
                subscriber.write([(replica, relay.snapshot(replica, feed.in_index), relay.batches.get(replica, 0))])
            self.subscribers.setdefault(key, []).append(subscriber)

    async def connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        subscriber = Subscriber(writer)
        try:
            wanted = await asyncio.wait_for(self._read(reader, MAX_SUBSCRIBE), SUBSCRIBE_S)
            self.subscribe(subscriber, wanted)
            self.loads[subscriber] = {}
            while True:  # then its loads, until it goes
                self.load(subscriber, await self._read(reader, MAX_LOAD))
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                log.warning("kv-events hub: a worker's connection ended in a frame")
        except (OSError, EOFError, ValueError, TypeError, TimeoutError) as exc:
            log.warning("kv-events hub: a worker's connection ended: %s", exc or type(exc).__name__)
        finally:
            if self.loads.pop(subscriber, None):
                self.changed()
            for subscribers in self.subscribers.values():
                if subscriber in subscribers:
                    subscribers.remove(subscriber)
            subscriber.close()

    @staticmethod
    async def _read(reader: asyncio.StreamReader, most: int) -> object:
        size = int.from_bytes(await reader.readexactly(4), "big")
        if size > most:
            raise ValueError(f"a frame of {size} bytes")
        return marshal.loads(await reader.readexactly(size))

    async def serve(self, sock: socket.socket) -> None:
        server = await asyncio.start_unix_server(self.connected, sock=sock)
        async with server:
            await server.serve_forever()


def listen() -> tuple[str, socket.socket]:
    """The hub's socket, bound and listening (before the hub and the workers are forked, so a worker's
    first connection is never refused), in a folder only this user can enter, removed at exit."""
    folder = tempfile.mkdtemp(prefix="derender-kv-hub-")  # 0700
    path = os.path.join(folder, "hub.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(64)
    atexit.register(shutil.rmtree, folder, True)  # the serving process's exit (forked ones leave by os._exit)
    return path, sock
