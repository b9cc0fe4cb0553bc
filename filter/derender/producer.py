"""The filter's own calls to a producer: aborting requests it no longer needs."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

log = logging.getLogger("derender.producer")

ABORT_PATH = "/inference/v1/abort_requests"
GENERATE_PATH = "/inference/v1/generate"


class Producer:
    """One producer base URL (``http://host:port``)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self._session

    def abort_soon(self, request_id: str, why: str) -> None:
        """Fire and forget ``POST /inference/v1/abort_requests`` for one request."""
        task = asyncio.get_running_loop().create_task(self.abort(request_id, why))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def abort(self, request_id: str, why: str) -> bool:
        try:
            async with self._client().post(self.url + ABORT_PATH, json={"request_ids": [request_id]}) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("abort of %s at %s failed: %s", request_id, self.url, exc)
            return False
        log.info("aborted producer request %s (%s): %s", request_id, why, "ok" if ok else "refused")
        return ok

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
