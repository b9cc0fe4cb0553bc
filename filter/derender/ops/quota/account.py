"""One request's charges (``Account``) and the headers clients read."""

from __future__ import annotations

import datetime as dt
import logging
import math
import os

from .. import metrics
from .config import Key, Limits
from .store import STORE_ERRORS, Connection, Decision, Quotas

log = logging.getLogger("derender.quota")


class QuotaUnavailable(Exception):
    """Redis could not be asked and the file says ``on_redis_error: closed``."""


class Account:
    """One request's charges against its key's budgets: reserved before the producer is called,
    extended in batches while it streams, settled to what it used at the end."""

    @classmethod
    def of(cls, quotas: Quotas, headers: dict[str, str]) -> Account | None:
        """The account a request's charges go to, or None when no limits apply to its key."""
        found = quotas.key_for(headers)
        return cls(quotas, *found) if found is not None else None

    def __init__(self, quotas: Quotas, ident: str, key: Key) -> None:
        self.quotas, self.ident, self.key = quotas, ident, key
        self.scopes: list[tuple[str, Limits]] = []
        self.stream_id = os.urandom(8).hex()
        self.reserved = 0.0  # weighted tokens taken so far (the reservation and its extensions)
        self.covered = 0  # completion tokens the reservation covers
        self.prompt_tokens = 0
        self.decision: Decision | None = None  # the reservation's: for the response's headers
        self.active = False  # Redis holds a reservation to settle
        self.connection: Connection | None = None  # the Redis client it was reserved on

    async def reserve(self, model: str | None, prompt_tokens: int, completion_tokens: int) -> Decision | None:
        """Reserve the prompt and ``completion_tokens``; the refusal, or None (allowed). Raises
        ``QuotaUnavailable`` when Redis cannot answer and the file says closed."""
        self.scopes = self.quotas.scopes(self.ident, self.key, model)
        if not self.scopes:
            return None
        self.prompt_tokens = prompt_tokens
        amount = self.key.prompt_weight * prompt_tokens + self.key.completion_weight * completion_tokens
        try:
            decision = await self.quotas.run(self.scopes, "reserve", amount, self.stream_id)
        except STORE_ERRORS as exc:
            self._unavailable("reserve", exc)  # open: the request goes on, uncounted
            return None
        self.decision = decision
        if not decision.ok:
            metrics.QUOTA_REFUSALS.labels(self.ident, decision.limit).inc()
            return decision
        self.active = True
        self.connection = self.quotas.connection  # settled on the Redis it was reserved on
        self.connection.users += 1
        self.reserved, self.covered = amount, completion_tokens
        return None

    def _unavailable(self, what: str, exc: BaseException) -> None:
        closed = self.quotas.config.on_redis_error == "closed"
        metrics.QUOTA_REDIS_ERRORS.labels("closed" if closed else "open").inc()
        log.warning(
            "quota: Redis did not answer (%s: %s): failing %s", what, type(exc).__name__, "closed" if closed else "open"
        )
        if closed:
            raise QuotaUnavailable(f"the quota store is unavailable ({type(exc).__name__}); retry later") from None

    async def extend(self, used: int) -> bool:
        """``used`` completion tokens have passed: cover them and a batch more if the budget has it.
        False: the budget has run out at ``covered`` tokens (the stream ends there)."""
        want = used + self.quotas.config.batch_tokens - self.covered
        if not self.active or self.key.completion_weight == 0:  # nothing to count against
            self.covered += want
            return True
        amount = self.key.completion_weight * want
        try:
            decision = await self.quotas.run(self.scopes, "extend", amount, self.stream_id)
        except STORE_ERRORS as exc:
            try:
                self._unavailable("extend", exc)
            except QuotaUnavailable:
                return False
            self.covered += want  # open: the stream goes on uncounted for this batch
            return True
        self.reserved += decision.granted
        self.covered += int(decision.granted / self.key.completion_weight)
        return used <= self.covered

    async def settle(self, completion_tokens: int) -> None:
        """Charge the prompt and the completion tokens the client got, give back the rest of the
        reservation, free the stream's slot."""
        if not self.active:
            return
        self.active = False
        used = self.key.prompt_weight * self.prompt_tokens + self.key.completion_weight * completion_tokens
        metrics.QUOTA_TOKENS.labels(self.ident, "prompt").inc(self.prompt_tokens)
        if completion_tokens:
            metrics.QUOTA_TOKENS.labels(self.ident, "completion").inc(completion_tokens)
        try:
            await self.quotas.run(self.scopes, "settle", used - self.reserved, self.stream_id)
        except STORE_ERRORS as exc:
            log.warning("quota: could not settle %s's request (%s); its reservation stands", self.ident, exc)
        finally:
            if self.connection is not None:
                await self.connection.released()


def _duration(ms: int) -> str:
    """OpenAI's reset format: ``1s``, ``6m0s``, ``250ms``."""
    if ms < 1000:
        return f"{max(0, ms)}ms"
    seconds = math.ceil(ms / 1000)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def _at(ms: int) -> str:
    """Anthropic's reset format: the instant, RFC 3339 in UTC."""
    t = dt.datetime.now(dt.timezone.utc) + dt.timedelta(milliseconds=max(0, ms))
    return t.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def headers(decision: Decision | None, anthropic: bool) -> dict[str, str]:
    """The rate-limit headers clients read, for the limits the key has (``Retry-After`` on a refusal)."""
    if decision is None:
        return {}
    out: dict[str, str] = {}
    d = decision
    for kind, limit, remaining, reset in (
        ("requests", d.requests_limit, d.requests_remaining, d.requests_reset_ms),
        ("tokens", d.tokens_limit, d.tokens_remaining, d.tokens_reset_ms),
    ):
        if not limit:
            continue
        if anthropic:  # anthropic-ratelimit-tokens-remaining, ...; reset: the instant
            named = {"limit": str(limit), "remaining": str(remaining), "reset": _at(reset)}
            out.update({f"anthropic-ratelimit-{kind}-{k}": v for k, v in named.items()})
        else:  # x-ratelimit-remaining-tokens, ...; reset: a duration
            named = {"limit": str(limit), "remaining": str(remaining), "reset": _duration(reset)}
            out.update({f"x-ratelimit-{k}-{kind}": v for k, v in named.items()})
    if not d.ok and d.retry_ms >= 0:
        out["retry-after"] = str(max(1, math.ceil(d.retry_ms / 1000)))
    return out


def refusal_message(decision: Decision) -> str:
    what = decision.limit.replace("_", " ")
    if decision.retry_ms < 0:
        return f"Request too large: it needs more tokens than the key's {what} allow at once"
    return f"Rate limit reached for this API key: {what}; retry after {max(1, math.ceil(decision.retry_ms / 1000))} s"
