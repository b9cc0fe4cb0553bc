"""The counts in Redis: one Lua script for every change, the accounts' ``Quotas``, ``show``."""

from __future__ import annotations

import asyncio
import calendar
import datetime as dt
import math
import time
from dataclasses import dataclass, fields
from typing import Any

from redis.exceptions import RedisError

from .config import Key, Limits, QuotaConfig, QuotaConfigError, digest

PREFIX = "derender:quota:"
STORE_ERRORS = (RedisError, OSError, TimeoutError)  # Redis not answering, as redis-py's asyncio client raises it
LEASE_S = 3600  # a stream's concurrency slot lapses after this if no filter ever settles it (a crash)


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
local function fields(text)
  local out = {}
  for part in string.gmatch(text, '[^,]+') do out[#out + 1] = part end
  return out
end
local g = fields(ARGV[1])
local now = tonumber(g[1])
local day, month = g[2], g[3]
local to_day, to_month = tonumber(g[4]), tonumber(g[5])
local sid, lease, mode = g[6], tonumber(g[7]), g[8]
local n = #KEYS / 2
local s = {}
for i = 1, n do
  local a = fields(ARGV[i + 1])
  local x = {h = KEYS[2 * i - 1], z = KEYS[2 * i], amount = tonumber(a[1]), tpm = tonumber(a[2]), cap = tonumber(a[3]),
             tpd = tonumber(a[4]), tpmo = tonumber(a[5]), rpm = tonumber(a[6]), conc = tonumber(a[7])}
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
  return table.concat({ok, why, math.ceil(retry), tl, math.floor(tr), math.max(0, treset), rl, math.floor(rr),
                       math.max(0, rreset), x.d, x.m, granted}, ',')
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
    def of(cls, raw: bytes | str) -> Decision:
        v = (raw.decode() if isinstance(raw, bytes) else raw).split(",")
        ints = [int(float(x)) for x in v[2:9]]
        return cls(v[0] == "1", v[1], *ints, *(float(x) for x in v[9:12]))


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


class Connection:
    """One Redis client for the quota script (made at first use), shared by the ``Quotas`` of every
    reload that names the same Redis; one a reload leaves (``retire``) closes once the requests
    admitted on it (``users``) have settled."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client: Any = None
        self.script: Any = None
        self.users = 0  # reservations on it not yet settled
        self.retired = False

    def ready(self) -> Any:
        if self.client is None:
            import redis.asyncio as aioredis

            self.client = aioredis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)
            self.script = self.client.register_script(SCRIPT)
        return self.script

    def retire(self) -> None:
        self.retired = True
        if self.users == 0:
            _CLOSING.add(task := asyncio.get_running_loop().create_task(self.close()))
            task.add_done_callback(_CLOSING.discard)

    async def released(self) -> None:
        """A reservation on it has settled."""
        self.users -= 1
        if self.retired and self.users == 0:
            await self.close()

    async def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.aclose()


_CLOSING: set[asyncio.Task] = set()  # retired clients being closed (a reference keeps each task alive)


def api_key(headers: dict[str, str]) -> str:
    """A request's API key: its ``Authorization: Bearer`` key, else its ``x-api-key`` ("" if neither)."""
    auth = headers.get("authorization", "")
    bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    return bearer or headers.get("x-api-key") or ""


class Quotas:
    """The quota file's keys and the Redis that holds their counts (one client per worker)."""

    def __init__(self, config: QuotaConfig) -> None:
        self.config = config
        self.connection = Connection(config.redis)

    def succeed(self, old: Quotas | None) -> None:
        """These budgets replace ``old``'s (SIGHUP): the same Redis keeps its client; another Redis
        retires ``old``'s, closed once the requests admitted on it have settled."""
        if old is None or old is self:
            return
        if old.connection.url == self.config.redis:
            self.connection = old.connection
        else:
            old.connection.retire()

    def key_for(self, headers: dict[str, str]) -> tuple[str, Key] | None:
        """(the id its counters are kept under, the key's entry) for a request's API key, or None when
        no limits apply to it."""
        secret = api_key(headers)
        if not secret:
            return None
        hashed = digest(secret)
        key = self.config.keys.get(hashed)
        if key is not None:
            return key.name, key
        if self.config.default is not None:
            return "default-" + hashed[:16], self.config.default
        return None

    def scopes(self, ident: str, key: Key, model: str | None) -> list[tuple[str, Limits]]:
        out = [(f"{PREFIX}{{{ident}}}", key.limits)] if key.limits.any else []
        if model is not None and model in key.models:
            out.append((f"{PREFIX}{{{ident}}}:model:{model}", key.models[model]))
        return out

    async def run(self, scopes: list[tuple[str, Limits]], mode: str, tokens: float, stream_id: str) -> Decision:
        """One script call over ``scopes``; raises ``redis.RedisError`` when Redis cannot answer."""
        script = self.connection.ready()
        now = time.time()
        day, month, to_day, to_month = _periods(now)
        keys: list[str] = []
        args = [f"{int(now * 1000)},{day},{month},{to_day},{to_month},{stream_id or '-'},{LEASE_S * 1000},{mode}"]
        for name, limits in scopes:  # one argument per scope: fewer for redis-py to pack, Redis to parse
            keys += [name, name + ":streams"]
            args.append(
                f"{float(tokens)!r},{limits.tokens_per_minute},{limits.bucket},{limits.tokens_per_day},"
                f"{limits.tokens_per_month},{limits.requests_per_minute},{limits.concurrent_streams}"
            )
        return Decision.of(await script(keys=keys, args=args))

    async def close(self) -> None:
        await self.connection.close()


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
