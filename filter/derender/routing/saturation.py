"""The producers' own saturation signal: each replica's vLLM ``/metrics`` read every interval
(``vllm:num_requests_running`` + ``vllm:num_requests_waiting``; a replica with requests waiting in its
own queue counts as full). What ``flow.Flow`` estimates the load from, shared by every worker and
filter process that reads the same replicas.

A reading is fresh for three intervals. A replica whose ``/metrics`` cannot be read (it answers an
error, or garbage, or too slowly) makes the whole signal stale, and a stale signal is never read as
full: the flow falls back to its own count. A replica that cannot even be connected to is down; when
every replica is down, queued requests are answered 503 rather than 429.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from .flow import Flow, FlowSpec

log = logging.getLogger("derender.flow")

MAX_BODY = 8 << 20  # a /metrics page larger than this is not read
RUNNING, WAITING = b"vllm:num_requests_running", b"vllm:num_requests_waiting"


def parse(text: bytes) -> tuple[float, float]:
    """(running, waiting) summed over the page's engines; ValueError if it names neither."""
    running = waiting = None
    for line in text.split(b"\n"):
        if line.startswith(RUNNING) or line.startswith(WAITING):
            value = float(line.rsplit(b" ", 1)[1])
            if line.startswith(RUNNING):
                running = (running or 0.0) + value
            else:
                waiting = (waiting or 0.0) + value
    if running is None or waiting is None:
        raise ValueError("no vllm:num_requests_running / vllm:num_requests_waiting on the page")
    return running, waiting


class Reading:
    __slots__ = ("at", "down", "load", "waiting")

    def __init__(self) -> None:
        self.at = 0.0  # when the last good reading came (monotonic)
        self.load = 0
        self.waiting = 0
        self.down = False  # the last attempt could not connect


class Signal:
    """Every replica's reading, kept fresh by one task of this worker's loop."""

    def __init__(
        self,
        urls: list[str],
        capacity: int,
        interval: float,
        on_reading: Callable[[], None],
        on_read: Callable[[], None],
    ) -> None:
        self.urls = [u.rstrip("/") + "/metrics" for u in urls]
        self.capacity = capacity
        self.interval = interval
        self.on_reading = on_reading  # before each round of reads
        self.on_read = on_read  # after it (the flow re-counts, and releases waiters)
        self.readings = [Reading() for _ in urls]
        self.reads = 0
        self._task: asyncio.Task | None = None
        self._warned: set[int] = set()

    def __call__(self) -> tuple[int, int] | None:
        """(the load the replicas reported, replicas up), None while any reading is stale."""
        stale = time.monotonic() - 3 * self.interval
        load = up = 0
        for reading in self.readings:
            if reading.at < stale:
                return None
            load += max(reading.load, self.capacity) if reading.waiting else reading.load
            up += 1
        return load, up

    def none_up(self) -> bool:
        return all(r.down for r in self.readings)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, 2 * self.interval))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                began = time.monotonic()
                self.on_reading()
                await asyncio.gather(*(self._read(session, i) for i in range(len(self.urls))))
                self.reads += 1
                self.on_read()
                await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - began)))

    async def _read(self, session: aiohttp.ClientSession, i: int) -> None:
        reading, url = self.readings[i], self.urls[i]
        try:
            async with session.get(url) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                body = await response.content.read(MAX_BODY + 1)
                if len(body) > MAX_BODY:
                    raise ValueError(f"a page larger than {MAX_BODY} bytes")
                running, waiting = parse(body)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as exc:
            reading.down = not isinstance(exc, asyncio.TimeoutError)
            self._warn(i, exc)
            return
        except (aiohttp.ClientError, ValueError, IndexError) as exc:
            reading.down = False
            self._warn(i, exc)
            return
        reading.at, reading.load, reading.waiting, reading.down = (
            time.monotonic(),
            int(running + waiting),
            int(waiting),
            False,
        )
        self._warned.discard(i)

    def _warn(self, i: int, exc: BaseException) -> None:
        if i not in self._warned:
            self._warned.add(i)
            log.warning(
                "flow control: %s could not be read (%s: %s); counting this worker's requests only",
                self.urls[i],
                type(exc).__name__,
                exc,
            )


def flow_for(spec: FlowSpec, urls: list[str], cluster: str = "producer") -> Flow | None:
    """A backend's flow control for its producer ``urls`` (None when ``--replica-capacity`` is off),
    with the producers' signal unless ``--saturation-interval`` is 0 (``Flow.signal.start`` on the loop)."""
    if spec.capacity <= 0:
        return None
    flow = Flow(spec, len(urls), cluster=cluster)
    if spec.interval > 0:

        def read() -> None:
            flow.read()
            flow.release()
            flow.report()

        flow.signal = Signal(urls, spec.capacity, spec.interval, flow.reading, read)
    return flow
