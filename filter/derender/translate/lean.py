"""The lean per-token path of a chat stream: vLLM's parsers, vLLM's bytes, without its generator per token.

``ChatStream`` runs vLLM's ``chat_completion_stream_generator`` for every producer event: per
token it steps the generator, builds a ``ChatCompletionStreamResponse`` and a choice (pydantic
validation, vLLM's extra-field logging) and dumps them. ``LeanChatStream`` keeps that generator
for what is rare or intricate -- the first event (role chunk, first delta), the event that
finishes the choice (finish reason, stop reason, tool-call cleanup), usage, errors -- and does
the middle events, which carry no finish reason, itself, the way the generator's loop does them:

- the same ``ChatStreamProcessor`` objects as the generator, so vLLM's reasoning and tool parsers do
  every step (their state is the generator's): the generator is the filter's copy of vLLM 0.33.0's
  (``chat_loop``), which keeps them where this path finds them, not a frame of vLLM's to read;
- the parser's ``DeltaMessage`` serialized by its own pydantic serializer, put between the two
  halves of a chunk that vLLM's models serialized once per stream (a marker delta cut out);
- from the second middle event on, when the choice's output processor does nothing per token but
  detokenize (no stop strings, no logprobs), the event goes straight to vLLM's detokenizer
  (``_direct``): no ``RequestOutput`` and no wake-up of the generator, which has nothing to do.

It serves what the generator's middle branch makes of such an event when no per-token extra is
asked for: ``n`` 1, no ``logprobs``, ``echo``, ``return_token_ids``, ``return_prompt_text`` or
continuous usage stats, no output logging (``eligible``). Anything else takes vLLM's generator for
the whole stream. A parser that
raises is handed to the generator as its failure, which it answers as it answers its own.
``tests/test_lean.py`` runs both paths over generated streams for every shipped tokenizer and
parser configuration and demands identical bytes. ``derender serve --stream-path vllm`` turns it off.
"""

from __future__ import annotations

import logging
from typing import Any

from . import eventjson, vllm_seams
from .chat_loop import LoopState, chat_stream
from .model import Model
from .render import Rendered
from .stream import ChatStream

log = logging.getLogger("derender.lean")

MARK = "\x00derender-delta\x00"


def eligible(model: Model, rendered: Rendered, *, continuous_usage: bool = False) -> bool:
    """The request asks for nothing per token that the lean path leaves to vLLM's generator;
    ``continuous_usage``: a stream whose middle chunks' usage nobody reads (Messages: vLLM's
    converter reads the usage of the first and the last chunk only) may ask for it."""
    if not model.lean:
        return False
    from vllm.entrypoints.serve.utils.api_utils import should_include_usage

    request = rendered.request
    serving = model.serving_chat
    if (request.n or 1) != 1 or request.logprobs or request.echo:
        return False
    if getattr(request, "return_token_ids", False) or getattr(request, "return_prompt_text", False):
        return False
    if serving.enable_log_outputs and serving.request_logger is not None:
        return False
    _, continuous = should_include_usage(request.stream_options, serving.enable_force_include_usage)
    return continuous_usage or not continuous


def one_choice_event(payload: bytes) -> dict[str, Any] | None:
    """A producer token event with exactly one choice, as a direct step takes it; None for anything
    else (an error, another output mode, several choices, not JSON), which the full path takes."""
    if payload[:1] != b"{":
        return None
    try:
        event = eventjson.loads(payload)
    except ValueError:
        return None
    choices = event.get("choices")
    if (
        "error" in event
        or event.get("output_mode", "tokens") != "tokens"
        or type(choices) is not list
        or len(choices) != 1
        or type(choices[0]) is not dict
    ):
        return None
    return event


