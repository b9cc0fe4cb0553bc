"""Flow control: room at a backend's producers, and the queue of requests waiting for it.

A backend has room while its estimated load (requests in flight and waiting at its replicas) is below
``capacity`` per replica up (``--replica-capacity``). The estimate is this worker's own count, or,
with the producers' signal (``saturation.Signal``: vLLM's ``/metrics``, read every interval), what the
replicas reported at the last read plus what this worker sent since minus what of its requests ended
since: requests of other workers and gateways are seen at the next read. A stale or missing signal
is never read as full: the estimate falls back to this worker's count.

While there is no room, requests wait in ``Queue``: by priority band first (vLLM's convention: a lower
number is served first), and within a band fairly across API keys, each key weighted (start-time fair
queueing: a key's next request is due at its virtual start, the later of the band's clock and the end
of its last turn, a turn lasting 1 / weight). One key's flood waits behind its own requests, not in
front of another key's.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

MiB = 1 << 20


@dataclass(frozen=True)
class FlowSpec:
    """``derender serve``'s flow-control flags; ``capacity`` 0 is off."""

    capacity: int = 0  # --replica-capacity: requests in flight per replica
    timeout: float = 30.0  # --queue-timeout: seconds a request may wait
    max_queued: int = 1024  # --queue-size: requests waiting, per worker and backend
    max_bytes: int = 256 * MiB  # --queue-bytes: their rendered bodies, together
    interval: float = 0.25  # --saturation-interval: seconds between reads of /metrics (0: this worker's count)
    reserve: float = 0.125  # --key-reserve: the share of the capacity kept for keys with nothing in flight


@dataclass(slots=True)
class Turn:
    """One request's pass through flow control, for the metrics, the request log and the trace."""

    outcome: str  # sent (room at once), dispatched (after waiting), expired, refused, left
    band: int = 0
    key: str = ""
    since: float = 0.0  # when it began to wait (monotonic), 0: it did not
    waited: float = 0.0  # seconds
    sent: bool = False  # counted in flight until the request ends
    flow_key: str = ""  # the key it is counted under


class Waiter:
    __slots__ = ("band", "cost", "future", "key", "since", "weight")

    def __init__(self, key: str, band: int, weight: float, cost: int) -> None:
        self.key, self.band, self.weight, self.cost = key, band, weight, cost
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.since = time.monotonic()


class Band:
    """One priority band: a queue per key, served by virtual start time."""

    __slots__ = ("clock", "ends", "flows")

    def __init__(self) -> None:
        self.flows: dict[str, deque[Waiter]] = {}
        self.ends: dict[str, float] = {}  # a key's last turn's virtual end
        self.clock = 0.0

    def push(self, waiter: Waiter) -> None:
        self.flows.setdefault(waiter.key, deque()).append(waiter)

    def pop(self, eligible: Callable[[str], bool] | None = None) -> Waiter | None:
        clock, ends = self.clock, self.ends
        keys = self.flows if eligible is None else [k for k in self.flows if eligible(k)]
        if not keys:
            return None
        # The earliest virtual start; on a tie, the key served least lately (a key back after a pause).
        key = min(keys, key=lambda k: (max(clock, ends.get(k, 0.0)), ends.get(k, 0.0)))
        flow = self.flows[key]
        waiter = flow.popleft()
        if not flow:
            del self.flows[key]
        start = max(clock, ends.get(key, 0.0))
        self.clock = start
        ends[key] = start + 1.0 / waiter.weight
        if len(ends) > 4096:  # keys long idle: their turns are in the past
            for k in [k for k, end in ends.items() if end <= start and k not in self.flows]:
                del ends[k]
        return waiter

    def remove(self, waiter: Waiter) -> bool:
        flow = self.flows.get(waiter.key)
        if flow is None or waiter not in flow:
            return False
        flow.remove(waiter)
        if not flow:
            del self.flows[waiter.key]
        return True


