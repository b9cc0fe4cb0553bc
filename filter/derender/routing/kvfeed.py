"""A producer replica's KV cache events, read as vLLM publishes them (``vllm serve --kv-events-config``).

vLLM's ``ZmqEventPublisher`` sends multipart ``(topic, sequence number as 8 bytes big-endian, msgpack
KVEventBatch)`` on a PUB socket and answers a request for the batches from a sequence number on a
ROUTER replay socket (each as ``(topic, seq, payload)``, then an end marker of seq -1). A ``Feed`` is
one SUB socket read on the event loop of the process that reads the events (the filter process's hub,
``kvhub``, or a worker without one; ZMQ's own socket, its descriptor watched by the loop; the replay
through ``zmq.asyncio``), decoding with vLLM's own types (``vllm.distributed.kv_events.KVEventBatch``)
for a ``Sink``: the hub's relay, a worker's ``KvRouting``, or a bare ``KvIndex``.

Faults, each counted (``derender_kv_events_*``) and none of them able to stall or end a worker:
- a gap in the sequence numbers (the feed's start is one: from 0) is filled from the replay socket,
  at most ``REPLAY_S`` seconds of waiting; what the replay does not hold is lost, and logged;
- sequence numbers going back: the replica restarted; what it held is forgotten;
- a message over ``max_bytes`` (ZMQ's ``MAXMSGSIZE``: the connection is dropped, and made again
  with a new socket), not three frames, or not vLLM's batch: dropped;
- more than ``max_rate`` batches a second (a flood): the replica leaves the index and its feed
  pauses for ``PAUSE_S`` seconds;
- a replica that served requests with new blocks and published nothing for ``stale_s`` seconds
  (down, unreachable, or not publishing): it leaves the index, logged once, until its events come
  again. An idle replica publishes nothing and is not stale.
A replica out of the index is routed by the consistent hash on the prefix key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from ..ops import kvmetrics as metrics

log = logging.getLogger("derender.kvevents")

END_SEQ = -1
REPLAY_S = 2.0  # seconds a replay may take
PAUSE_S = 30.0  # a flooding publisher's feed rests this long
RECONNECT_S = 0.2  # before a new socket, once a connection dropped
DRAIN = 256  # batches taken in one turn of the loop
COALESCE_S = 0.05  # after a turn that took batches, the next one this much later


def events(sock: zmq.Socket) -> int:
    """ZMQ's ``EVENTS`` of a socket (what its descriptor's wake-up meant)."""
    return int(sock.get(zmq.EVENTS))


@dataclass(frozen=True)
class FeedSpec:
    """Where one replica publishes: ``replica`` is Envoy's name for it (``IP:PORT``)."""

    replica: str
    endpoint: str  # tcp://host:port of its PUB socket
    replay: str | None = None  # tcp://host:port of its ROUTER replay socket
    topic: str = ""


class Sink(Protocol):
    """What a feed's events go to: a worker's ``KvIndex`` (or its ``KvRouting``, which also names the
    blocks), or the hub's relay to the workers (``kvhub``)."""

    @property
    def entries(self) -> int: ...  # (block, replica) entries it holds

    def apply(self, replica: str, events: list) -> None: ...  # one batch's events, in order

    def cleared(self, replica: str) -> None: ...  # the replica restarted: nothing of it is known

    def left(self, replica: str) -> None: ...  # it left the index (flood, stale): routed by the hash


