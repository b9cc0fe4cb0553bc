"""The Responses session's hand driving of vLLM's event generator (``endpoints/responses/session``).

vLLM's streaming Responses generator is driven by hand while it waits only for the producer's
outputs; when it awaits anything else (a store, a lock held by another request, a timer) a task
finishes that step. Here a generator that awaits such things between, before and after its outputs
is run both by the session and as asyncio runs it (``async for`` in a task, the oracle): the client
must get the same frames, failures included, and cancelling mid-await must leave nothing running.
"""

from __future__ import annotations

import asyncio
import gc
import types
from typing import Any

import pytest
from derender.endpoints.responses.session import Session, _error_event
from pydantic import BaseModel


class Event(BaseModel):
    type: str
    sequence_number: int
    delta: str = ""


class Request:
    def __init__(self, request_id: str) -> None:
        self.request_id, self.stream = request_id, True


class Serving:
    """Stands in for vLLM's ``OpenAIServingResponses``: ``create_responses`` returns an event
    generator that asks the engine (the session) for outputs only once iterated, as vLLM's does, and
    awaits ``pauses[i]`` (a coroutine function) before its i-th output's event."""

    def __init__(self, pauses: dict[Any, Any], fail_at: int | None = None) -> None:
        self.pauses, self.fail_at = pauses, fail_at

    async def create_responses(self, request: Request) -> Any:
        return self.events(request)

    async def events(self, request: Request):
        sequence = 0
        yield Event(type="response.created", sequence_number=sequence)
        if "start" in self.pauses:
            await self.pauses["start"]()
        outputs = SESSIONS[request.request_id].generate(None, None, {})
        async for i, text in _enumerate(outputs):
            if i in self.pauses:
                await self.pauses[i]()
            if i == self.fail_at:
                raise RuntimeError("the store went away")
            sequence += 1
            yield Event(type="response.output_text.delta", sequence_number=sequence, delta=text)
        if "end" in self.pauses:
            await self.pauses["end"]()
        yield Event(type="response.completed", sequence_number=sequence + 1)


async def _enumerate(agen):
    i = 0
    async for item in agen:
        yield i, item
        i += 1


SESSIONS: dict[str, Session] = {}
TEXTS = ["Hel", "lo", " wor", "ld", "!"]


def frame(event: Event) -> bytes:
    return f"event: {event.type}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n".encode()


async def oracle(serving: Serving) -> bytes:
    """The frames of the generator as asyncio runs it, fed every output at once."""
    class Outputs:
        def generate(self, *_: Any) -> Any:
            async def outputs():
                for text in TEXTS:
                    yield text
            return outputs()

    SESSIONS["oracle"] = Outputs()  # type: ignore[assignment]
    out, sequence = [], -1
    try:
        async for event in await serving.create_responses(Request("oracle")):
            sequence = event.sequence_number
            out.append(frame(event))
    except RuntimeError as exc:
        out.append(_error_event(exc, sequence + 1))
    return b"".join(out)


async def by_session(serving: Serving, chunks: list[list[str]]) -> bytes:
    """The frames the session gives, the outputs pushed a chunk at a time as producer events come."""
    session = Session(Request("driven"))
    SESSIONS["driven"] = session
    session.start(serving)
    await session.until_called()
    out = [session.take_frames()]
    for chunk in chunks:
        session.push(chunk)
        await session.settle()
        out.append(session.take_frames())
    session.end()
    await session.settle()
    out.append(session.take_frames())
    assert session.done
    return b"".join(out)


async def sleep() -> None:
    await asyncio.sleep(0.002)


async def yield_once() -> None:
    await asyncio.sleep(0)


def held_lock() -> Any:
    """A lock another task holds for a while: awaiting it suspends on a real future."""
    lock = asyncio.Lock()

    async def hold() -> None:
        async with lock:
            await asyncio.sleep(0.005)

    async def take() -> None:
        if not lock.locked():
            asyncio.get_running_loop().create_task(hold())
            await asyncio.sleep(0)
        async with lock:
            pass
    return take