class Queue:
    """Requests waiting for room, bounded in count and bytes."""

    def __init__(self, max_queued: int, max_bytes: int) -> None:
        self.max_queued, self.max_bytes = max_queued, max_bytes
        self.bands: dict[int, Band] = {}
        self.count = 0
        self.bytes = 0

    def fits(self, key: str, cost: int) -> bool:
        """Room for one more: under the bounds, and its key holding under half of them (one key's
        flood cannot fill the queue against the others)."""
        if self.count >= self.max_queued or self.bytes + cost > self.max_bytes:
            return False
        held = sum(len(b.flows.get(key, ())) for b in self.bands.values())
        return held < max(1, self.max_queued // 2)

    def push(self, waiter: Waiter) -> None:
        band = self.bands.get(waiter.band)
        if band is None:
            band = self.bands[waiter.band] = Band()
            self.bands = dict(sorted(self.bands.items()))  # served lowest number first
        band.push(waiter)
        self.count += 1
        self.bytes += waiter.cost

    def pop(self, eligible: Callable[[str], bool] | None = None) -> Waiter | None:
        """The next waiter (of a key ``eligible`` says may go, if given): by band, then by turns."""
        for number, band in self.bands.items():
            if band.flows:
                waiter = band.pop(eligible)
                if waiter is not None:
                    self._taken(number, band, waiter)
                    return waiter
        return None

    def remove(self, waiter: Waiter) -> bool:
        band = self.bands.get(waiter.band)
        if band is None or not band.remove(waiter):
            return False
        self._taken(waiter.band, band, waiter)
        return True

    def _taken(self, number: int, band: Band, waiter: Waiter) -> None:
        self.count -= 1
        self.bytes -= waiter.cost
        if not band.flows and len(self.bands) > 1:  # an empty band is forgotten (its turns with it)
            del self.bands[number]

    def by_key(self) -> dict[tuple[int, str], int]:
        """(band, key) -> requests waiting."""
        return {(b, key): len(flow) for b, band in self.bands.items() for key, flow in band.flows.items()}


class Reported(Protocol):
    """The producers' own signal (``saturation.Signal``)."""

    def __call__(self) -> tuple[int, int] | None:
        """(the load the replicas reported, replicas up), None while stale."""

    def none_up(self) -> bool: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...


class Flow:
    """One backend's room and queue, in one worker."""

    def __init__(
        self, spec: FlowSpec, replicas: int, signal: Reported | None = None, cluster: str = "producer"
    ) -> None:
        self.spec = spec
        self.cluster = cluster  # the backend's Envoy cluster: its name in the metrics
        self.replicas = replicas
        self.signal = signal
        self.queue = Queue(spec.max_queued, spec.max_bytes)
        self.in_flight = 0  # this worker's requests sent and not ended
        self.by_key: dict[str, int] = {}  # of those, per key
        self.sent_since = 0  # sent since the signal's reading began, less those of this worker's that ended
        self.marked = 0  # ``sent_since`` when the reading in progress began
        self.waits: deque[float] = deque(maxlen=64)  # seconds the last dispatched waiters waited

    def load(self) -> tuple[int, int]:
        """(the estimated load, the capacity) of the backend now."""
        reported = self.signal() if self.signal is not None else None
        if reported is None:
            return self.in_flight, self.spec.capacity * self.replicas
        load, up = reported
        return max(self.in_flight, load + self.sent_since), self.spec.capacity * up

    def room(self, key: str) -> bool:
        """Whether a request of ``key`` may go now: below the capacity less the reserve, anyone; in the
        reserve, only a key with nothing in flight here (a flooding key cannot take the last slots, so
        another key's request finds one free at once)."""
        load, capacity = self.load()
        return load < capacity - self.reserved(capacity) or (load < capacity and not self.by_key.get(key))

    def reserved(self, capacity: int) -> int:
        """The slots of ``capacity`` kept for keys with nothing in flight (``--key-reserve``)."""
        return min(capacity - 1, math.ceil(capacity * self.spec.reserve)) if capacity > 1 else 0

    def up(self) -> bool:
        """Whether any replica is up, as far as the signal knows (True without one)."""
        return self.signal is None or not self.signal.none_up()

    def sent(self, key: str) -> None:
        self.in_flight += 1
        self.sent_since += 1
        self.by_key[key] = self.by_key.get(key, 0) + 1

    def ended(self, key: str) -> None:
        self.in_flight -= 1
        self.sent_since -= 1
        left = self.by_key.get(key, 0) - 1
        if left > 0:
            self.by_key[key] = left
        else:
            self.by_key.pop(key, None)

    def reading(self) -> None:
        """The signal's reading begins: what this worker sent until now will be in it."""
        self.marked = self.sent_since

    def read(self) -> None:
        """The signal's reading is in."""
        self.sent_since -= self.marked
        self.marked = 0

    def retry_after(self) -> int:
        """Seconds a refused client is told to wait: about what the last dispatched waiters waited."""
        waits = sorted(self.waits)
        return max(1, min(int(self.spec.timeout), round(waits[len(waits) // 2]) if waits else 1))

    def report(self) -> None:
        """The estimated load and the capacity, to the metrics."""
        from ..ops import flowmetrics

        load, capacity = self.load()
        flowmetrics.LOAD.labels(self.cluster, "load").set(load)
        flowmetrics.LOAD.labels(self.cluster, "capacity").set(capacity)

    def release(self) -> list[Waiter]:
        """The waiters that now have room, in the order they are served (each counted as sent)."""
        out = []
        while self.queue.count:
            load, capacity = self.load()
            if load >= capacity:
                break
            free = load < capacity - self.reserved(capacity)  # else: the reserve, for keys with nothing in flight
            waiter = self.queue.pop(None if free else lambda key: not self.by_key.get(key))
            if waiter is None:
                break
            if waiter.future.done():  # it left (or timed out) in this very turn
                continue
            self.sent(waiter.key)
            waiter.future.set_result(None)
            self.waits.append(time.monotonic() - waiter.since)
            out.append(waiter)
        return out
