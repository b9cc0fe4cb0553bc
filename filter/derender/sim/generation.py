"""One request in flight, its choices, and how vLLM's output processor groups steps into events."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web


class StepClock:
    """The engine steps of one GPU running every request in one batch: a step every ``interval``
    seconds, at the same moment for every request, as vLLM's continuous batching decodes them all
    at once (``--lockstep``). Requests waiting for a step wake in one turn of the event loop."""

    def __init__(self) -> None:
        self._steps: dict[tuple[float, int], asyncio.Future] = {}

    async def wait(self, steps: int, interval: float) -> None:
        """Until the ``steps``-th step from now (the next one counts as 1). A waiter cancelled (its
        client gone) leaves the step's future, which the other waiters share, as it is."""
        loop = asyncio.get_running_loop()
        key = (interval, int(loop.time() / interval) + steps)
        future = self._steps.get(key)
        if future is None:
            future = self._steps[key] = loop.create_future()
            loop.call_at(key[1] * interval, self._step, key)
        await asyncio.shield(future)

    def _step(self, key: tuple[float, int]) -> None:
        future = self._steps.pop(key)
        if not future.done():
            future.set_result(None)


@dataclass
class _Choice:
    index: int
    tokens: list[int]
    finish: str
    stop_reason: int | str | None
    sizes: list[int]  # tokens per event, summing to len(tokens)
    logprobs: list[dict[int, tuple[float, int]]] | None  # per token, in engine order
    steps: list[int] | None = None  # engine steps per event (stream_interval); None: one each
    sent: int = 0
    done: bool = False


@dataclass(eq=False)  # hashable by identity
class _Generation:
    """One request in flight."""

    engine_id: str
    choices: list[_Choice]
    request: web.Request
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    fault: str | None = None  # the knobs when the request came in
    fault_after: int = 0
    hold_after: int | str | None = None  # N events, or "end": after the last, before [DONE]
    released: asyncio.Event = field(default_factory=asyncio.Event)
    cached_tokens: int = 0  # of the prompt, found in the prefix cache
    prefilled: bool = False  # its prompt computed in the engine's steps (--max-num-batched-tokens)

    def closed(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()


def _stream_interval(sizes: list[int], interval: int) -> list[int] | None:
    """Engine steps (of these token counts) per event that vLLM's output processor sends with
    ``stream_interval`` N: the first token's step at once, then whenever N tokens have gathered
    since the last event, and the last step (``output_processor.py``); None for N = 1. An event
    waits for each of its steps (``delay`` per step), so a client sees a GPU's pacing."""
    if interval <= 1:
        return None
    steps: list[int] = []
    gathered = count = 0
    for i, size in enumerate(sizes):
        gathered, count = gathered + size, count + 1
        if not steps or gathered >= interval or i == len(sizes) - 1:
            steps.append(count)
            gathered = count = 0
    return steps


class _Disconnected(Exception):
    pass


class _Died(Exception):
    """Fault "die": drop the connection here."""


async def _drop(request: web.Request) -> None:
    """Close the connection at once (no end of body), once what was written is in the kernel."""
    transport = request.transport
    if transport is None:
        return
    while transport.get_write_buffer_size() and not transport.is_closing():  # noqa: ASYNC110 - no event for a drained buffer
        await asyncio.sleep(0.001)
    transport.abort()
