"""The legs of requests ext_proc rendered that Envoy has not yet brought to the leg listener, by a
one-time token."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Protocol

log = logging.getLogger("derender.leg")

# Envoy connects to the worker as soon as ext_proc's reply reaches it (well under a millisecond here);
# a request that has not come for this long never will (Envoy gave up, the client left): its producer
# request, already sent, is aborted.
TTL = 10.0
MOST = 20000  # waiting at once, per worker: past it a request is refused (503) rather than kept


class Waiting(Protocol):
    """What waits here (``producer.Leg``)."""

    def client_gone(self) -> None: ...


class Parked:
    def __init__(self, ttl: float = TTL, most: int = MOST) -> None:
        self.ttl = ttl
        self.most = most
        self._entries: dict[str, tuple[Waiting, asyncio.TimerHandle]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def full(self) -> bool:
        return len(self._entries) >= self.most

    def park(self, leg: Waiting) -> str:
        """A token for ``leg`` (check ``full`` first)."""
        token = secrets.token_urlsafe(18)
        timer = asyncio.get_running_loop().call_later(self.ttl, self._expire, token)
        self._entries[token] = (leg, timer)
        return token

    def take(self, token: str) -> Waiting | None:
        """The leg parked under ``token``, once; None for any other token."""
        entry = self._entries.pop(token, None)
        if entry is None:
            return None
        entry[1].cancel()
        return entry[0]

    def _expire(self, token: str) -> None:
        entry = self._entries.pop(token, None)
        if entry is not None:
            log.warning("a rendered request was never brought to this worker's leg within %g s: dropped", self.ttl)
            entry[0].client_gone()

    def close(self) -> None:
        """Every parked leg dropped (the worker is stopping)."""
        for token in list(self._entries):
            leg, timer = self._entries.pop(token)
            timer.cancel()
            leg.client_gone()
