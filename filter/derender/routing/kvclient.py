"""A worker's side of its process's KV events hub (``kvhub``): it subscribes, applies the batches the hub
relays to its ``KvRouting`` (``relayed``), sends its requests in flight when they change and takes the
other workers' sum; it checks its replicas' standing. If the hub cannot be reached or its connection
ends, the worker reads the producers' events itself from then on (``KvRouting.read_feeds``)."""

from __future__ import annotations

import asyncio
import logging
import marshal
import time
from typing import Any, Protocol

from .kvfeed import Feed, FeedSpec, Standing
from .kvhub import CHECK_S, FLUSH_S, MAX_FRAME, frame

log = logging.getLogger("derender.kvevents")


class Relayed(Protocol):
    """What a worker's client feeds (``kvroute.KvRouting``)."""

    specs: list[FeedSpec]
    hasher: Any
    feeds: Any
    in_flight: dict[str, int]
    others: dict[str, int]

    def relayed(self, batches: list) -> None: ...

    def read_feeds(self) -> dict[str, Feed]: ...


class HubClient:
    """A worker's connection to its process's hub."""

    def __init__(self, path: str, routing: Relayed) -> None:
        self.path = path
        self.routing = routing
        self.tasks: list[asyncio.Task] = []
        self.writer: asyncio.StreamWriter | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(self._run(), name="kv-events hub"), loop.create_task(self._tick())]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []

    async def _tick(self) -> None:
        """This worker's requests in flight to the hub when they changed (every ``FLUSH_S``); its
        replicas' standing checked every ``CHECK_S``."""
        sent: dict[str, int] = {}
        checked = time.monotonic()
        while True:
            await asyncio.sleep(FLUSH_S)
            load = self.routing.in_flight
            if self.writer is not None and load != sent:
                sent = dict(load)
                self.writer.write(frame(sent))
            now = time.monotonic()
            if now - checked >= CHECK_S:
                checked = now
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
        others = routing.others
        try:
            writer.write(frame([(s.replica, s.endpoint, s.replay, s.topic, size) for s in routing.specs]))
            self.writer = writer
            while True:
                length = int.from_bytes(await reader.readexactly(4), "big")
                if length > MAX_FRAME:
                    raise ValueError(f"a frame of {length} bytes")
                entries, load = marshal.loads(await reader.readexactly(length))
                routing.relayed(entries)
                if load is not None:  # in place: the balancer holds this dict
                    others.clear()
                    others.update(load)
        except asyncio.IncompleteReadError:
            pass
        except (OSError, EOFError, ValueError, TypeError) as exc:
            why = f"the hub's connection failed ({exc})"
        finally:
            self.writer = None
            writer.close()
        self._alone(why)

    def _alone(self, why: str) -> None:
        """The hub is gone: this worker reads the events itself from now on."""
        log.warning("kv-events routing: %s; this worker reads the producers' events itself", why)
        self.routing.others.clear()  # and counts only its own requests in flight
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        for standing in self.routing.feeds.values():
            if isinstance(standing, Standing):
                standing.sink.cleared(standing.replica)
        for feed in self.routing.read_feeds().values():
            feed.start()
