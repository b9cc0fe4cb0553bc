"""``POST /v1/messages`` (Anthropic Messages) and ``/v1/messages/count_tokens``, by vLLM's own code.

vLLM 0.33's coupled server answers Messages with ``AnthropicServingMessages``, an
``OpenAIServingChat`` that converts the Anthropic request into a chat request
(``to_chat_completion_request``), runs the chat path, and converts its output:
the chat chunk stream through ``message_stream_converter`` into Anthropic events
(``message_start``, ``content_block_start/delta/stop`` for ``thinking``, ``text``
and ``tool_use``, ``message_delta``, ``message_stop``), the full answer through
``messages_full_converter``. The filter does the same with the same objects: the
request is converted as vLLM converts it, then rendered as a chat request (what
vLLM's ``/v1/messages/render`` does); the producer's events drive the chat
stream's live state (``ChatStream``) with ``AnthropicServingMessages``'s stream
generator in place of the chat one. So every chat feature (reasoning and tool
parsers, stop sequences held by the filter, aborts, stalls, faults) carries over.

Errors: what vLLM's Messages handler answers comes in Anthropic's shape
(``{"type": "error", "error": {"type": ..., "message": ...}}``), with the error
type vLLM picks for the status (``translate_error_type``); a body that fails
validation gets the same 400 as vLLM, whose request-validation handler answers it
in the OpenAI shape before the Messages handler runs. A failure mid-stream is
raised to vLLM's generator as the engine's failure, so the client gets what the
coupled server sends then: the open block closed and an ``error`` event.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ...exchange import Answered, Endpoint, Reply, Rewrite
from ...ops import logs
from ...translate import vllm_seams
from ...translate.errors import AnthropicHTTPError, HTTPError, dumps, from_exception, parse_body
from ...translate.model import Model
from ...translate.render import Rendered, render_chat_request
from ...translate.stream import chat_response
from ..chat import ChatExchange
from .lean import LeanMessagesStream
from .stream import MessagesStream, serving_messages


def _validated(validate, raw: bytes) -> Any:
    """``parse_body``, whose 400 keeps the OpenAI shape, as vLLM's validation handler answers it."""
    try:
        return parse_body(validate, raw)
    except HTTPError as exc:
        exc.openai_shape = True
        raise


async def to_chat_request(model: Model, request: Any) -> Any:
    """The chat request vLLM's Messages handler makes of an Anthropic request (or count_tokens request)."""
    serving = serving_messages(model)
    try:
        effort = await serving.disabled_thinking_effort_resolver.resolve_for(request)
        return serving.to_chat_completion_request(
            request, merge_inline_system=vllm_seams.merge_inline_system(serving), disabled_thinking_effort=effort
        )
    except Exception as exc:  # e.g. a tool_addition naming an undeclared tool: vLLM's 400
        raise from_exception(exc) from None


async def render_messages(model: Model, raw: bytes, x_request_id: str | None) -> Rendered:
    """Render a ``/v1/messages`` body as vLLM converts and renders it; raises ``HTTPError``."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    request = _validated(lambda body: AnthropicMessagesRequest.model_validate(body, from_attributes=True), raw)
    return await render_chat_request(model, await to_chat_request(model, request), x_request_id)


async def message_response(model: Model, rendered: Rendered, final: Any) -> bytes:
    """The generation's final ``RequestOutput`` -> the Anthropic message JSON, by vLLM's converters."""
    serving = serving_messages(model)
    result = await chat_response(serving, model, rendered, final)
    return dumps(serving.messages_full_converter(result).model_dump(exclude_none=True))


class MessagesExchange(ChatExchange):
    """One ``/v1/messages`` exchange: ``ChatExchange`` with the Messages pieces."""

    render = staticmethod(render_messages)
    stream_class = MessagesStream
    lean_class = LeanMessagesStream
    full_response = staticmethod(message_response)
    endpoint = "messages"
    operation = "messages"
    client_finish = re.compile(rb'"stop_reason":"([a-z_]+)"')  # end_turn, max_tokens, tool_use, stop_sequence

    @staticmethod
    def answer_error(exc: HTTPError) -> bytes:
        return AnthropicHTTPError.of(exc).body()

    async def request_body(self, body: bytes) -> Rewrite:
        try:
            return await super().request_body(body)
        except HTTPError as exc:
            raise AnthropicHTTPError.of(exc) from None

    @staticmethod
    def completion_texts(sent: bytes, stream: bool) -> list[str]:
        """What the client got, for ``--log-prompts``: thinking, text and tool input, in order."""
        if not stream:
            try:
                blocks = json.loads(sent).get("content") or ()
            except (ValueError, AttributeError):
                return []
            return ["".join(b.get("thinking") or b.get("text") or json.dumps(b.get("input", "")) for b in blocks)]
        parts = []
        for event in logs.sse_json(sent):
            delta = event.get("delta") or {}
            parts.append(delta.get("thinking") or delta.get("text") or delta.get("partial_json") or "")
        return ["".join(parts)]


class CountTokensExchange(Answered):
    """``/v1/messages/count_tokens``: the rendered prompt's length, answered by the filter itself."""

    def __init__(self, model: Model, producer: Any, x_request_id: str | None) -> None:
        super().__init__()
        self.model = model  # the producer is not asked
        self.x_request_id = x_request_id

    async def request_body(self, body: bytes) -> Reply:
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest

        try:
            request = _validated(lambda b: AnthropicCountTokensRequest.model_validate(b, from_attributes=True), body)
            result = await serving_messages(self.model).count_tokens(request)
        except HTTPError as exc:
            exc = AnthropicHTTPError.of(exc)
            return Reply(exc.status, exc.body())
        except Exception as exc:
            error = AnthropicHTTPError.of(from_exception(exc))
            return Reply(error.status, error.body())
        if hasattr(result, "error"):
            error = AnthropicHTTPError.of(HTTPError.from_vllm(result))
            return Reply(error.status, error.body())
        return Reply(200, dumps(result.model_dump(exclude_none=True)))


NOT_IN_TIER = (
    "/v1/messages is not served in render-tier mode: vLLM's render tier renders Messages requests but "
    "its derender tier turns token ids into chat and completion streams only. Serve the model with "
    "--model (the filter renders and derenders Messages itself), or use /v1/chat/completions."
)
ENDPOINT = Endpoint("/v1/messages", MessagesExchange, anthropic=True, not_in_tier=NOT_IN_TIER)
COUNT_TOKENS = Endpoint("/v1/messages/count_tokens", CountTokensExchange, anthropic=True, not_in_tier=NOT_IN_TIER)
