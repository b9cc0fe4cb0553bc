"""Optional API keys: ``Authorization: Bearer KEY``, checked as vLLM's ``--api-key`` checks it.

Keys come from ``derender serve --api-key KEY`` (repeatable) or, when no flag
is given, from ``$DERENDER_API_KEYS`` (comma-separated), the way ``vllm serve``
prefers ``--api-key`` over ``$VLLM_API_KEY``. The check is vLLM's own
(``AuthenticationMiddleware.verify_token``: SHA-256 digests compared in
constant time) on vLLM's guarded path prefixes (``/v1``, ``/inference``, ...;
``/health`` and ``OPTIONS`` stay open); Anthropic's clients may send the key as
``x-api-key`` instead, checked the same way. It runs on the request headers, so a
refused request never reaches a producer. The 401 body is an OpenAI error
object carrying vLLM's message, ``Unauthorized`` (vLLM itself sends the bare
``{"error": "Unauthorized"}``), in Anthropic's shape on the Messages endpoints.

``derender serve`` resolves the keys once (``Settings.api_keys``); each worker's ext_proc processor holds
an ``ApiKeys`` of them.
"""

from __future__ import annotations

import os
from typing import Any

from ..translate.errors import HTTPError

ENV = "DERENDER_API_KEYS"


def keys_from_env() -> list[str]:
    return [k.strip() for k in os.environ.get(ENV, "").split(",") if k.strip()]


def resolve(flags: list[str] | None) -> tuple[str, ...]:
    """The keys in force: the flags', else the environment's."""
    return tuple(k for k in (flags or keys_from_env()) if k)


class ApiKeys:
    """The keys a client must present (none: every request passes)."""

    def __init__(self, keys: tuple[str, ...] | list[str] = ()) -> None:
        self.keys = tuple(k for k in keys if k)
        self._checker: Any = None  # vLLM's AuthenticationMiddleware holding the key digests
        if self.keys:
            from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

            self._checker = AuthenticationMiddleware(app=None, tokens=list(self.keys))  # type: ignore[arg-type]  # its check alone

    def __len__(self) -> int:
        return len(self.keys)

    def check(self, headers: dict[str, str]) -> HTTPError | None:
        """The 401 for a request without a valid key, or None."""
        checker = self._checker
        if checker is None or headers.get(":method") == "OPTIONS":
            return None
        from starlette.datastructures import Headers
        from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX

        path = headers.get(":path", "/")
        if not path.startswith(GUARDED_PREFIX):
            return None
        if checker.verify_token(Headers(headers={k: v for k, v in headers.items() if not k.startswith(":")})):
            return None
        # Anthropic's clients send the key as x-api-key: the same keys, checked the same way.
        key = headers.get("x-api-key")
        if key and checker.verify_token(Headers(headers={"authorization": f"Bearer {key}"})):
            return None
        return HTTPError(401, "Unauthorized")  # the server shapes it as the path's endpoint does
