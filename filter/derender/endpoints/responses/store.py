"""``--responses-store URL``: vLLM's Responses store, in Redis, shared by every worker and replica.

vLLM 0.33 keeps stored responses (``VLLM_ENABLE_RESPONSES_API_STORE=1``) in two dicts of
one process: ``response_store`` (id -> ``ResponsesResponse``) and ``msg_store`` (id -> the
conversation's messages, which ``previous_response_id`` continues). Behind a fleet of
filters (``--workers``, replicas behind a load balancer) the next turn lands anywhere, so
the filter hands vLLM's serving object two mappings with the same ``get`` / ``[]`` /
``in`` that read and write Redis instead: JSON, never pickle, with a time to live
(``--responses-store-ttl``, default 30 days, as OpenAI keeps responses).

A store that cannot be reached is a 503 (``StoreUnavailable``): before anything is
generated when the request needs the store (``previous_response_id``, or ``store`` true,
the API's default), and for the answer when its write fails, so that an answer the client
was told is stored always is.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from ...settings import Settings

log = logging.getLogger("derender.store")

DEFAULT_TTL = 30 * 24 * 3600
PREFIX = "derender:responses:"


def unavailable(detail: str) -> Exception:
    """vLLM's retryable error with status 503: its error handler answers ServiceUnavailableError."""
    from http import HTTPStatus

    from vllm.exceptions import RetryableRequestError

    error = RetryableRequestError(f"the responses store is unavailable ({detail}); retry later")
    error.status_code = HTTPStatus.SERVICE_UNAVAILABLE
    return error


class RedisMapping:
    """A dict-like view of one kind of record in Redis, for vLLM's code."""

    def __init__(
        self, client: Any, kind: str, dumps: Callable[[Any], str], loads: Callable[[str], Any], ttl: int
    ) -> None:
        self.client = client
        self.prefix = f"{PREFIX}{kind}:"
        self.dumps, self.loads, self.ttl = dumps, loads, ttl

    def _call(self, method: str, *args: Any) -> Any:
        import redis

        try:
            return getattr(self.client, method)(*args)
        except redis.RedisError as exc:
            log.warning("responses store: %s", exc)
            raise unavailable(type(exc).__name__) from None

    def get(self, key: str, default: Any = None) -> Any:
        raw = self._call("get", self.prefix + key)
        return default if raw is None else self.loads(raw)

    def __getitem__(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        self._call("set", self.prefix + key, self.dumps(value), self.ttl)

    def __contains__(self, key: object) -> bool:
        return bool(self._call("exists", self.prefix + str(key)))

    def pop(self, key: str, default: Any = None) -> Any:
        value = self.get(key, default)
        self._call("delete", self.prefix + key)
        return value


def _dump_response(response: Any) -> str:
    return response.model_dump_json(by_alias=True)


def _load_response(raw: str) -> Any:
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse

    return ResponsesResponse.model_validate_json(raw)


def _dump_messages(messages: list[Any]) -> str:
    """Chat messages (dicts, some holding pydantic models) or Harmony messages, as tagged JSON."""
    from pydantic import TypeAdapter

    if messages and hasattr(messages[0], "to_dict") and type(messages[0]).__module__.startswith("openai_harmony"):
        return json.dumps({"harmony": [m.to_dict() for m in messages]})
    return json.dumps({"chat": json.loads(TypeAdapter(list[Any]).dump_json(messages))})


def _load_messages(raw: str) -> list[Any]:
    data = json.loads(raw)
    if "harmony" in data:
        from openai_harmony import Message

        return [Message.from_dict(m) for m in data["harmony"]]
    return data["chat"]


class ResponsesStore:
    """The Redis at ``url`` (``redis://HOST:PORT/DB``) as vLLM's two stores."""

    def __init__(self, url: str, ttl: int = DEFAULT_TTL) -> None:
        import redis

        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"--responses-store takes redis://HOST:PORT[/DB] (got {url!r})")
        self.url = url
        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2, decode_responses=True)
        self.responses = RedisMapping(self.client, "response", _dump_response, _load_response, ttl)
        self.messages = RedisMapping(self.client, "messages", _dump_messages, _load_messages, ttl)

    def check(self) -> None:
        """Raise the 503 when the store cannot be reached."""
        self.responses._call("ping")

    def install(self, serving: Any) -> None:
        """Make ``serving`` (vLLM's ``OpenAIServingResponses``) keep its responses here."""
        serving.enable_store = True
        serving.response_store = self.responses
        serving.msg_store = self.messages


@functools.cache
def _store(url: str, ttl: int) -> ResponsesStore:
    return ResponsesStore(url, ttl)


def of(settings: Settings) -> ResponsesStore | None:
    """The store ``settings`` name (``derender serve --responses-store``), one per URL and TTL in a
    process, or None (vLLM's default: off)."""
    return _store(settings.responses_store, settings.responses_store_ttl) if settings.responses_store else None
