"""Producer events -> OpenAI ``chat.completion.chunk`` frames, by vLLM's own chat server code.

``ChatStream`` owns the live state of one HTTP stream: the ``ChoiceOutputs``
(detokenizer, stop strings, logprobs per choice) and one running
``OpenAIServingChat.chat_completion_stream_generator``, which creates a
``ChatStreamProcessor`` and parser per choice and keeps them for the whole
stream. The generator is driven by hand: each producer event becomes the
``RequestOutput`` the generator awaits next, and the generator runs until it
waits for the following one. No event loop hop, no replay.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

from . import eventjson, vllm_seams
from .decode import Decoded, ProducerDecoder
from .errors import INCOMPLETE, HTTPError, dumps, error_event
from .events import cached_tokens, step_event
from .model import Model
from .outputs import ChoiceOutputs, ProducerError
from .render import Rendered

DONE = b"data: [DONE]\n\n"


class _WaitForEvent:
    """Awaited by the result generator when it has nothing queued: suspends the driver."""

    def __await__(self):
        yield self


WAIT = _WaitForEvent()


def choice_outputs(model: Model, rendered: Rendered, *, stream: bool) -> ChoiceOutputs:
    """The live output state of one rendered request on ``model``; with the lean path on
    (``--stream-path lean``), its token events may skip vLLM's ``process_outputs``."""

    return ChoiceOutputs(
        model.tokenizer,
        rendered.request_id,
        rendered.prompt_token_ids,
        rendered.params,
        stream=stream,
        vocab_size=model.model_config.get_vocab_size(),
        cached_tokens=model.prompt_tokens_details,
        direct=model.lean,
    )


