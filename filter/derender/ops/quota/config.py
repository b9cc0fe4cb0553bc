"""The quota file: its keys, their limits, and the errors that name a bad entry."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


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
    priority: int = 0  # flow control: its requests' band (vLLM's convention: lower is served first)
    weight: float = 1.0  # flow control: its share within the band, against other keys'


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
KEY_FIELDS = LIMIT_FIELDS | {
    "name",
    "key",
    "key_env",
    "key_sha256",
    "models",
    "prompt_weight",
    "completion_weight",
    "priority",
    "weight",
}


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
        priority=_priority(where, entry.get("priority", 0)),
        weight=_share(where, entry.get("weight", 1.0)),
    )
    return secret, key


def _share(where: str, value: Any) -> float:
    if _weight(where, "weight", value) <= 0:
        raise QuotaConfigError(f"{where}: weight must be above 0 (got {value!r})")
    return float(value)


def _priority(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -1000 <= value <= 1000:
        raise QuotaConfigError(f"{where}: priority must be a whole number from -1000 to 1000 (got {value!r})")
    return value


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
