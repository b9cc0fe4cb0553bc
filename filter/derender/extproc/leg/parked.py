"""Exchanges that ext_proc rendered and the leg listener has not yet taken, by a one-time token."""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from ...exchange import Rewrite

log = logging.getLogger("derender.leg")

# Envoy connects to the worker as soon as ext_proc's reply reaches it (well under a millisecond here);
# a request that has not come for this long never will (Envoy gave up, the client left).
TTL = 30.0
MOST = 20000  # parked at once, per worker: past it a request is refused (503) rather than kept


@dataclass
class Entry:
    exchange: Any  # a ModelExchange: its response steps and ``close`` are the leg's from here on
    rewrite: Rewrite
    timer: asyncio.TimerHandle


class Parked:
    def __init__(self, ttl: float = TTL, most: int = MOST) -> None:
        self.ttl = ttl
        self.most = most
        self._entries: dict[str, Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def park(self, exchange: Any, rewrite: Rewrite) -> str | None:
        """A token for ``exchange`` (None: too many parked, the caller refuses the request)."""
        if len(self._entries) >= self.most:
            return None
        token = secrets.token_urlsafe(18)
        timer = asyncio.get_running_loop().call_later(self.ttl, self._expire, token)
        self._entries[token] = Entry(exchange, rewrite, timer)
        return token

    def take(self, token: str) -> Entry | None:
        """The entry parked under ``token``, once; None for any other token."""
        entry = self._entries.pop(token, None)
        if entry is not None:
            entry.timer.cancel()
        return entry

    def _expire(self, token: str) -> None:
        entry = self._entries.pop(token, None)
        if entry is not None:
            log.warning("a rendered request was never brought to this worker's leg within %g s: dropped", self.ttl)
            entry.exchange.close(False)

    def close(self) -> None:
        """Every parked exchange closed, unanswered (the worker is stopping)."""
        for token in list(self._entries):
            entry = self._entries.pop(token)
            entry.timer.cancel()
            entry.exchange.close(False)
