"""Token budgets per API key (``--quota-config FILE``), kept in Redis and shared by every filter replica.

Per key (and per key and model, where the file says so): a token rate (a bucket of ``burst`` tokens
refilled at ``tokens_per_minute``), token budgets per UTC day and month, requests per minute and
concurrent streams; prompt and completion tokens weighted as configured. Before the producer is
called, the request's exact prompt tokens and its ``max_tokens`` (or ``reservation`` when it asks for
none) are reserved in one Lua script; a refusal is a 429 in the client's shape with ``Retry-After``.
While a stream runs, its completion tokens are charged against the reservation and, past it, in
batches of ``batch_tokens``; a batch refused ends the stream there. At the end the reservation is
settled to what was used. ``docs/quotas.md`` has the file's format and what clients see.
"""

from __future__ import annotations

import calendar
import datetime as dt
import hashlib
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field, fields
from typing import Any

from redis.exceptions import RedisError

log = logging.getLogger("derender.quota")

PREFIX = "derender:quota:"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
STORE_ERRORS = (RedisError, OSError, TimeoutError)  # Redis not answering, as redis-py's asyncio client raises it
LEASE_S = 3600  # a stream's concurrency slot lapses after this if no filter ever settles it (a crash)


class QuotaConfigError(ValueError):
    """A quota file that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class Limits:
    """One scope's limits; 0 is no limit."""

    tokens_per_minute: int = 0
    burst: int = 0  # the bucket's size (default: tokens_per_minute)
    tokens_per_day: int = 0
    tokens_per_month: int = 0
    requests_per_minute: int = 0
    concurrent_streams: int = 0

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    @property
    def bucket(self) -> int:
        return self.burst or self.tokens_per_minute


@dataclass(frozen=True)
class Key:
    """A configured key: its label-safe name, its limits, and per-model limits."""

    name: str
    limits: Limits
    models: dict[str, Limits] = field(default_factory=dict)
    prompt_weight: float = 1.0
    completion_weight: float = 1.0


@dataclass(frozen=True)
class QuotaConfig:
    keys: dict[str, Key]  # by the sha256 hex digest of the secret
    default: Key | None  # for a key the file does not list (each such key its own counters)
    redis: str
    on_redis_error: str = "closed"  # or "open"
    reservation: int = 1024  # completion tokens reserved for a request that names no max_tokens
    batch_tokens: int = 32  # completion tokens charged per Redis call past the reservation
    max_reservation: int = 0  # at most this many completion tokens reserved up front (0: max_tokens whole)


