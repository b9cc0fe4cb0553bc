"""vLLM's ``AnthropicServingMessages`` for a model, and the Messages stream on vLLM's path: the chat
stream's live state with vLLM's Anthropic stream generator, a failure raised to it as the engine's."""

from __future__ import annotations

import functools
import logging
from http import HTTPStatus
from typing import Any

from ...translate.errors import anthropic_error_event
from ...translate.model import Model
from ...translate.stream import ChatStream


class _QuietStreamErrors(logging.Filter):
    """vLLM's converter logs a traceback for every failed stream; the filter logs its own line
    for a producer's failure (the exchange's request log), so only other errors pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return type(exc).__name__ != "_StreamError"


logging.getLogger("vllm.entrypoints.anthropic.serving").addFilter(_QuietStreamErrors())


@functools.cache
def serving_messages(model: Model) -> Any:
    """vLLM's ``AnthropicServingMessages`` for ``model``, built as ``vllm serve`` builds it."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    return model.vllm_serving(AnthropicServingMessages)


def fail_as_messages(self: ChatStream, status: int, message: str, err_type: str | None = None) -> bytes:
    """``fail`` of both Messages streams (one method, two classes): the engine's failure goes to
    vLLM's generator, which closes the open block and writes Anthropic's ``error`` event, as the
    coupled server does when its engine fails."""
    if self.finished:
        return self._take_early()
    from vllm.exceptions import GenerationError

    failure = GenerationError(message)
    failure.status_code = HTTPStatus(status)
    self._failure = failure
    try:
        return self._pump()
    except Exception:  # never a broken stream: the error event alone
        self._close()
        return self._take_early() + anthropic_error_event(status, message)


class MessagesStream(ChatStream):
    """One streaming Messages answer: the chat stream's state, vLLM's Anthropic stream generator."""

    _serving = staticmethod(serving_messages)
    fail = fail_as_messages