class ChatStream(Decoded):
    """One streaming chat completion, from producer events to client bytes: the producer decoder
    (``decode.ProducerDecoder``) composed with chat's encoder, vLLM's chat stream generator driven by
    hand. The other APIs' streams swap the encoder (the generator, how a failure is written)."""

    _taken = 0  # outputs vLLM's generator has taken

    def __init__(self, model: Model, rendered: Rendered) -> None:
        self.decoder = ProducerDecoder(choice_outputs(model, rendered, stream=True))
        self.outputs = self.decoder.outputs
        self.finished = False  # [DONE] was produced
        self.whole = False  # vLLM's generator ended on the producer's last output: the answer is all out
        self._queue: deque[Any] = deque()
        self._ended = False
        self._step: Any = None
        self._early = b""  # what the generator yielded before the first event (``start``)
        self._failure: BaseException | None = None  # raised to vLLM's generator in place of an output
        self._agen = self._generator(model, rendered)

    def _generator(self, model: Model, rendered: Rendered):
        """vLLM's stream generator for this endpoint, fed from ``self._results()``."""
        return self._serving(model).chat_completion_stream_generator(
            *self._generator_args(model, rendered), chat_template_kwargs=rendered.chat_template_kwargs
        )

    def _generator_args(self, model: Model, rendered: Rendered) -> tuple[Any, Any, str, str, Any, Any, Any]:
        """What vLLM's chat stream generators take, in order, for this stream."""
        from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata

        return (
            rendered.request,
            self._results(),
            rendered.request_id,
            model.response_name(rendered.request.model),
            rendered.conversation,
            model.tokenizer,
            RequestResponseMetadata(request_id=rendered.request_id),
        )

    @staticmethod
    def _serving(model: Model) -> Any:
        """The vLLM serving object whose stream generator writes this endpoint's frames."""
        return model.serving_chat

    def start(self) -> None:
        """Run vLLM's generator up to its wait for the first event; it builds its parsers there.

        It yields nothing then unless the parsers cannot be built (an error
        chunk and the end): that goes out ahead of the first event's frames.
        """
        if self._step is None and not self.finished:
            self._early = self._pump()

    def _take_early(self) -> bytes:
        early, self._early = self._early, b""
        return early

    async def _results(self):
        while True:
            while self._queue:
                self._taken += 1
                yield self._queue.popleft()
            if self._failure is not None:  # the engine failed, as vLLM's generators see it
                raise self._failure
            if self._ended:
                return
            await WAIT

    def feed(self, payload: bytes) -> tuple[bytes, bool]:
        """One SSE ``data:`` payload from the producer -> (client bytes, abort producer?)."""
        if self.finished:
            return self._take_early(), False
        if payload == b"[DONE]":
            return self.end(), False
        try:
            outs, abort = self.decoder.event(eventjson.loads(payload))
            self._accept(outs)
        except HTTPError as exc:  # the producer's error event
            return self.fail(exc.status, exc.message, exc.type), False
        except (ProducerError, ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
            return self.fail(502, f"invalid producer event: {exc}"), False
        # With the producer's cache hits to pass on, vLLM's generator ends (and writes its final
        # usage) once the producer's usage event, right after the last token, has come.
        if self.decoder.ended:
            self._ended = True
        return self._pump(), abort

    @property
    def producer_cached_tokens(self) -> int | None:
        """The prompt tokens the producer found in its prefix cache, if its usage said."""
        return self.decoder.cached

    def cut(self) -> bytes:
        """End the answer at the tokens generated so far, as the engine ends one at ``max_tokens``:
        every unfinished choice finishes with ``length`` (Messages: ``max_tokens``; Responses:
        incomplete), then usage and the end, as vLLM's generator writes them. (A key's budget ran
        out: ``stages.budget``; the exchange aborts the producer's request.)"""
        if self.finished:
            return self._take_early()
        outs = self.decoder.cut()
        self.decoder.usage(None)  # the producer's usage will not come
        self._accept(outs)
        self._ended = True
        return self._pump() + self.end()

    def _accept(self, outputs: list[Any]) -> None:
        """The ``RequestOutput``s of one producer event, for vLLM's generator."""
        self._queue.extend(outputs)

    def end(self) -> bytes:
        """The producer's stream is over (``[DONE]`` or end of body)."""
        if self.finished:
            return self._take_early()
        if not self.outputs.done:
            return self.fail(502, INCOMPLETE)
        self._ended = True
        return self._pump()

    def fail(self, status: int, message: str, err_type: str | None = None) -> bytes:
        """Stop here: what was produced so far, an OpenAI error event, then ``[DONE]``."""
        if self.finished:
            return self._take_early()
        self._close()
        return self._take_early() + error_event(status, message, err_type) + DONE

    def close(self) -> None:
        """The exchange ended before the stream did (client gone): shut vLLM's generator."""
        if not self.finished:
            self._close()

    def _close(self) -> None:
        self.finished = True
        step, self._step = self._step, None
        close_chain(step, self._agen)

    def _pump(self) -> bytes:
        """Run the generator until it waits for the next event or ends."""
        step, self._step = self._step, None
        frames, self._step = self._run_client_chain(self._agen, step)
        return self._take_early() + frames

    def _run_client_chain(self, agen: Any, step: Any) -> tuple[bytes, Any]:
        """Run ``agen``, the generator that writes the client's frames, from ``step`` until it waits
        (its frames, its suspended step) or ends (its frames, None: the stream is finished)."""
        frames: list[str] = []
        step = run_until_wait(agen, step, frames)
        if step is None:
            self.finished = True
            self.whole = self._ended and self._failure is None
        return "".join(frames).encode(), step


class UnexpectedAwait(RuntimeError):
    """A generator driven by hand awaited something other than the next event."""


def advance(
    agen: Any, step: Any, emit: Any, throw: BaseException | None = None
) -> tuple[Any, Any, BaseException | None]:
    """Run the async generator ``agen`` -- its suspended ``step`` (``throw`` thrown into it first, if
    given), or a new step -- until it awaits something. Returns its suspended step and what it
    awaits (``WAIT``: the next event); (None, None, None) once it has ended; (None, None, error) when
    it raised ``error`` (its step is then over). What it yields goes to ``emit`` as it comes; what
    ``emit`` raises is raised."""
    while True:
        if step is None:
            step = agen.__anext__()
        try:
            if throw is None:
                awaited = step.send(None)
            else:
                exc, throw = throw, None
                awaited = step.throw(exc)
        except StopIteration as got:
            step = None
            emit(got.value)
            continue
        except StopAsyncIteration:
            return None, None, None
        except BaseException as exc:  # noqa: BLE001 - the generator's failure, for the caller
            return None, None, exc
        return step, awaited, None


def run_until_wait(agen: Any, step: Any, out: Any) -> Any:
    """Run the async generator ``agen`` -- its suspended ``step``, or a new step -- until it waits
    for the next event: its suspended step, or None once it has ended. What it yields is appended
    to ``out`` as it comes; what it raises is raised (its step is then over)."""
    step, awaited, error = advance(agen, step, out.append)
    if error is not None:
        raise error
    if step is not None and awaited is not WAIT:
        shut(step)
        raise UnexpectedAwait(f"vLLM's stream generator awaited {awaited!r}")
    return step


def close_chain(step: Any, agen: Any) -> None:
    """End the async generator ``agen`` driven by hand, and its suspended ``step`` if any."""
    if step is not None:
        # Not close() nor GeneratorExit: either closes the suspended ``asend`` objects
        # in the chain without ending their generators, which stay marked running, and
        # asyncio's finalizer then logs "aclose(): asynchronous generator is already
        # running" for each at garbage collection. An exception unwinds every frame.
        shut(step)
    closer = agen.aclose()
    try:
        closer.send(None)
    except StopIteration:
        pass
    except RuntimeError:
        closer.close()


class _Shut(BaseException):
    """Thrown into a suspended generator chain to end it (vLLM's code catches ``Exception``)."""


def shut(awaitable: Any) -> None:
    """End a suspended step of an async generator chain, running its ``finally`` blocks."""
    try:
        awaitable.throw(_Shut)
    except (_Shut, StopIteration, StopAsyncIteration, RuntimeError):
        pass


def final_output(outputs: ChoiceOutputs, producer_body: bytes) -> Any:
    """The one final ``RequestOutput`` of a non-streaming producer response."""
    try:
        event = json.loads(producer_body)
        if outputs.cached is not None:
            outputs.cached.value = cached_tokens(event) or 0
        finals, _, _ = step_event(outputs, event)
    except (ProducerError, ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
        raise HTTPError(502, f"invalid producer response: {exc}") from None
    if not outputs.done or len(finals) != 1:
        raise HTTPError(502, "the producer's response does not finish every choice")
    # What the producer's KV connector says of the request (disaggregated prefill: where its blocks
    # wait), which the coupled server returns from the engine's output: vLLM's generators copy it.
    params = event.get("kv_transfer_params")
    finals[0].kv_transfer_params = params if isinstance(params, dict) else None
    return finals[0]


async def chat_completion(model: Model, rendered: Rendered, final: Any) -> bytes:
    """The generation's final ``RequestOutput`` -> the ``chat.completion`` JSON, by vLLM's full generator."""
    return dumps((await chat_response(model.serving_chat, model, rendered, final)).model_dump())


async def chat_response(chat: Any, model: Model, rendered: Rendered, final: Any) -> Any:
    """The final ``RequestOutput`` -> vLLM's ``ChatCompletionResponse`` by ``chat`` (an ``OpenAIServingChat``)."""
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata

    async def results():
        yield final

    request = rendered.request
    parser = None
    if chat.parser_cls is not None:
        parser = vllm_seams.make_parser(chat, request, model.tokenizer, rendered.chat_template_kwargs)
    result = await chat.chat_completion_full_generator(
        request,
        results(),
        rendered.request_id,
        model.response_name(request.model),
        rendered.conversation,
        model.tokenizer,
        RequestResponseMetadata(request_id=rendered.request_id),
        parser=parser,
    )
    if hasattr(result, "error"):
        raise HTTPError.from_vllm(result)
    return result
