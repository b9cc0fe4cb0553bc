"""Messages on the lean path (``--stream-path lean``): ``LeanMessagesStream``."""

from __future__ import annotations

import functools
import json
import logging
from collections import deque
from typing import Any

import pydantic_core

from ...translate.lean import MARK, LeanChatStream
from ...translate.model import Model
from ...translate.render import Rendered
from ...translate.stream import WAIT, UnexpectedAwait, close_chain, run_until_wait
from .stream import fail_as_messages, serving_messages

log = logging.getLogger("derender.messages")


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

    A tool call's argument deltas in its open ``tool_use`` block are written from a template too
    (``input_json_delta``). For those the converter does keep one thing: the arguments, read once at
    the end (whether they are complete JSON). So they are held (``_held``) and handed to the
    converter as one delta, the arguments joined, before it takes any other chunk; what it writes
    for that delta is the held events' text in one event, and is not sent. Which tool call a delta
    continues is followed as the converter follows it: the tool call ids of the chunks it takes
    (``_take``) and the id of the block it opened.
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
        self._tool_ids: dict[int, str] = {}  # the converter's tool call index -> id, from the chunks it took
        self._taken_first = False  # the converter reads nothing but the id and usage of its first chunk
        self._held: list[str] = []  # templated tool-call arguments the converter has not taken
        self._held_index = -1  # the tool call index they continue
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
                yield self._take(self._chunks.popleft())
            if self._raw_error is not None:
                raise self._raw_error
            if self._raw_over:
                return
            await WAIT

    def _take(self, chunk: Any) -> Any:
        """``chunk`` as the converter takes it, its tool call ids followed as the converter follows
        them (it skips its first chunk; an error ends it)."""
        if not self._taken_first:
            self._taken_first = True
        elif getattr(chunk, "choices", None):  # not an ErrorResponse, not the usage chunk
            for call in chunk.choices[0].delta.tool_calls:
                if call.id is not None:
                    self._tool_ids[call.index] = call.id
        return chunk

    def _delta_bytes(self, delta: Any) -> bytes:
        block = self._block
        if not self._chunks and self._conv_step is not None:
            reasoning, content, calls = delta.reasoning, delta.content, delta.tool_calls
            if not calls:
                if not reasoning and not content:
                    return b""  # the converter writes nothing for it
                if reasoning and not content and block.kind == "thinking":
                    return self._template("thinking", block.index, reasoning)
                if content and not reasoning and block.kind == "text":
                    return self._template("text", block.index, content)
            elif len(calls) == 1 and not reasoning and not content and block.kind == "tool_use":
                arguments = self._continued(calls[0], block)
                if arguments is not None:
                    self._held.append(arguments)
                    self._held_index = calls[0].index
                    return self._template("input_json", block.index, arguments)
        self._give_held()
        self.converted += 1
        self._chunks.append(self._frame.chunk(delta))  # type: ignore[union-attr]  # the lean path: a _Frame
        return self._convert()

    def _continued(self, call: Any, block: OpenBlock) -> str | None:
        """The arguments ``call`` adds to the open ``tool_use`` block, if that is all the converter
        would do with it (one ``input_json_delta`` event); else None."""
        function = call.function
        if call.id is not None or function is None or not function.arguments:
            return None
        if block.tool_id is None or self._tool_ids.get(call.index) != block.tool_id:
            return None  # the converter writes nothing for a call it has no id for
        if self._held and call.index != self._held_index:
            return None
        return function.arguments

    def _give_held(self) -> None:
        """The held arguments to the converter, as one delta, before it takes anything else; its
        event for them (their text, sent already) is dropped."""
        if not self._held:
            return
        from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall

        joined = "".join(self._held)
        self._held.clear()
        call = DeltaToolCall(index=self._held_index, function=DeltaFunctionCall(arguments=joined))
        self._chunks.append(self._frame.chunk(DeltaMessage(tool_calls=[call])))  # type: ignore[union-attr]
        index = self._block.index
        dropped = self._convert()
        head, tail = _delta_event_halves("input_json", index)
        if dropped != head + pydantic_core.to_json(joined) + tail:
            log.error("vLLM's Messages converter wrote %r for held tool-call arguments", dropped[:200])

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
        self._give_held()
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

    __slots__ = ("index", "kind", "tool_id")

    START = b"event: content_block_start\ndata: "
    STOP = b"event: content_block_stop\n"

    def __init__(self) -> None:
        self.kind: str | None = None
        self.index = -1
        self.tool_id: str | None = None  # a tool_use block's id

    def follow(self, frames: bytes) -> None:
        """Take the converter's ``frames`` of one step into account."""
        start, stop = frames.rfind(self.START), frames.rfind(self.STOP)
        if stop > start:
            self.kind, self.index, self.tool_id = None, -1, None
        elif start >= 0:
            data = frames[start + len(self.START) :].split(b"\n", 1)[0]
            event = json.loads(data)
            block = event["content_block"]
            self.kind, self.index = block["type"], event["index"]
            self.tool_id = block.get("id") if self.kind == "tool_use" else None


@functools.cache
def _delta_event_halves(kind: str, index: int) -> tuple[bytes, bytes]:
    """vLLM's converter's ``content_block_delta`` event of ``kind`` ("thinking", "text" or
    "input_json") in block ``index``, as serialized by its models, cut around the text's JSON string."""
    from vllm.entrypoints.anthropic.protocol import AnthropicDelta, AnthropicStreamEvent
    from vllm.entrypoints.anthropic.serving import wrap_data_with_event

    field = "partial_json" if kind == "input_json" else kind
    delta = AnthropicDelta.model_validate({"type": f"{kind}_delta", field: MARK})
    event = AnthropicStreamEvent(index=index, type="content_block_delta", delta=delta)
    data = wrap_data_with_event(event.model_dump_json(exclude_unset=True), "content_block_delta").encode()
    head, tail = data.split(pydantic_core.to_json(MARK))  # ValueError unless it is there exactly once
    return head, tail