PAUSES = {
    "none": lambda: {},
    "a timer before the first output": lambda: {"start": sleep},
    "a timer mid-stream": lambda: {2: sleep},
    "a bare yield mid-stream": lambda: {1: yield_once},
    "a lock held elsewhere at the end": lambda: {"end": held_lock()},
    "everywhere": lambda: {"start": yield_once, 0: sleep, 3: held_lock(), "end": sleep},
}
CHUNKINGS = [[[t] for t in TEXTS], [TEXTS[:2], TEXTS[2:]]]


@pytest.mark.parametrize("pauses", list(PAUSES))
@pytest.mark.parametrize("fail_at", [None, 3])
def test_the_session_gives_the_frames_asyncio_gives(pauses, fail_at):
    async def go():
        want = await oracle(Serving(PAUSES[pauses](), fail_at))
        got = [await by_session(Serving(PAUSES[pauses](), fail_at), chunks) for chunks in CHUNKINGS]
        return want, got
    want, got = asyncio.run(go())
    assert b"response.created" in want and (b"error" in want) == (fail_at is not None)
    assert got == [want] * len(CHUNKINGS)


@pytest.mark.parametrize("pauses", ["a timer mid-stream", "a lock held elsewhere at the end"])
def test_cancelling_a_session_mid_await_leaves_nothing_running(pauses):
    async def go():
        session = Session(Request("driven"))
        SESSIONS["driven"] = session
        session.start(Serving(PAUSES[pauses]()))
        await session.until_called()
        session.push(TEXTS)
        session.end()
        settling = asyncio.ensure_future(session.settle())
        await asyncio.sleep(0)
        assert session._pending is not None  # a step is awaiting something real
        session.cancel()
        await asyncio.sleep(0.01)
        settling.cancel()
        return session
    session = asyncio.run(go())
    gc.collect()
    running = [g for g in gc.get_objects() if isinstance(g, types.AsyncGeneratorType) and g.ag_running]
    assert not running and session._pending is None and session.done


def test_the_cached_type_adapter_is_the_one_pydantic_builds():
    """``lean.cached_type_adapter``: what vLLM's Responses server validates its error event with,
    built once. It must answer as a fresh ``TypeAdapter`` does: the chat-shaped error JSON vLLM
    writes for an engine failure is refused with the same errors, a real event is read as the same
    object; other arguments and unhashable types get a new adapter."""
    import json

    import pydantic
    from derender.endpoints.responses import lean
    from openai.types.responses import ResponseReasoningTextDeltaEvent
    from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse
    from vllm.entrypoints.openai.responses.protocol import StreamingResponsesResponse

    cached = lean.cached_type_adapter(StreamingResponsesResponse)
    assert lean.cached_type_adapter(StreamingResponsesResponse) is cached
    fresh = pydantic.TypeAdapter(StreamingResponsesResponse)

    error = json.dumps(ErrorResponse(error=ErrorInfo(message="boom", type="InternalServerError", code=500)).model_dump())
    refusals = []
    for adapter in (cached, fresh):
        with pytest.raises(pydantic.ValidationError) as info:
            adapter.validate_json(error)
        refusals.append(info.value.errors(include_url=False))
    assert refusals[0] == refusals[1]

    delta = ResponseReasoningTextDeltaEvent(type="response.reasoning_text.delta", delta="héllo 東京", item_id="rs_1",
                                            output_index=0, content_index=0, sequence_number=7).model_dump_json()
    read = [adapter.validate_json(delta) for adapter in (cached, fresh)]
    assert type(read[0]) is type(read[1]) and read[0].model_dump() == read[1].model_dump()

    assert lean.cached_type_adapter(StreamingResponsesResponse, config=None) is not cached
    unhashable = typing_annotated_unhashable()
    assert lean.cached_type_adapter(unhashable) is not lean.cached_type_adapter(unhashable)


def typing_annotated_unhashable() -> Any:
    """An ``Annotated`` type whose metadata is a list: it cannot be a dict key."""
    from typing import Annotated

    return Annotated[int, ["unhashable"]]