class _Frame:
    """What the lean path shares with the running generator (``chat_loop.LoopState``), and the
    chunk's two halves."""

    __slots__ = ("fields", "generated", "head", "processors", "reasoning_details", "tail")

    def __init__(self, state: LoopState, serving: Any) -> None:
        from vllm.entrypoints.generate.base.protocol import DeltaMessage

        if not state.processors:
            raise ValueError("the generator has built no processors")
        self.processors = state.processors
        self.generated = state.generated
        self.reasoning_details = vllm_seams.include_reasoning_tokens_details(serving)
        self.fields: dict[str, Any] = {
            "id": state.request_id,
            "object": state.object,
            "created": state.created,
            "model": state.model_name,
        }
        # The chunk of the generator's middle branch, with a marker for the delta: vLLM's models
        # serialize everything around the delta once, here, exactly as they would every time.
        chunk = self.chunk(DeltaMessage(content=MARK))
        text = chunk.model_dump_json(exclude_unset=True, exclude_none=not chunk.choices)
        marker = DeltaMessage(content=MARK).model_dump_json(exclude_unset=True)
        head, tail = text.split(marker)  # ValueError unless the marker is there exactly once
        self.head = b"data: " + head.encode()
        self.tail = tail.encode() + b"\n\n"

    def chunk(self, delta: Any) -> Any:
        """The ``ChatCompletionStreamResponse`` the generator's middle branch makes of ``delta``
        (no per-token extras: ``eligible``; continuous usage, if asked, is left unset)."""
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponseStreamChoice,
            ChatCompletionStreamResponse,
        )

        choice = ChatCompletionResponseStreamChoice(
            index=0, delta=delta, logprobs=None, finish_reason=None, token_ids=None
        )
        # kv_transfer_params: the generator sets it (None) on every token chunk
        return ChatCompletionStreamResponse(choices=[choice], kv_transfer_params=None, **self.fields)


