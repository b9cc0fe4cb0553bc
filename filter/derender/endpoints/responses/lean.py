"""The lean path of a Responses stream (``--stream-path lean``): vLLM's per-output loop body, run
by the session (``session``) instead of resuming vLLM's generators, and the delta events it
writes from a template of vLLM's own."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pydantic_core

from ...translate import vllm_seams


class LoopBody:
    """The lean path of a Responses stream: the body of the loop of vLLM's
    ``_process_simple_streaming_events`` (and the lines of ``_generate_with_builtin_tools`` that hand
    it an output), run for an output that does not finish the choice with the loop's own objects --
    the context, its response parser, the streaming event processor, the request, its logprob and
    sequence-number functions. The loop is the filter's (``lean_serving_class``: vLLM 0.33.0's loop,
    which builds those objects itself and lends them to the session), so nothing is read from a
    running frame. vLLM's parsers and event builders do every step; the four async generators that
    carry an output from the engine to the client are not resumed for it. The finishing output, the
    end, failures and what the body raises go through the generators. Harmony's path (gpt-oss) is
    another generator and is not taken here. ``tests/test_lean.py`` runs both paths over generated
    streams (every shipped configuration but gpt-oss) and demands identical bytes."""

    __slots__ = (
        "context",
        "events",
        "logprobs",
        "names",
        "number",
        "numbered",
        "processor",
        "request",
        "states",
        "template",
        "templated",
        "within",
    )

    def __init__(self, context: Any, request: Any, processor: Any, logprobs: Any, number: Any) -> None:
        from vllm.entrypoints.openai.responses import serving as names
        from vllm.entrypoints.openai.responses import streaming_events as events

        self.context, self.request, self.processor = context, request, processor
        self.logprobs, self.number = logprobs, number
        self.names, self.events = names, events
        self.states = vllm_seams.responses_state_type()
        self.numbered = _Numbered()  # what a template's event number is taken on
        self.template: tuple[Any, ...] | None = None  # (key, the delta event's bytes around the delta and the number)
        self.templated = 0  # delta events written from the template (tests read it)
        self.within = 0  # of them, by ``_within`` (tests read it)

    def step(self, res: Any, sink: Any) -> None:
        """The events vLLM's loop yields for ``res`` (whose choice is not finished), numbered, into
        ``sink`` one by one as the loop yields them (each before the next is built)."""
        ctx = self.context
        ctx.request_metrics = res.metrics
        ctx.append_output(res)
        if ctx.last_output is None or not ctx.last_output.outputs:
            return
        output = ctx.last_output.outputs[0]
        delta_message = self._parse(ctx, output)
        if not delta_message or self._within(delta_message, output, sink):
            return
        for event in self._events(delta_message, output, True):
            sink(event)

    def body(self, ctx: Any, output: Any, templates: bool) -> Any:
        """The loop's body for ``output`` of ``ctx``: its events, numbered, each built when the one
        before it is taken; with ``templates``, a delta inside an open item as a ``Frame``."""
        delta_message = self._parse(ctx, output)
        if not delta_message:
            return
        yield from self._events(delta_message, output, templates)

    def _parse(self, ctx: Any, output: Any) -> Any:
        """The body's first lines: ``output``'s ``DeltaMessage`` (None: nothing to send)."""
        if ctx.response_parser:
            return ctx.response_parser.parse_delta(
                delta_text=output.text,
                delta_token_ids=self.names.as_list(output.token_ids),
                request=self.request,
                prompt_token_ids=ctx.last_output.prompt_token_ids,
                finished=output.finish_reason is not None,
            )
        return self.names.DeltaMessage(content=output.text)

    def _within(self, dm: Any, output: Any, sink: Any) -> bool:
        """The body's lines after the parse for a delta of one kind inside the item of that kind
        already open -- most of a stream's outputs -- with what the lines would find decided in
        place: the parallel-call filter keeps it (no call, or the first call when parallel calls are
        off), ``split_delta`` leaves it whole (one field, one call), ``resolve_target_state`` names
        the open item's kind and ``needs_transition`` says no (the same call). Its event goes into
        ``sink`` from the template (``_delta``); True if so, or if those lines would send nothing
        (no reasoning, no text, no call). False, nothing done: the body's lines decide
        (``_events``)."""
        state, states = self.processor.state, self.states
        kind = state.current_state
        calls, reasoning, content = dm.tool_calls, dm.reasoning, dm.content
        if calls:
            if reasoning is not None or content is not None or len(calls) != 1 or kind != states.TOOL_CALL:
                return False
            call = calls[0]
            if call.function is None or (self.request.parallel_tool_calls is False and call.index != 0):
                return False
            if call.index is not None and state.tool_call_index is not None and call.index != state.tool_call_index:
                return False
        elif reasoning is not None:
            if content is not None or kind != states.REASONING:
                return False
        elif content:
            if kind != states.CONTENT:
                return False
        else:
            return True  # resolve_target_state: NONE, nothing sent
        frame = self._delta(dm, output)
        if frame is None:
            return False
        self.within += 1
        sink(frame)
        return True

    def _events(self, delta_message: Any, output: Any, templates: bool) -> Any:
        """The body's lines after the parse: the events of ``delta_message``, numbered."""
        names, request, processor, number = self.names, self.request, self.processor, self.number
        delta_message = names.maybe_filter_parallel_tool_calls(delta_message, request)
        for dm in names.split_delta(delta_message):
            target_state, tool_call = processor.resolve_target_state(dm)
            if target_state == self.states.NONE:
                continue
            if processor.needs_transition(target_state, tool_call):
                for event in processor.close_current():
                    yield number(event)
                for event in processor.open(target_state, tool_call):
                    yield number(event)
            elif templates:
                frame = self._delta(dm, output)
                if frame is not None:
                    yield frame
                    continue
            for event in processor.emit_delta(dm, output, self.logprobs):
                yield number(event)

    def _delta(self, dm: Any, output: Any) -> Frame | None:
        """``emit_delta``'s one event for a delta inside an open item, as bytes from a template of
        that event (built by vLLM's own ``emit_simple_*_delta`` on a copy of the state, so its class
        and fields are vLLM's), the state's text grown as ``emit_delta`` grows it; None (nothing
        done) for what the template does not cover: logprobs, custom tools, empty arguments."""
        events, state, states = self.events, self.processor.state, self.states
        kind = state.current_state
        if kind == states.REASONING:
            delta, make = dm.reasoning, events.emit_simple_reasoning_delta
        elif kind == states.CONTENT:
            if self.logprobs(output):
                return None
            delta, make = dm.content, events.emit_simple_content_delta
        elif kind == states.TOOL_CALL and not state.tool_call_is_custom:
            delta = "".join(
                tc.function.arguments for tc in dm.tool_calls or () if tc.function is not None and tc.function.arguments
            )
            make = events.emit_simple_tool_call_delta
        else:
            return None
        if not delta:
            return None
        key = (kind, state.current_item_id, state.output_index, state.content_index)
        if self.template is None or self.template[0] != key:
            self.template = (key, *_template(make, state))
        _, head, middle, tail, delta_first = self.template
        number = self.number(self.numbered).sequence_number
        state.accumulated_text += delta
        text, count = pydantic_core.to_json(delta), str(number).encode()
        self.templated += 1
        return Frame(
            head + text + middle + count + tail if delta_first else head + count + middle + text + tail, number
        )


