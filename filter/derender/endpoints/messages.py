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

import functools
import json
import logging
import re
from collections import deque
from http import HTTPStatus
from typing import Any

import pydantic_core

from ..exchange import Answered, Endpoint, Reply, Rewrite
from ..ops import logs
from ..translate import vllm_seams
from ..translate.errors import AnthropicHTTPError, HTTPError, anthropic_error_event, dumps, from_exception, parse_body
from ..translate.lean import MARK, LeanChatStream
from ..translate.model import Model
from ..translate.render import Rendered, render_chat_request
from ..translate.stream import WAIT, ChatStream, UnexpectedAwait, chat_response, close_chain, run_until_wait
from .chat import ChatExchange

log = logging.getLogger("derender.messages")


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


class LeanMessagesStream(LeanChatStream):
    """A Messages stream on the lean path (``--stream-path lean``): the lean chat path's middle
    events, then vLLM's Anthropic converter only where it would do more than write one delta.

    vLLM chains its converter (``message_stream_converter``) onto the chat chunk generator; here
    the two run as two chains driven in turn: the chat generator's chunks go to the converter in
    the order it yields them, and so does the chunk of every middle event the lean chat path did
    itself. Most of those carry reasoning in an open ``thinking`` block or text in an open ``text``
    block, for which the converter writes one ``content_block_delta`` and changes none of its
    state: that event is written from a template of the converter's own serialization, with the
    text serialized as pydantic does, and the converter is not stepped. Whatever else the parser
    says (a block opening or closing, a tool call, several kinds at once) goes to the converter.
    Which block is open is read from what the converter wrote, not from its running state: it
    opens a block only with a ``content_block_start`` event and closes one only with a
    ``content_block_stop`` event (``OpenBlock``).
    ``tests/test_lean.py`` runs this and vLLM's chain over generated streams: identical bytes."""

    continuous_usage = True  # vLLM asks for it on every Messages stream; its converter reads none per token
    _serving = staticmethod(serving_messages)
    fail = fail_as_messages

    def __init__(self, model: Model, rendered: Rendered) -> None:
        self._chunks: deque[Any] = deque()  # chat chunks for the converter, in order
        self._raw_over = False
        self._raw_error: BaseException | None = None
        self._conv: Any = None
        self._conv_step: Any = None  # the converter's suspended step while it waits for a chunk
        self._block = OpenBlock()  # the converter's open block, as its events say
        self._templates: dict[tuple[str, int], tuple[bytes, bytes]] = {}
        self.templated = 0  # middle deltas written from a template, the converter not stepped
        self.converted = 0  # middle deltas the converter took
        super().__init__(model, rendered)

    def _generator(self, model: Model, rendered: Rendered):
        serving = self._serving_chat = serving_messages(model)
        self._raw = self._chunks_of(serving, model, rendered)
        self._conv = serving.message_stream_converter(self._source())
        return self._raw

    async def _source(self):
        """The converter's input: the chat chunks, then the chat generator's end or its exception."""
        while True:
            while self._chunks:
                yield self._chunks.popleft()
            if self._raw_error is not None:
                raise self._raw_error
            if self._raw_over:
                return
            await WAIT

    def _delta_bytes(self, delta: Any) -> bytes:
        block = self._block
        if not self._chunks and self._conv_step is not None and not delta.tool_calls:
            reasoning, content = delta.reasoning, delta.content
            if not reasoning and not content:
                return b""  # the converter writes nothing for it
            if reasoning and not content and block.kind == "thinking":
                return self._template("thinking", block.index, reasoning)
            if content and not reasoning and block.kind == "text":
                return self._template("text", block.index, content)
        self.converted += 1
        self._chunks.append(self._frame.chunk(delta))  # type: ignore[union-attr]  # the lean path: a _Frame
        return self._convert()

    def _template(self, kind: str, index: int, text: str) -> bytes:
        """The converter's ``content_block_delta`` event of ``kind`` in block ``index``."""
        halves = self._templates.get((kind, index))
        if halves is None:
            halves = self._templates[(kind, index)] = _delta_event_halves(kind, index)
        self.templated += 1
        return halves[0] + pydantic_core.to_json(text) + halves[1]

    def _pump(self) -> bytes:
        lean = b"".join(self._lean)
        self._lean.clear()
        if not (
            lean
            and self._step is not None
            and not self._queue
            and self._failure is None
            and not self._ended
            and not self._early
        ):
            self._run_raw()
        return self._take_early() + lean + self._convert()

    def _run_raw(self) -> None:
        """The chat generator until it waits for the next output or ends; its chunks queued."""
        if self._raw_over or self._raw_error is not None:
            return
        step, self._step = self._step, None
        try:
            self._step = run_until_wait(self._agen, step, self._chunks)
        except UnexpectedAwait:
            raise
        except Exception as exc:  # vLLM's chain raises it into the converter
            self._raw_error = exc
            return
        self._raw_over = self._step is None

    def _convert(self) -> bytes:
        """The converter over the queued chunks, until it waits for more or ends."""
        if self.finished or (
            self._conv_step is not None and not self._chunks and not self._raw_over and self._raw_error is None
        ):
            return b""  # waiting, with nothing to take
        step, self._conv_step = self._conv_step, None
        frames, self._conv_step = self._run_client_chain(self._conv, step)
        self._block.follow(frames)
        return frames

    def _close(self) -> None:
        super()._close()
        step, self._conv_step = self._conv_step, None
        close_chain(step, self._conv)


class OpenBlock:
    """The content block vLLM's Messages converter has open, followed from the events it writes:
    a ``content_block_start`` opens one (its index and its block's type), a ``content_block_stop``
    closes it. The converter changes its open block with those events and no other way, so after
    each of its steps the last such event says what is open (``kind`` None: no block)."""

    __slots__ = ("index", "kind")

    START = b"event: content_block_start\ndata: "
    STOP = b"event: content_block_stop\n"

    def __init__(self) -> None:
        self.kind: str | None = None
        self.index = -1

    def follow(self, frames: bytes) -> None:
        """Take the converter's ``frames`` of one step into account."""
        start, stop = frames.rfind(self.START), frames.rfind(self.STOP)
        if stop > start:
            self.kind, self.index = None, -1
        elif start >= 0:
            data = frames[start + len(self.START) :].split(b"\n", 1)[0]
            event = json.loads(data)
            self.kind, self.index = event["content_block"]["type"], event["index"]


@functools.cache
def _delta_event_halves(kind: str, index: int) -> tuple[bytes, bytes]:
    """vLLM's converter's ``content_block_delta`` event of ``kind`` ("thinking" or "text") in block
    ``index``, as serialized by its models, cut around the text's JSON string."""
    from vllm.entrypoints.anthropic.protocol import AnthropicDelta, AnthropicStreamEvent
    from vllm.entrypoints.anthropic.serving import wrap_data_with_event

    delta = AnthropicDelta.model_validate({"type": f"{kind}_delta", kind: MARK})
    event = AnthropicStreamEvent(index=index, type="content_block_delta", delta=delta)
    data = wrap_data_with_event(event.model_dump_json(exclude_unset=True), "content_block_delta").encode()
    head, tail = data.split(pydantic_core.to_json(MARK))  # ValueError unless it is there exactly once
    return head, tail


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