class Standing:
    """A replica's place in the index as routing sees it: in it, or left (stale, flood) until its
    events come again; ``expect`` and ``check`` find a replica that serves requests and publishes
    nothing."""

    def __init__(self, replica: str, sink: Sink, stale_s: float = 30.0) -> None:
        self.replica = replica
        self.sink = sink
        self.stale_s = stale_s
        self.in_index = True
        self.waiting_since: float | None = None  # a request with new blocks went there, no event since

    def expect(self, now: float) -> None:
        """A request that must store blocks there started: its events should follow."""
        if self.waiting_since is None:
            self.waiting_since = now

    def check(self, now: float) -> None:
        if self.in_index and self.waiting_since is not None and now - self.waiting_since > self.stale_s:
            self.leave(f"no KV events for {self.stale_s:g} s while it served requests")

    def leave(self, why: str, quiet: bool = False) -> None:
        """Out of the index (``quiet``: another process logged and counted it: the hub)."""
        if self.in_index:
            self.in_index = False
            if not quiet:
                log.warning(
                    "kv-events routing: replica %s leaves the index (%s); routed by the hash", self.replica, why
                )
                metrics.kv_left(self.replica, why.split(" (")[0].split(" for ")[0])
        self.sink.left(self.replica)
        self.waiting_since = None

    def alive(self) -> None:
        """A batch of its events was applied."""
        self.waiting_since = None
        if not self.in_index:
            self.in_index = True
            log.info("kv-events routing: replica %s is back in the index", self.replica)


