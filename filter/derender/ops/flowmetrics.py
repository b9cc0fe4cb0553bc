"""The metrics of flow control (``stages.flow``): requests waiting per band and key, how long they
waited, what became of them, and each backend's estimated load; in ``metrics.REGISTRY`` beside the others."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from .metrics import REGISTRY

QUEUED = Gauge(
    "derender_queue_waiting_requests",
    "Requests waiting for room at their producers now, by priority band and key (keys the budget file "
    "does not list: default)",
    ["band", "key"],
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
WAITED = Histogram(
    "derender_queue_wait_seconds",
    "How long requests that had to wait for room waited, by outcome (dispatched, expired, left)",
    ["outcome"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
    registry=REGISTRY,
)
OUTCOMES = Counter(
    "derender_flow_requests",
    "Requests through flow control, by outcome: sent (room at once), dispatched (after waiting), expired "
    "(waited --queue-timeout: 429, or 503 with no replica up), refused (the queue full: 429), left (the "
    "client left while it waited)",
    ["outcome"],
    registry=REGISTRY,
)
LOAD = Gauge(
    "derender_backend_load",
    "Per backend (its Envoy cluster): the estimated requests in flight and waiting at its producers, and its "
    "capacity (--replica-capacity x replicas up), as this worker sees them",
    ["cluster", "what"],
    registry=REGISTRY,
    multiprocess_mode="max",
)