class LeanChatStream(ChatStream):
    """A ``ChatStream`` whose middle events skip vLLM's generator (see the module's text)."""

    continuous_usage = False  # ``eligible``'s: the middle chunks' usage is read

    def __init__(self, model: Model, rendered: Rendered) -> None:
        self._raw: Any = None
        self._loop_state = LoopState()  # what the generator (``chat_loop``) shares with this path
        self._frame: _Frame | bool | None = None  # False: vLLM's path for the whole stream
        self._lean: list[bytes] = []
        self.handled = 0  # outputs the lean path did itself
        self.direct = 0  # of those, events done without a RequestOutput (``_direct``)
        super().__init__(model, rendered)

    def feed(self, payload: bytes) -> tuple[bytes, bool]:
        if (
            self.outputs.direct_state is not None
            and isinstance(self._frame, _Frame)
            and not self._queue
            and self._taken
            and self._failure is None
            and not self._ended
            and not self.finished
            and not self._early
        ):
            data = self._direct(payload)
            if data is not None:
                return data, False
        return super().feed(payload)

    def _direct(self, payload: bytes) -> bytes | None:
        """A middle event with no ``RequestOutput`` at all, when the choice's output processor would
        only detokenize it (``ChoiceOutputs.direct_text``: one choice, no stop strings, no logprobs):
        its new text from the detokenizer, then the parsers' step; the generator, which would only
        wait again, is not woken. Any other event (a finish, an error, usage, another choice, a bad
        token id) returns None before anything changed, for the full path."""
        event = one_choice_event(payload)
        if event is None:
            return None
        got = self.decoder.direct(event)
        if got is None:
            return None
        text, ids = got
        self.direct += 1
        data = self._middle_step(text, ids, self.outputs.direct_state.prompt_token_ids)  # type: ignore[union-attr]  # set: direct_text answered
        if self._failure is not None:  # the parser raised: the generator answers it, as vLLM's would
            return data + self._pump()
        return data

    def _generator(self, model: Model, rendered: Rendered):
        """The raw chunk generator (``chat_loop``), serialized as vLLM's ``chat_completion_stream_generator``
        serializes its own."""
        serving = self._serving_chat = self._serving(model)
        self._raw = self._chunks_of(serving, model, rendered)
        return _serialized(serving, self._raw)

    def _chunks_of(self, serving: Any, model: Model, rendered: Rendered) -> Any:
        """vLLM 0.33.0's raw chat chunk generator for this stream (the filter's copy, ``chat_loop``)."""
        return chat_stream(
            serving,
            self._loop_state,
            *self._generator_args(model, rendered),
            chat_template_kwargs=rendered.chat_template_kwargs,
        )

    def _accept(self, outputs: list[Any]) -> None:
        for res in outputs:
            if self._queue or not self._taken:
                self._queue.append(res)
                continue
            data = self._middle(res)
            if data is None:
                self._queue.append(res)
            else:
                self._lean.append(data)

    def _pump(self) -> bytes:
        if not self._lean:
            return super()._pump()
        lean = b"".join(self._lean)
        self._lean.clear()
        if self._step is not None and not self._queue and self._failure is None and not self._ended and not self._early:
            return lean  # vLLM's generator waits for an output and none came: it would wait again
        return lean + super()._pump()

    def _middle(self, res: Any) -> bytes | None:
        """Client bytes for one output that finishes nothing, as the generator's loop makes them;
        None: the generator takes it."""
        from vllm.utils.collection_utils import as_list

        frame = self._frame
        if frame is None:
            frame = self._frame = self._take_frame()
        if frame is False or self._failure is not None or len(res.outputs) != 1:
            return None
        output = res.outputs[0]
        if output.finish_reason is not None:
            return None
        return self._middle_step(output.text, as_list(output.token_ids), res.prompt_token_ids)

    def _middle_step(self, text: str, ids: list[int], prompt_token_ids: Any) -> bytes:
        """The generator's middle branch for choice 0's new ``text`` and ``ids``."""
        frame = self._frame
        assert isinstance(frame, _Frame)
        self.handled += 1
        processor = frame.processors[0]
        if not text and not ids and not processor.num_output_tokens:
            return b""  # the generator's "chunked prefill" case: nothing to send
        try:
            delta, _ = processor.step(text, ids, None, prompt_token_ids)
        except Exception as exc:  # the generator's own answer to a failing parser: its error chunk
            self._failure = exc
            return b""
        if processor.parser is not None and frame.reasoning_details:
            # With continuous usage vLLM also recounts the reasoning tokens of all of them here;
            # only the last chunk's count is read, and the finishing event (vLLM's) counts anew.
            frame.generated[0].extend(ids)
        if delta is None:
            return b""
        return self._delta_bytes(delta)

    def _delta_bytes(self, delta: Any) -> bytes:
        """The client bytes of the middle chunk carrying ``delta``."""
        frame = self._frame
        assert isinstance(frame, _Frame)
        return frame.head + delta.__pydantic_serializer__.to_json(delta, exclude_unset=True) + frame.tail

    def _take_frame(self) -> _Frame | bool:
        try:
            return _Frame(self._loop_state, self._serving_chat)
        except (AttributeError, KeyError, TypeError, ValueError):
            log.warning(
                "the chat stream's chunk is not as expected: the generator takes all of this stream", exc_info=True
            )
            return False


async def _serialized(serving: Any, raw: Any):
    """vLLM's ``OpenAIServingChat.chat_completion_stream_generator`` around ``raw``: each chunk as
    an SSE frame (errors whole, chunks without unset fields), a failure as its error frame, then
    ``[DONE]``."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    try:
        async for chunk in raw:
            if isinstance(chunk, ErrorResponse):
                data = chunk.model_dump_json()
            else:
                data = chunk.model_dump_json(exclude_unset=True, exclude_none=not chunk.choices)
            yield f"data: {data}\n\n"
    except Exception as e:
        logging.getLogger("vllm.entrypoints.openai.chat_completion.serving").exception(
            "Error serializing chat completion stream."
        )
        data = serving.create_streaming_error_response(e)
        yield f"data: {data}\n\n"
    yield "data: [DONE]\n\n"