LIMIT_FIELDS = {f.name for f in fields(Limits)}
KEY_FIELDS = LIMIT_FIELDS | {"name", "key", "key_env", "key_sha256", "models", "prompt_weight", "completion_weight"}


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _count(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise QuotaConfigError(f"{where}: {name} must be a whole number >= 0 (got {value!r})")
    return value


def _limits(where: str, entry: dict) -> Limits:
    limits = Limits(**{k: _count(where, k, v) for k, v in entry.items() if k in LIMIT_FIELDS})
    if limits.burst and not limits.tokens_per_minute:
        raise QuotaConfigError(f"{where}: burst needs tokens_per_minute")
    return limits


def _weight(where: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1000:
        raise QuotaConfigError(f"{where}: {name} must be a number from 0 to 1000 (got {value!r})")
    return float(value)


def _key(where: str, entry: Any, named: bool) -> tuple[str | None, Key]:
    if not isinstance(entry, dict):
        raise QuotaConfigError(f"{where}: an entry is a mapping of limits (got {type(entry).__name__})")
    unknown = sorted(set(entry) - KEY_FIELDS)
    if unknown:
        raise QuotaConfigError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(sorted(KEY_FIELDS))})")
    secret: str | None = None
    found = [k for k in ("key", "key_env", "key_sha256") if k in entry]
    if named:
        if len(found) != 1:
            raise QuotaConfigError(
                f"{where}: give the key once, as key_env (an environment variable), key_sha256 or key"
            )
        how = found[0]
        value = entry[how]
        if not isinstance(value, str) or not value:
            raise QuotaConfigError(f"{where}: {how} must be a non-empty string")
        if how == "key_env":
            secret = os.environ.get(value)
            if not secret:
                raise QuotaConfigError(f"{where}: the environment variable {value} is not set")
            secret = digest(secret)
        elif how == "key":
            secret = digest(value)
        else:
            if not re.fullmatch(r"[0-9a-f]{64}", value):
                raise QuotaConfigError(f"{where}: key_sha256 must be 64 lowercase hex digits")
            secret = value
    elif found:
        raise QuotaConfigError(f"{where}: the default entry names no key")
    name = entry.get("name", "")
    if named and not (isinstance(name, str) and NAME.fullmatch(name)):
        raise QuotaConfigError(f"{where}: name must be 1-64 of A-Z a-z 0-9 _ . - (it labels metrics and Redis keys)")
    models: dict[str, Limits] = {}
    for model, limits in (entry.get("models") or {}).items():
        if not isinstance(limits, dict) or set(limits) - LIMIT_FIELDS:
            raise QuotaConfigError(f"{where}: models.{model} takes only {', '.join(sorted(LIMIT_FIELDS))}")
        models[str(model)] = _limits(f"{where}: models.{model}", limits)
    key = Key(
        name=name or "default",
        limits=_limits(where, entry),
        models=models,
        prompt_weight=_weight(where, "prompt_weight", entry.get("prompt_weight", 1.0)),
        completion_weight=_weight(where, "completion_weight", entry.get("completion_weight", 1.0)),
    )
    return secret, key


def parse(data: Any, source: str, redis_fallback: str | None = None) -> QuotaConfig:
    """The quota file's content (parsed YAML); raises ``QuotaConfigError`` naming the bad entry."""
    if not isinstance(data, dict):
        raise QuotaConfigError(f"{source}: the file is a mapping with keys: (and default:, redis:, ...)")
    top = {"keys", "default", "redis", "on_redis_error", "reservation", "batch_tokens", "max_reservation"}
    unknown = sorted(set(data) - top)
    if unknown:
        raise QuotaConfigError(f"{source}: unknown field {unknown[0]!r} (fields: {', '.join(sorted(top))})")
    keys: dict[str, Key] = {}
    names: set[str] = set()
    entries = data.get("keys") or []
    if not isinstance(entries, list):
        raise QuotaConfigError(f"{source}: keys is a list of entries")
    for i, entry in enumerate(entries):
        where = f"{source}: keys[{i}]"
        secret, key = _key(where, entry, named=True)
        assert secret is not None
        if secret in keys or key.name in names:
            raise QuotaConfigError(f"{where}: key or name {key.name!r} listed twice")
        keys[secret] = key
        names.add(key.name)
    default = None
    if data.get("default") is not None:
        _, default = _key(f"{source}: default", data["default"], named=False)
    redis = data.get("redis") or redis_fallback
    if not redis or not isinstance(redis, str) or not redis.startswith(("redis://", "rediss://", "unix://")):
        raise QuotaConfigError(f"{source}: redis: a redis:// URL (or --responses-store) is needed for quotas")
    on_error = data.get("on_redis_error", "closed")
    if on_error not in ("open", "closed"):
        raise QuotaConfigError(f"{source}: on_redis_error is open or closed (got {on_error!r})")
    reservation = _count(source, "reservation", data.get("reservation", 1024))
    batch = _count(source, "batch_tokens", data.get("batch_tokens", 32))
    if batch < 1:
        raise QuotaConfigError(f"{source}: batch_tokens must be at least 1")
    cap = _count(source, "max_reservation", data.get("max_reservation", 0))
    return QuotaConfig(keys, default, redis, on_error, reservation, batch, cap)