MARK = "\x00derender-delta\x00"
NUMBER = 987654321987


def event_frame(event: Any) -> bytes:
    """A Responses event as the client gets it: its SSE frame."""
    return (
        f"event: {getattr(event, 'type', 'unknown')}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"
    ).encode()


def _template(make: Any, state: Any) -> tuple[bytes, bytes, bytes, bool]:
    """A delta event's SSE frame (``event_frame``), cut around its delta and its
    sequence number: (head, middle, tail, whether the delta comes first)."""
    [event] = make(dataclasses.replace(state), MARK)
    event.sequence_number = NUMBER
    frame = event_frame(event)
    mark, number = pydantic_core.to_json(MARK), str(NUMBER).encode()
    at_mark, at_number = frame.index(mark), frame.index(number)
    if frame.count(mark) != 1 or frame.count(number) != 1:
        raise ValueError("the delta event's template is ambiguous")
    if at_mark < at_number:
        return frame[:at_mark], frame[at_mark + len(mark) : at_number], frame[at_number + len(number) :], True
    return frame[:at_number], frame[at_number + len(number) : at_mark], frame[at_mark + len(mark) :], False


class Frame:
    """A delta event already written (``LoopBody._delta``): its bytes and its sequence number."""

    __slots__ = ("frame", "sequence_number")

    def __init__(self, frame: bytes, sequence_number: int) -> None:
        self.frame, self.sequence_number = frame, sequence_number


