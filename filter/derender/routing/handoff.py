"""Disaggregated prefill: the filter runs vLLM's ``kv_transfer_params`` handoff itself.

For a prompt of at least ``--pd-min-prompt-tokens`` tokens, the rendered generate request first goes
to a prefill replica (``--prefill``), not streamed, with ``max_tokens: 1`` and ``kv_transfer_params``
asking for a remote decode, as vLLM's disaggregated-serving proxy sends it; the prefill replica's
answer names where the prompt's KV blocks wait, and those params go on the decode request, which
reaches a decode replica (``--producer``) streamed as before. The filter calls the prefill replica
itself, not through Envoy: one hop less, and it already holds the rendered body.

The prefill replica is chosen by the prompt's leading tokens (rendezvous hashing), so that prompts
sharing a prefix meet the same prefill cache. One that refuses, errs or passes ``--prefill-timeout`` is
followed by one other; after that the decode replica prefills itself (no params), logged and counted.
An answer whose params are not what a decode can use is not forwarded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import orjson

from .producer import GENERATE_PATH

log = logging.getLogger("derender.handoff")

KEY_TOKENS = 256  # the leading prompt tokens that pick the prefill replica
ASK = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
MAX_ANSWER = 1 << 20  # a prefill answer (one token) larger than this is not read


@dataclass(frozen=True)
class HandoffSpec:
    """``derender serve``'s prefill flags; no ``prefill`` URLs: off."""

    prefill: tuple[str, ...] = ()  # --prefill
    timeout: float = 30.0  # --prefill-timeout: seconds for one prefill call
    min_prompt_tokens: int = 256  # --pd-min-prompt-tokens: shorter prompts go to decode alone


@dataclass
class Handed:
    """One request's prefill, for the log, the metrics and the trace."""

    outcome: str  # remote (the decode takes the prefill's KV), local (it prefills itself), short
    replica: str | None = None
    started: float = 0.0  # monotonic
    took: float = 0.0  # seconds
    tries: list[tuple[str, str]] = field(default_factory=list)  # (replica, why) of each failed try


def usable(params: Any) -> bool:
    """Whether a prefill answer's ``kv_transfer_params`` name blocks a decode can pull."""
    return (
        isinstance(params, dict)
        and params.get("do_remote_prefill") is True
        and isinstance(params.get("remote_engine_id"), str)
        and isinstance(params.get("remote_host"), str)
        and isinstance(params.get("remote_port"), int)
        and isinstance(params.get("remote_block_ids"), list)
        and len(orjson.dumps(params)) < 64 << 10
    )


class Handoff:
    """One backend's prefill replicas, in one worker."""

    def __init__(self, spec: HandoffSpec) -> None:
        self.spec = spec
        self.replicas = [u.rstrip("/") for u in spec.prefill]
        self._session: aiohttp.ClientSession | None = None

    def order(self, prompt_ids: list[int]) -> list[str]:
        """The prefill replicas for a prompt, best first (rendezvous hashing on its leading tokens)."""
        key = b"".join(t.to_bytes(4, "little") for t in prompt_ids[:KEY_TOKENS])
        return sorted(self.replicas, key=lambda url: hashlib.blake2b(url.encode() + key, digest_size=8).digest())

    @staticmethod
    def prefill_body(request: dict) -> bytes:
        """The generate request for the prefill replica: one token, not streamed, asking for a remote decode."""
        sent = {k: v for k, v in request.items() if k != "stream_options"}
        sent["stream"] = False
        sent["sampling_params"] = {**(request.get("sampling_params") or {}), "max_tokens": 1, "min_tokens": 0, "n": 1}
        sent["kv_transfer_params"] = dict(ASK)
        return orjson.dumps(sent)

    async def prefill(
        self, body: bytes, request: dict, prompt_ids: list[int], headers: dict[str, str]
    ) -> tuple[bytes, Handed]:
        """The decode request's body (``request`` with the prefill's params, or ``body`` as it was) and
        what happened; ``request`` is ``body`` parsed, once, by the caller (a long prompt is long)."""
        began = time.monotonic()
        handed = Handed("local", started=began)
        sent = self.prefill_body(request)
        for url in self.order(prompt_ids)[:2]:
            try:
                params = await asyncio.wait_for(self._call(url, sent, headers), self.spec.timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as exc:
                handed.tries.append((url, f"{type(exc).__name__}: {exc}"[:300]))
                continue
            handed.outcome, handed.replica = "remote", url
            handed.took = time.monotonic() - began
            return orjson.dumps({**request, "kv_transfer_params": params}), handed
        handed.took = time.monotonic() - began
        log.warning(
            "prefill failed on every replica tried (%s): the decode replica prefills itself",
            "; ".join(f"{url}: {why}" for url, why in handed.tries),
        )
        return body, handed

    async def _call(self, url: str, body: bytes, headers: dict[str, str]) -> dict:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        async with self._session.post(url + GENERATE_PATH, data=body, headers=headers) as response:
            if response.status != 200:
                raise ValueError(f"HTTP {response.status}")
            text = await response.content.read(MAX_ANSWER + 1)
            if len(text) > MAX_ANSWER:
                raise ValueError("an answer past 1 MiB")
            answer = orjson.loads(text)
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not usable(params):
            raise ValueError("its kv_transfer_params name no blocks a decode can pull")
        return cast("dict", params)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