def load(path: str, redis_fallback: str | None = None) -> QuotaConfig:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise QuotaConfigError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise QuotaConfigError(f"{path}: not YAML: {exc}") from None
    return parse(data, path, redis_fallback)


# -- Redis ---------------------------------------------------------------------------------------
# One script for every change, so that a request's scopes (the key's, the key-and-model's) are
# checked and changed together. KEYS: per scope its hash and its streams' sorted set. ARGV: now (ms),
# the UTC day and month, ms to the next day and month, the stream's id, its lease (ms), the mode
# (reserve: check, then take the tokens, a request and a stream slot; extend: check, then take the
# tokens; settle: take or give back the tokens, free the slot; peek: nothing), then per scope: tokens,
# tokens_per_minute, bucket, tokens_per_day, tokens_per_month, requests_per_minute, concurrent_streams.
# extend takes as much of the tokens as every scope has left (granted). Returns {ok, the refusing limit
# or "", retry ms, tokens limit, tokens remaining, tokens reset ms, requests limit, requests remaining,
# requests reset ms, day's tokens used, month's tokens used, granted} for the first scope (or the
# refusing one).
SCRIPT = """
local now = tonumber(ARGV[1])
local day, month = ARGV[2], ARGV[3]
local to_day, to_month = tonumber(ARGV[4]), tonumber(ARGV[5])
local sid, lease, mode = ARGV[6], tonumber(ARGV[7]), ARGV[8]
local n = #KEYS / 2
local s = {}
for i = 1, n do
  local a = 8 + (i - 1) * 7
  local x = {h = KEYS[2 * i - 1], z = KEYS[2 * i], amount = tonumber(ARGV[a + 1]), tpm = tonumber(ARGV[a + 2]),
             cap = tonumber(ARGV[a + 3]), tpd = tonumber(ARGV[a + 4]), tpmo = tonumber(ARGV[a + 5]),
             rpm = tonumber(ARGV[a + 6]), conc = tonumber(ARGV[a + 7])}
  local f = redis.call('HMGET', x.h, 'b', 'bt', 'd', 'dd', 'm', 'mm', 'r', 'rt')
  x.b = x.cap
  if f[1] and x.tpm > 0 then x.b = math.min(x.cap, tonumber(f[1]) + (now - tonumber(f[2])) * x.tpm / 60000) end
  x.d = 0
  if f[4] == day then x.d = tonumber(f[3]) end
  x.m = 0
  if f[6] == month then x.m = tonumber(f[5]) end
  x.r = x.rpm
  if f[7] and x.rpm > 0 then x.r = math.min(x.rpm, tonumber(f[7]) + (now - tonumber(f[8])) * x.rpm / 60000) end
  s[i] = x
end
local granted = 0
local function answer(ok, why, retry, x)
  local tl, tr, treset = 0, 0, 0
  if x.tpm > 0 then
    tl, tr, treset = x.cap, math.max(0, x.b), math.ceil((x.cap - x.b) * 60000 / x.tpm)
  elseif x.tpd > 0 then
    tl, tr, treset = x.tpd, math.max(0, x.tpd - x.d), to_day
  elseif x.tpmo > 0 then
    tl, tr, treset = x.tpmo, math.max(0, x.tpmo - x.m), to_month
  end
  local rl, rr, rreset = 0, 0, 0
  if x.rpm > 0 then rl, rr, rreset = x.rpm, math.max(0, x.r), math.ceil((x.rpm - x.r) * 60000 / x.rpm) end
  return {ok, why, tostring(math.ceil(retry)), tostring(tl), tostring(math.floor(tr)), tostring(math.max(0, treset)),
          tostring(rl), tostring(math.floor(rr)), tostring(math.max(0, rreset)), tostring(x.d), tostring(x.m),
          tostring(granted)}
end
if mode == 'extend' then
  -- as much of the amount as every scope has left (a stream ends where this reaches nothing)
  local left = s[1].amount
  for i = 1, n do
    local x = s[i]
    if x.tpm > 0 then left = math.min(left, x.b) end
    if x.tpd > 0 then left = math.min(left, x.tpd - x.d) end
    if x.tpmo > 0 then left = math.min(left, x.tpmo - x.m) end
  end
  left = math.max(0, left)
  for i = 1, n do s[i].amount = left end
  granted = left
  if left <= 0 then return answer(0, 'tokens', 0, s[1]) end
end
if mode == 'reserve' then
  for i = 1, n do
    local x = s[i]
    if x.tpm > 0 and x.amount > x.cap then return answer(0, 'tokens_per_minute', -1, x) end
    if x.tpm > 0 and x.b < x.amount then return answer(0, 'tokens_per_minute', (x.amount - x.b) * 60000 / x.tpm, x) end
    if x.tpd > 0 and x.d + x.amount > x.tpd then return answer(0, 'tokens_per_day', to_day, x) end
    if x.tpmo > 0 and x.m + x.amount > x.tpmo then return answer(0, 'tokens_per_month', to_month, x) end
    do
      if x.rpm > 0 and x.r < 1 then return answer(0, 'requests_per_minute', (1 - x.r) * 60000 / x.rpm, x) end
      if x.conc > 0 then
        redis.call('ZREMRANGEBYSCORE', x.z, '-inf', now)
        if redis.call('ZCARD', x.z) >= x.conc then return answer(0, 'concurrent_streams', 1000, x) end
      end
    end
  end
end
if mode ~= 'peek' then
  for i = 1, n do
    local x = s[i]
    if x.tpm > 0 then x.b = math.min(x.cap, x.b - x.amount) end
    x.d = math.max(0, x.d + x.amount)
    x.m = math.max(0, x.m + x.amount)
    if mode == 'reserve' then
      if x.rpm > 0 then x.r = x.r - 1 end
      if x.conc > 0 then
        redis.call('ZADD', x.z, now + lease, sid)
        redis.call('PEXPIRE', x.z, lease)
      end
    elseif mode == 'settle' then
      redis.call('ZREM', x.z, sid)
    end
    redis.call('HSET', x.h, 'b', x.b, 'bt', now, 'd', x.d, 'dd', day, 'm', x.m, 'mm', month, 'r', x.r, 'rt', now)
    redis.call('PEXPIRE', x.h, 32 * 86400000 + to_month)
  end
end
return answer(1, '', 0, s[1])
"""