class Feed:
    def __init__(
        self,
        spec: FeedSpec,
        sink: Sink,
        max_bytes: int = 16 << 20,
        max_rate: float = 20_000,
        stale_s: float = 30.0,
        block_size: int | None = None,
    ) -> None:
        self.block_size = block_size  # the filter's --prefix-block-size: a replica's other size is logged once
        self.spec = spec
        self.sink = sink
        self.standing = Standing(spec.replica, sink, stale_s)
        self.max_bytes = max_bytes
        self.max_rate = max_rate
        self.next_seq: int | None = None
        self.skip_below: int | None = None  # after a replay of all it held: live batches below it are had
        self.task: asyncio.Task | None = None
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._counters: dict[str, tuple] = {}  # received / replayed: (batches, events, lag), bound once

    # -- the routing side (its ``Standing``) ---------------------------------------------------------
    @property
    def in_index(self) -> bool:
        return self.standing.in_index

    def expect(self, now: float) -> None:
        self.standing.expect(now)

    def check(self, now: float) -> None:
        self.standing.check(now)

    def leave(self, why: str, quiet: bool = False) -> None:
        self.standing.leave(why, quiet)

    def alive(self) -> None:
        self.standing.alive()

    # -- the events side ---------------------------------------------------------------------------
    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.spec.replica}")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None

    async def _run(self) -> None:
        context: zmq.Context = zmq.Context.instance()
        while True:
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.setsockopt(zmq.LINGER, 0)
            # A dropped connection (ZMQ drops one that sent a message past MAXMSGSIZE and does not
            # connect again by itself): a new socket, and the gap from the replay socket.
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sub.connect(self.spec.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, self.spec.topic.encode())
            pause = RECONNECT_S
            try:
                if await self._read(sub, monitor):
                    pause = PAUSE_S
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("kv-events feed of %s failed: %s", self.spec.replica, exc)
                pause = PAUSE_S
            finally:
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)
            await asyncio.sleep(pause)

    async def _read(self, sub: zmq.Socket, monitor: zmq.Socket) -> bool:
        """Read until a flood (True) or a lost connection (False).

        The sockets are ZMQ's own (no future per message): the loop watches their file descriptors,
        wakes once for what has arrived and takes it all, up to ``DRAIN`` batches a turn, without
        waiting. ZMQ's descriptor says only that something may have changed: ``EVENTS`` says what."""
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        # Watched only while waiting: a descriptor ZMQ has not yet been asked about stays readable, and
        # the loop would call back on every turn.
        fds: list[int] = [sub.getsockopt(zmq.FD), monitor.getsockopt(zmq.FD)]  # type: ignore[list-item]
        window, count = time.monotonic(), 0
        try:
            while True:
                if events(monitor) & zmq.POLLIN:
                    monitor.recv_multipart()
                    metrics.kv_event("dropped", self.spec.replica, "disconnected")
                    return False
                now = time.monotonic()
                if not events(sub) & zmq.POLLIN:
                    readable.clear()
                    for fd in fds:
                        loop.add_reader(fd, readable.set)
                    timer = loop.call_later(1.0, readable.set)
                    try:
                        await readable.wait()
                    finally:
                        timer.cancel()
                        for fd in fds:
                            loop.remove_reader(fd)
                    if time.monotonic() - now >= 0.99:  # the timer, not the sockets
                        self.check(time.monotonic())
                        if self.next_seq is None and self.spec.replay is not None:  # nothing live: what it holds
                            self.next_seq = self.skip_below = await self._replay(0, None)
                    continue
                if now - window >= 1.0:
                    window, count = now, 0
                for _ in range(DRAIN):
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    count += 1
                    if count > self.max_rate:
                        metrics.kv_event("dropped", self.spec.replica, "flood")
                        self.leave(f"more than {self.max_rate:g} batches a second")
                        return True
                    await self._take(frames)
                # What comes next is taken together a moment later: a busy replica's batches cost one
                # wake-up of the loop per COALESCE_S, not one each (routing waits on no single batch).
                await asyncio.sleep(COALESCE_S)
        finally:
            for fd in fds:
                loop.remove_reader(fd)

    async def _take(self, frames: list) -> None:
        """One live batch, after the ones a gap left out."""
        if len(frames) != 3 or len(frames[1]) != 8:
            metrics.kv_event("dropped", self.spec.replica, "malformed")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if self.skip_below is not None:  # live batches a replay already brought
            if seq < self.skip_below:
                return
            self.skip_below = None
        if self.next_seq is not None and seq < self.next_seq:
            log.info(
                "kv-events: replica %s restarted its events (seq %d after %d)",
                self.spec.replica,
                seq,
                self.next_seq - 1,
            )
            self.sink.cleared(self.spec.replica)
            self.next_seq = None
        if seq != (self.next_seq or 0) and self.spec.replay is not None:
            await self._replay(self.next_seq or 0, seq)
        self._apply(frames[2], "received")
        self.next_seq = seq + 1

    async def _replay(self, start: int, until: int | None) -> int:
        """Batches [start, until) from the replica's replay socket (``until`` None: all it holds);
        the sequence number after the last one applied."""
        assert self.spec.replay is not None
        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.spec.replay)
        got, deadline = start, time.monotonic() + REPLAY_S
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while (left := deadline - time.monotonic()) > 0 and await dealer.poll(timeout=int(left * 1000) + 1):
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    metrics.kv_event("dropped", self.spec.replica, "malformed")
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    break
                if start <= seq and (until is None or seq < until) and seq >= got:
                    self._apply(frames[3], "replayed")
                    got = seq + 1
        finally:
            dealer.close(linger=0)
        if until is not None and got < until:
            metrics.kv_event("lost", self.spec.replica, "not replayed", until - got)
            log.warning(
                "kv-events: %d batches of replica %s (seq %d-%d) could not be replayed",
                until - got,
                self.spec.replica,
                got,
                until - 1,
            )
        return got

    def _apply(self, payload: bytes, how: str) -> None:
        try:
            batch = self._decoder.decode(payload)
        except Exception:  # noqa: BLE001 - msgspec's errors: not vLLM's batch
            metrics.kv_event("dropped", self.spec.replica, "malformed")
            return
        events = batch.events
        if self.block_size is not None:
            for event in events:  # the first stored block's size: a replica caches one size
                if type(event) is BlockStored:
                    if event.block_size != self.block_size:
                        log.error(
                            "kv-events: replica %s caches blocks of %d tokens and the filter hashes %d "
                            "(--prefix-block-size): no prompt will match its blocks",
                            self.spec.replica,
                            event.block_size,
                            self.block_size,
                        )
                        self.block_size = None
                    break
        self.sink.apply(self.spec.replica, events)
        self.standing.alive()
        batches, applied, lag = self._counters.get(how) or self._count(how)
        batches.inc()
        applied.inc(len(events))
        lag.set(max(0.0, time.time() - batch.ts))

    def _count(self, how: str) -> tuple:
        self._counters[how] = metrics.kv_counters(self.spec.replica, how)
        return self._counters[how]
