"""The filter's own calls to a producer: aborting requests it no longer needs.

Behind one load-balanced address (a Kubernetes Service, a DNS name with several
replicas) an abort sent to that address can reach a replica that is not running
the request. So the Envoy configs add ``UPSTREAM_HEADER`` to each producer response:
the address Envoy connected to for this request (``%UPSTREAM_REMOTE_ADDRESS%``).
Once the response has started, an abort goes there; if that replica cannot be
reached, or before the response started, it goes to the configured URL.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Coroutine
from typing import Any
from urllib.parse import urlsplit

import aiohttp

log = logging.getLogger("derender.producer")

ABORT_PATH = "/inference/v1/abort_requests"
GENERATE_PATH = "/inference/v1/generate"
UPSTREAM_HEADER = "x-derender-upstream"  # set by Envoy on producer responses; never sent to the client

_ADDRESS = re.compile(r"(?:\d{1,3}(?:\.\d{1,3}){3}|\[[0-9A-Fa-f:.]+\]):\d{1,5}")


def replica_url(base_url: str, upstream: str | None) -> str | None:
    """``http://IP:PORT`` of the replica Envoy reached (the scheme of ``base_url``), or None."""
    if not upstream or not _ADDRESS.fullmatch(upstream):
        return None
    return f"{urlsplit(base_url).scheme or 'http'}://{upstream}"


def log_abort(request_id: str, why: str, attempts: list[tuple[str, str]]) -> bool:
    """One line per abort, once every call it made is over; whether one of them was taken."""
    ok = any(outcome == "ok" for _, outcome in attempts)
    where = ", ".join(f"at {url}: {outcome}" for url, outcome in attempts)
    log.log(logging.INFO if ok else logging.WARNING, "aborted producer request %s (%s) %s", request_id, why, where)
    return ok


async def abort_replica_first(
    first: Producer, fallbacks: list[Producer], request_id: str, why: str, upstream: str | None
) -> bool:
    """Abort at the replica Envoy reached (``upstream``, by ``first``'s scheme) if known; if that
    is not taken, at every producer of ``fallbacks`` at once. One log line for it all."""
    attempts: list[tuple[str, str]] = []
    url = replica_url(first.url, upstream)
    if url is not None:
        attempts.append((url, await first.post_abort(url, request_id)))
    if not attempts or attempts[-1][1] != "ok":
        outcomes = await asyncio.gather(*(p.post_abort(p.url, request_id) for p in fallbacks))
        attempts += [(p.url, o) for p, o in zip(fallbacks, outcomes, strict=False)]
    return log_abort(request_id, why, attempts)


class Producer:
    """One producer base URL (``http://host:port``)."""

    def __init__(self, url: str, stall_timeout: float = 240.0) -> None:
        self.url = url.rstrip("/")
        # Seconds a streaming request to it may stay silent before it is aborted (0: never).
        self.stall_timeout = stall_timeout
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self._session

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` in the background; ``close`` waits for it."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def abort_soon(self, request_id: str, why: str, upstream: str | None = None) -> None:
        """Fire and forget ``POST /inference/v1/abort_requests`` for one request."""
        self.spawn(self.abort(request_id, why, upstream))

    async def abort(self, request_id: str, why: str, upstream: str | None = None) -> bool:
        """At the replica Envoy reached (``upstream``) if known and reachable, else at ``url``."""
        return await abort_replica_first(self, [self], request_id, why, upstream)

    async def post_abort(self, url: str, request_id: str) -> str:
        """One abort call; its outcome: ``ok``, ``refused`` (an error status) or ``failed (why)``."""
        try:
            async with self._client().post(url + ABORT_PATH, json={"request_ids": [request_id]}) as r:
                return "ok" if r.status == 200 else "refused"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"failed ({exc or type(exc).__name__})"

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