@dataclass
class Decision:
    """What one script call said, as numbers for the rate-limit headers."""

    ok: bool
    limit: str  # the refusing limit's name, "" when ok
    retry_ms: int  # -1: never fits
    tokens_limit: int
    tokens_remaining: int
    tokens_reset_ms: int
    requests_limit: int
    requests_remaining: int
    requests_reset_ms: int
    day_used: float = 0.0
    month_used: float = 0.0
    granted: float = 0.0

    @classmethod
    def of(cls, raw: list[Any]) -> Decision:
        v = [x.decode() if isinstance(x, bytes) else x for x in raw]
        ints = [int(float(x)) for x in v[2:9]]
        return cls(bool(int(v[0])), str(v[1]), *ints, *(float(x) for x in v[9:12]))


def _periods(now: float) -> tuple[str, str, int, int]:
    """(UTC day, UTC month, ms to the next day, ms to the next month) at ``now`` (epoch seconds)."""
    t = dt.datetime.fromtimestamp(now, dt.timezone.utc)
    next_day = dt.datetime(t.year, t.month, t.day, tzinfo=dt.timezone.utc) + dt.timedelta(days=1)
    days = calendar.monthrange(t.year, t.month)[1]
    next_month = dt.datetime(t.year, t.month, 1, tzinfo=dt.timezone.utc) + dt.timedelta(days=days)
    return (
        t.strftime("%Y-%m-%d"),
        t.strftime("%Y-%m"),
        math.ceil((next_day.timestamp() - now) * 1000),
        math.ceil((next_month.timestamp() - now) * 1000),
    )


