"""The producer clusters Envoy routes to, and the request headers that steer it.

``CLUSTER_HEADER`` names the Envoy cluster of a request's model (Envoy routes on it once the
route cache is cleared); ``STEERING_HEADERS`` are every header that chooses a cluster or a
replica: only the filter sets them (the ext_proc server removes the client's copies).
``producers`` is where aborts go: one ``Producer``, or all of a cluster's.
"""

from __future__ import annotations

from .balance import ENDPOINT_KEY, KEY_HEADER
from .producer import Producer, abort_replica_first

CLUSTER_HEADER = "x-derender-cluster"
# Request headers that steer Envoy (which cluster, which replica): only the filter sets them. The
# server removes the client's copies of these, and of every other x-derender-* header, on every path.
STEERING_HEADERS = (CLUSTER_HEADER, KEY_HEADER, ENDPOINT_KEY)
STEERING_PREFIX = "x-derender-"
DEFAULT_CLUSTER = "producer"  # the producer cluster of envoy/local.yaml


class ClusterProducers:
    """The producers of one Envoy cluster. Envoy says which one it picked once the response
    has started (``UPSTREAM_HEADER``); before that, or if that one cannot be reached, an
    abort goes to all of them (vLLM ignores unknown ids)."""

    def __init__(self, urls: list[str] | tuple[str, ...], stall_timeout: float = 240.0) -> None:
        self.producers = [Producer(url, stall_timeout) for url in urls]
        self.stall_timeout = stall_timeout

    def abort_soon(self, request_id: str, why: str, upstream: str | None = None) -> None:
        self.producers[0].spawn(self.abort(request_id, why, upstream))

    async def close(self) -> None:
        for producer in self.producers:
            await producer.close()

    async def abort(self, request_id: str, why: str, upstream: str | None = None) -> bool:
        return await abort_replica_first(self.producers[0], self.producers, request_id, why, upstream)


def producers(urls: list[str] | tuple[str, ...], stall_timeout: float = 240.0) -> Producer | ClusterProducers:
    return Producer(urls[0], stall_timeout) if len(urls) == 1 else ClusterProducers(urls, stall_timeout)
