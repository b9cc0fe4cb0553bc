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

from typing import Any

from .account import Account, QuotaUnavailable, headers, refusal_message
from .config import Key, Limits, QuotaConfig, QuotaConfigError, digest, load, parse
from .store import STORE_ERRORS, Decision, Quotas, api_key, show


def configured(settings: Any) -> Quotas | None:
    """One worker's budgets: the ``Settings``' quota file (None: no limits), its Redis the file's or
    the Responses store's."""
    path = settings.quota_config
    return Quotas(load(path, settings.responses_store)) if path else None


__all__ = [
    "STORE_ERRORS",
    "Account",
    "Decision",
    "Key",
    "Limits",
    "QuotaConfig",
    "QuotaConfigError",
    "QuotaUnavailable",
    "Quotas",
    "api_key",
    "configured",
    "digest",
    "headers",
    "load",
    "parse",
    "refusal_message",
    "show",
]