class Quotas:
    """The quota file's keys and the Redis that holds their counts (one client per worker)."""

    def __init__(self, config: QuotaConfig) -> None:
        self.config = config
        self._client: Any = None
        self._script: Any = None

    def _redis(self) -> Any:
        if self._client is None:
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(self.config.redis, socket_timeout=2, socket_connect_timeout=2)
            self._script = self._client.register_script(SCRIPT)
        return self._client

    def key_for(self, headers: dict[str, str]) -> tuple[str, Key] | None:
        """(the id its counters are kept under, the key's entry) for a request's API key, or None when
        no limits apply to it."""
        secret = headers.get("x-api-key") or ""
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            secret = auth[7:].strip() or secret
        if not secret:
            return None
        hashed = digest(secret)
        key = self.config.keys.get(hashed)
        if key is not None:
            return key.name, key
        if self.config.default is not None:
            return "default-" + hashed[:16], self.config.default
        return None

    def account(self, headers: dict[str, str]) -> Account | None:
        """The account a request's charges go to, or None when no limits apply to its key."""
        found = self.key_for(headers)
        return Account(self, *found) if found is not None else None

    def scopes(self, ident: str, key: Key, model: str | None) -> list[tuple[str, Limits]]:
        out = [(f"{PREFIX}{{{ident}}}", key.limits)] if key.limits.any else []
        if model is not None and model in key.models:
            out.append((f"{PREFIX}{{{ident}}}:model:{model}", key.models[model]))
        return out

    async def run(self, scopes: list[tuple[str, Limits]], mode: str, tokens: float, stream_id: str) -> Decision:
        """One script call over ``scopes``; raises ``redis.RedisError`` when Redis cannot answer."""
        self._redis()
        now = time.time()
        day, month, to_day, to_month = _periods(now)
        keys: list[str] = []
        args: list[Any] = [int(now * 1000), day, month, to_day, to_month, stream_id, LEASE_S * 1000, mode]
        for name, limits in scopes:
            keys += [name, name + ":streams"]
            args += [
                repr(float(tokens)),
                limits.tokens_per_minute,
                limits.bucket,
                limits.tokens_per_day,
                limits.tokens_per_month,
                limits.requests_per_minute,
                limits.concurrent_streams,
            ]
        return Decision.of(await self._script(keys=keys, args=args))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


async def show(config: QuotaConfig, secret_or_name: str) -> dict[str, Any]:
    """What remains for a key (``derender quota show``): each scope's counts, nothing changed."""
    quotas = Quotas(config)
    found = None
    for hashed, key in config.keys.items():
        if secret_or_name in (key.name, hashed) or digest(secret_or_name) == hashed:
            found = (key.name, key)
    if found is None:
        found = quotas.key_for({"authorization": f"Bearer {secret_or_name}"})
    if found is None:
        raise QuotaConfigError(f"no quota applies to {secret_or_name!r} (neither a listed key or name, nor a default)")
    ident, key = found
    out: dict[str, Any] = {"key": ident, "scopes": {}}
    try:
        for model in [None, *key.models]:
            scope = quotas.scopes(ident, key, model)[-1:] if model else quotas.scopes(ident, key, None)
            if not scope:
                continue
            d = await quotas.run(scope, "peek", 0, "")
            limits = scope[0][1]
            out["scopes"][model or "*"] = {
                "limits": {f.name: getattr(limits, f.name) for f in fields(limits) if getattr(limits, f.name)},
                "tokens_remaining": d.tokens_remaining,
                "tokens_reset_s": round(d.tokens_reset_ms / 1000, 1),
                "requests_remaining": d.requests_remaining,
                "tokens_used_today": d.day_used,
                "tokens_used_this_month": d.month_used,
            }
    finally:
        await quotas.close()
    return out


