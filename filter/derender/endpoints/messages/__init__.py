"""``/v1/messages`` (Anthropic Messages) and ``/v1/messages/count_tokens``, in three modules:
``endpoint`` (rendering, the exchanges, their ``ENDPOINT`` and ``COUNT_TOKENS``), ``stream`` (vLLM's
serving class and the stream on vLLM's path) and ``lean`` (the stream on the lean path)."""

from .endpoint import (
    COUNT_TOKENS,
    ENDPOINT,
    NOT_IN_TIER,
    CountTokensExchange,
    MessagesExchange,
    message_response,
    render_messages,
    to_chat_request,
)
from .lean import LeanMessagesStream, OpenBlock
from .stream import MessagesStream, serving_messages

__all__ = [
    "COUNT_TOKENS",
    "ENDPOINT",
    "NOT_IN_TIER",
    "CountTokensExchange",
    "LeanMessagesStream",
    "MessagesExchange",
    "MessagesStream",
    "OpenBlock",
    "message_response",
    "render_messages",
    "serving_messages",
    "to_chat_request",
]
