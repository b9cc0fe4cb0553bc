"""The render tier as the filter calls it: one ``vllm launch render`` server (``RenderTier``), the
paths of its render and derender endpoints (``TierPaths``), its errors, and chat's echo, which
the derender endpoints leave out (see ``rendertier``)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from ..translate.errors import HTTPError, error_body

log = logging.getLogger("derender.rendertier")


@dataclass(frozen=True)
class TierPaths:
    name: str  # the request log's message
    operation: str  # the metrics' gen_ai.operation.name
    render_path: str
    derender_path: str
    request_key: str  # the field that carries the client's request on every derender call


CHAT = TierPaths("chat", "chat", "/v1/chat/completions/render", "/v1/chat/completions/derender", "chat_request")
COMPLETION = TierPaths(
    "completion", "text_completion", "/v1/completions/render", "/v1/completions/derender", "completion_request"
)


def tier_error(status: int, body: bytes) -> HTTPError:
    """The render tier's answer (vLLM's ``{"error": {...}}``) as an ``HTTPError``."""
    try:
        error = orjson.loads(body)["error"]
        return HTTPError(status, str(error["message"]), error.get("type"), error.get("param"))
    except (ValueError, KeyError, TypeError):
        text = body.decode("utf-8", "replace").strip()[:500]
        return HTTPError(status if status >= 400 else 502, f"render tier error: {text or f'HTTP {status}'}")


class RenderTier:
    """One ``vllm launch render`` server, by base URL."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=60),
                connector=aiohttp.TCPConnector(limit=256),
            )
        return self._session

    async def call(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        """One HTTP call; an unreachable render tier is a 503."""
        try:
            async with self._client().request(
                method, self.url + path, data=body, headers={"content-type": "application/json", **(headers or {})}
            ) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("render tier %s %s failed: %s", method, self.url + path, exc)
            return 503, error_body(503, f"render tier unreachable: {exc.__class__.__name__} {exc}")

    async def models(self) -> list[dict[str, Any]]:
        status, body = await self.call("GET", "/v1/models")
        if status != 200:
            raise tier_error(status, body)
        return orjson.loads(body)["data"]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def chat_echo(request: dict[str, Any]) -> str:
    """The text coupled vLLM echoes for a chat request: the last message's content when its role is
    the one the answer takes (``assistant``, or the last message's own role without a generation prompt)."""
    if not request.get("echo"):
        return ""
    messages = request.get("messages") or []
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    role = "assistant" if request.get("add_generation_prompt", True) else last.get("role")
    if last.get("role") != role:
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):  # text parts, flattened as vLLM's chat parser does
        content = "\n".join(
            str(part.get("text", "")) for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    return content if isinstance(content, str) else ""