class _Numbered:
    """What vLLM's numbering function numbers for an event written from a template: it sets the
    ``sequence_number`` of what it is given and counts up."""

    __slots__ = ("sequence_number",)

    def __init__(self) -> None:
        self.sequence_number = -1


MAX_ADAPTERS = 16  # types whose adapter is held (vLLM's Responses server builds one, for its error event)
_adapters: dict[Any, Any] = {}


def cached_type_adapter(type_: Any, **kwargs: Any) -> Any:
    """pydantic's ``TypeAdapter(type_)``, built once per type and kept. vLLM's Responses server builds
    ``TypeAdapter(StreamingResponsesResponse)`` anew for every stream an engine failure ends (its
    ``GenerationError`` branch): some 15 ms of CPU on the worker's loop for a union of every event
    type, so a failing producer under 256 streams would hold the loop for seconds. The adapter is
    the same object pydantic builds (resolved from the caller's frame, as ``TypeAdapter(...)`` there
    resolves it); any other argument, or a type that cannot be a key, gets a new one."""
    from pydantic import TypeAdapter

    if kwargs:
        return TypeAdapter(type_, _parent_depth=3, **kwargs)
    try:
        adapter = _adapters.get(type_)
    except TypeError:  # an unhashable type expression
        return TypeAdapter(type_, _parent_depth=3)
    if adapter is None:
        adapter = TypeAdapter(type_, _parent_depth=3)
        if len(_adapters) < MAX_ADAPTERS:
            _adapters[type_] = adapter
    return adapter


def cache_type_adapters() -> None:
    """vLLM's Responses server module builds its ``TypeAdapter``s through ``cached_type_adapter``
    (installed by a lean model's Responses serving; ``--stream-path vllm`` leaves the module as it is)."""
    from pydantic import TypeAdapter
    from vllm.entrypoints.openai.responses import serving as names

    if names.TypeAdapter is TypeAdapter:
        setattr(names, "TypeAdapter", cached_type_adapter)  # noqa: B010 (a module global, typed as the class)


@functools.cache
def lean_serving_class(lend: Callable[[str, LoopBody], None]) -> type:
    """``OpenAIServingResponses`` whose simple streaming loop is the filter's: vLLM 0.33.0's
    ``_process_simple_streaming_events``, line for line, but for its body (``LoopBody.body``) and one
    more line: it lends its objects to the request's session (``lend``), whose lean path runs the
    body for the outputs that finish nothing. ``vllm_seams`` checks the loop it copies is still
    0.33.0's; ``--stream-path vllm`` serves with vLLM's class."""
    from vllm.entrypoints.openai.responses import serving as names

    class LeanServingResponses(names.OpenAIServingResponses):
        async def _process_simple_streaming_events(  # the seam "responses simple loop"
            self,
            request: Any,
            sampling_params: Any,
            result_generator: Any,
            context: Any,
            model_name: str,
            tokenizer: Any,
            request_metadata: Any,
            created_time: int,
            _increment_sequence_number_and_return: Callable[[Any], Any],
        ) -> Any:
            number = _increment_sequence_number_and_return
            processor = names.SimpleStreamingEventProcessor(tools=request.tools)
            hide_stream_metadata = not request.include_reasoning and context.response_parser is not None

            def _get_logprobs(output: Any) -> list[Any]:
                if not request.is_include_output_logprobs():
                    return []
                if hide_stream_metadata:
                    return []
                return vllm_seams.response_logprobs(
                    self,
                    token_ids=output.token_ids,
                    logprobs=output.logprobs,
                    tokenizer=tokenizer,
                    top_logprobs=request.top_logprobs,
                )

            body = LoopBody(context, request, processor, _get_logprobs, number)
            lend(request.request_id, body)
            finish_reason: str | None = None
            async for ctx in result_generator:
                assert isinstance(ctx, names.SimpleContext)
                if ctx.last_output is None or not ctx.last_output.outputs:
                    continue
                output = ctx.last_output.outputs[0]
                vllm_seams.raise_if_error(self, output.finish_reason, request.request_id)
                finish_reason = output.finish_reason
                for event in body.body(ctx, output, False):
                    yield event
            for event in processor.close_current(names.response_item_status(finish_reason)):
                yield number(event)
            assert isinstance(context, names.SimpleContext)
            context.streamed_output_items = processor.output_items

        @classmethod
        def simple_loop(cls) -> Callable[..., Any]:
            """The copied loop (``derender seams`` compares it with vLLM's original)."""
            return cls._process_simple_streaming_events

    return LeanServingResponses
