"""The metrics of kv-events routing (``routing.kvfeed``): events per replica and outcome, their lag,
replicas leaving the index, the index's size; in ``metrics.REGISTRY`` beside the others."""

from __future__ import annotations

import os

from prometheus_client import Counter, Gauge

from .metrics import REGISTRY

KV_EVENTS = Counter(
    "derender_kv_events_batches",
    "KV cache event batches from each producer replica (kv-events routing), by outcome: received, replayed "
    "(a gap filled from its replay socket), dropped (malformed, flood), lost (a gap its replay did not hold)",
    ["replica", "outcome", "why"],
    registry=REGISTRY,
)
KV_EVENTS_EVENTS = Counter(
    "derender_kv_events", "KV cache events applied to the index, by replica", ["replica"], registry=REGISTRY
)
KV_LEFT = Counter(
    "derender_kv_events_replica_left",
    "Times a replica left the kv-events index (stale: it served requests and published nothing; flood)",
    ["replica", "why"],
    registry=REGISTRY,
)
KV_INDEX_BLOCKS = Gauge(
    "derender_kv_index_blocks",
    "Per worker: (block, replica) entries of the kv-events index",
    ["pid"],
    registry=REGISTRY,
    multiprocess_mode="liveall",
)


def kv_event(outcome: str, replica: str, why: str = "", count: int = 1) -> None:
    """Batches dropped (malformed, flood, disconnected) or lost (a gap its replay did not hold)."""
    KV_EVENTS.labels(replica, outcome, why).inc(count)


def kv_left(replica: str, why: str) -> None:
    KV_LEFT.labels(replica, why).inc()


KV_LAG = Gauge(
    "derender_kv_events_lag_seconds",
    "Per replica: how long ago (wall clock) its last batch applied was published (the batch's ts)",
    ["replica"],
    registry=REGISTRY,
    multiprocess_mode="max",
)


def kv_counters(replica: str, outcome: str) -> tuple[Counter, Counter, Gauge]:
    """A replica's batches and events counters for an outcome (received, replayed) and its lag, to bind once."""
    return KV_EVENTS.labels(replica, outcome, ""), KV_EVENTS_EVENTS.labels(replica), KV_LAG.labels(replica)


def kv_index_gauge() -> Gauge:
    return KV_INDEX_BLOCKS.labels(str(os.getpid()))


KV_APPLIED = Counter(
    "derender_kv_index_batches",
    "KV cache event batches applied to a worker's index, by replica (summed over workers: each applies every "
    "batch, read by itself or relayed by the process's hub)",
    ["replica"],
    registry=REGISTRY,
)


def kv_applied(replica: str) -> Counter:
    return KV_APPLIED.labels(replica)
