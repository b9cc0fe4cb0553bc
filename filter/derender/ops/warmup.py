"""A worker's first request, paid before it serves.

The first chat request a process renders costs several times a later one
(measured: ~40 ms then ~15 ms then ~5 ms for a 1k-token prompt): vLLM's
renderer starts its executor thread, pydantic and the parsers fill their
caches, the tokenizer warms up. Each worker runs one small streaming request
through the same code before it listens. It runs after the fork, never
before: a thread pool started in the parent would be inherited without its
threads and the child's first render would wait forever.
"""

from __future__ import annotations

import logging
import time

import orjson

from ..translate.model import Model
from ..translate.render import render_chat
from ..translate.stream import ChatStream

log = logging.getLogger("derender.warmup")

_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def request_body(model: Model) -> bytes:
    """A small streaming chat request this model accepts (with a tool when it parses tool calls)."""
    body: dict = {
        "model": model.name,
        "messages": [{"role": "user", "content": "What is the weather like in Paris today?"}],
        "stream": True,
        "max_tokens": 16,
    }
    if model.spec.enable_auto_tool_choice:
        body["tools"] = [_TOOL]
    return orjson.dumps(body)


async def warm_up(model: Model) -> None:
    """Render one request and build its stream state; a failure is logged, never fatal."""
    started = time.monotonic()
    try:
        rendered = await render_chat(model, request_body(model), None)
        stream = ChatStream(model, rendered)
        stream.start()
        stream.close()
    except Exception:  # serving matters more than a warm first request
        log.warning("warm-up of model %s failed; its first request will be slower", model.name, exc_info=True)
        return
    log.info("model %s warmed up in %.0f ms", model.name, (time.monotonic() - started) * 1e3)