class QuotaUnavailable(Exception):
    """Redis could not be asked and the file says ``on_redis_error: closed``."""


class Account:
    """One request's charges against its key's budgets: reserved before the producer is called,
    extended in batches while it streams, settled to what it used at the end."""

    def __init__(self, quotas: Quotas, ident: str, key: Key) -> None:
        self.quotas, self.ident, self.key = quotas, ident, key
        self.scopes: list[tuple[str, Limits]] = []
        self.stream_id = os.urandom(8).hex()
        self.reserved = 0.0  # weighted tokens taken so far (the reservation and its extensions)
        self.covered = 0  # completion tokens the reservation covers
        self.prompt_tokens = 0
        self.decision: Decision | None = None  # the reservation's: for the response's headers
        self.active = False  # Redis holds a reservation to settle
        self.cut = False  # the stream was ended at the budget

    async def reserve(self, model: str | None, prompt_tokens: int, completion_tokens: int) -> Decision | None:
        """Reserve the prompt and ``completion_tokens``; the refusal, or None (allowed). Raises
        ``QuotaUnavailable`` when Redis cannot answer and the file says closed."""
        from . import metrics

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
        self.reserved, self.covered = amount, completion_tokens
        return None

    def _unavailable(self, what: str, exc: BaseException) -> None:
        from . import metrics

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

    async def settle(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """Charge what was used (``None``: as reserved), give back the rest, free the stream's slot."""
        from . import metrics

        if not self.active:
            return
        self.active = False
        prompt = self.prompt_tokens if prompt_tokens is None else prompt_tokens
        used = self.key.prompt_weight * prompt
        completion = completion_tokens if completion_tokens is not None else None
        if completion is None:
            used = self.reserved  # nothing known: keep the reservation
        else:
            used += self.key.completion_weight * completion
        metrics.QUOTA_TOKENS.labels(self.ident, "prompt").inc(prompt)
        if completion:
            metrics.QUOTA_TOKENS.labels(self.ident, "completion").inc(completion)
        try:
            await self.quotas.run(self.scopes, "settle", used - self.reserved, self.stream_id)
        except STORE_ERRORS as exc:
            log.warning("quota: could not settle %s's request (%s); its reservation stands", self.ident, exc)


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
    if anthropic:
        if d.requests_limit:
            out["anthropic-ratelimit-requests-limit"] = str(d.requests_limit)
            out["anthropic-ratelimit-requests-remaining"] = str(d.requests_remaining)
            out["anthropic-ratelimit-requests-reset"] = _at(d.requests_reset_ms)
        if d.tokens_limit:
            out["anthropic-ratelimit-tokens-limit"] = str(d.tokens_limit)
            out["anthropic-ratelimit-tokens-remaining"] = str(d.tokens_remaining)
            out["anthropic-ratelimit-tokens-reset"] = _at(d.tokens_reset_ms)
    else:
        if d.requests_limit:
            out["x-ratelimit-limit-requests"] = str(d.requests_limit)
            out["x-ratelimit-remaining-requests"] = str(d.requests_remaining)
            out["x-ratelimit-reset-requests"] = _duration(d.requests_reset_ms)
        if d.tokens_limit:
            out["x-ratelimit-limit-tokens"] = str(d.tokens_limit)
            out["x-ratelimit-remaining-tokens"] = str(d.tokens_remaining)
            out["x-ratelimit-reset-tokens"] = _duration(d.tokens_reset_ms)
    if not d.ok and d.retry_ms >= 0:
        out["retry-after"] = str(max(1, math.ceil(d.retry_ms / 1000)))
    return out


def refusal_message(decision: Decision) -> str:
    what = decision.limit.replace("_", " ")
    if decision.retry_ms < 0:
        return f"Request too large: it needs more tokens than the key's {what} allow at once"
    return f"Rate limit reached for this API key: {what}; retry after {max(1, math.ceil(decision.retry_ms / 1000))} s"
