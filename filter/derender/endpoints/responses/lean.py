"""The lean path of a Responses stream (``--stream-path lean``): vLLM's per-output loop body, run
by the session (``session``) instead of resuming vLLM's generators, and the delta events it
writes from a template of vLLM's own."""

from __future__ import annotations

import dataclasses
from typing import Any

import pydantic_core

from ...translate import vllm_seams


class LoopBody:
    """The lean path of a Responses stream: the body of the loop of vLLM's
    ``_process_simple_streaming_events`` (and the lines of ``_generate_with_builtin_tools`` that hand
    it an output), run for an output that does not finish the choice with that generator's own
    objects -- the context, its response parser, the streaming event processor, the request, its
    logprob and sequence-number functions -- taken from its frame when it asks the engine to
    generate. So vLLM's parsers and event builders do every step; the four async generators that
    carry an output from the engine to the client are not resumed for it. The finishing output,
    the end, failures and what the body raises go through the generators. Harmony's path (gpt-oss)
    is another generator and is not taken here. ``tests/test_lean.py`` runs both paths over
    generated streams (every shipped configuration but gpt-oss) and demands identical bytes."""

    __slots__ = (
        "context",
        "counter",
        "events",
        "logprobs",
        "names",
        "number",
        "processor",
        "request",
        "states",
        "template",
        "templated",
    )

    @classmethod
    def of(cls, frame: Any) -> LoopBody | None:
        """From the frame of the caller of the engine's ``generate``, if it is the simple path's."""
        local = vllm_seams.responses_loop_locals(frame)
        if local is None:
            return None
        try:
            return cls(local)
        except (vllm_seams.SeamChanged, KeyError, ImportError, AttributeError):  # not the generator expected
            return None

    def __init__(self, local: dict[str, Any]) -> None:
        from vllm.entrypoints.openai.responses import serving as names

        self.context, self.request, self.processor = local["context"], local["request"], local["processor"]
        self.logprobs, self.number = local["_get_logprobs"], local["_increment_sequence_number_and_return"]
        from vllm.entrypoints.openai.responses import streaming_events as events

        self.names, self.events = names, events
        for name in ("as_list", "split_delta", "maybe_filter_parallel_tool_calls", "DeltaMessage"):
            getattr(names, name)
        self.states = vllm_seams.responses_state_type()
        # The generator's sequence number: the closure cell its numbering function counts in.
        self.counter = vllm_seams.sequence_number_cell(self.number)
        self.template: tuple[Any, ...] | None = None  # (key, the delta event's bytes around the delta and the number)
        self.templated = 0  # delta events written from the template (tests read it)

    def step(self, res: Any, sink: Any) -> None:
        """The events vLLM's loop yields for ``res`` (whose choice is not finished), numbered, into
        ``sink`` one by one as the loop yields them (each before the next is built)."""
        names, ctx, request, processor = self.names, self.context, self.request, self.processor
        ctx.request_metrics = res.metrics
        ctx.append_output(res)
        if ctx.last_output is None or not ctx.last_output.outputs:
            return
        output = ctx.last_output.outputs[0]
        if ctx.response_parser:
            delta_message = ctx.response_parser.parse_delta(
                delta_text=output.text,
                delta_token_ids=names.as_list(output.token_ids),
                request=request,
                prompt_token_ids=ctx.last_output.prompt_token_ids,
                finished=output.finish_reason is not None,
            )
        else:
            delta_message = names.DeltaMessage(content=output.text)
        if not delta_message:
            return
        delta_message = names.maybe_filter_parallel_tool_calls(delta_message, request)
        number = self.number
        for dm in names.split_delta(delta_message):
            target_state, tool_call = processor.resolve_target_state(dm)
            if target_state == self.states.NONE:
                continue
            if processor.needs_transition(target_state, tool_call):
                for event in processor.close_current():
                    sink(number(event))
                for event in processor.open(target_state, tool_call):
                    sink(number(event))
            elif self._delta(dm, output, sink):
                continue
            for event in processor.emit_delta(dm, output, self.logprobs):
                sink(number(event))

    def _delta(self, dm: Any, output: Any, sink: Any) -> bool:
        """``emit_delta``'s one event for a delta inside an open item, as bytes from a template of
        that event (built by vLLM's own ``emit_simple_*_delta`` on a copy of the state, so its class
        and fields are vLLM's), the state's text grown as ``emit_delta`` grows it; False (nothing
        done) for what the template does not cover: logprobs, custom tools, empty arguments."""
        events, state, states = self.events, self.processor.state, self.states
        kind = state.current_state
        if kind == states.REASONING:
            delta, make = dm.reasoning, events.emit_simple_reasoning_delta
        elif kind == states.CONTENT:
            if self.logprobs(output):
                return False
            delta, make = dm.content, events.emit_simple_content_delta
        elif kind == states.TOOL_CALL and not state.tool_call_is_custom:
            delta = "".join(
                tc.function.arguments for tc in dm.tool_calls or () if tc.function is not None and tc.function.arguments
            )
            make = events.emit_simple_tool_call_delta
        else:
            return False
        if not delta:
            return False
        key = (kind, state.current_item_id, state.output_index, state.content_index)
        if self.template is None or self.template[0] != key:
            self.template = (key, *_template(make, state))
        _, head, middle, tail, delta_first = self.template
        number = vllm_seams.take_sequence_number(self.counter)
        state.accumulated_text += delta
        text, count = pydantic_core.to_json(delta), str(number).encode()
        sink(Frame(head + text + middle + count + tail if delta_first else head + count + middle + text + tail, number))
        self.templated += 1
        return True


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
