"""What a ``Simulator`` holds, declared for the type checker: ``simulator.Simulator.__init__`` and
``configure`` set it, and ``serving.Serving``'s handlers (a base of ``Simulator``) use it."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import PrefixCache
    from .generation import _Choice, _Generation


class SimulatorState:
    requests: collections.deque
    headers: collections.deque
    received: int
    prompt_tokens: int
    cached_prompt_tokens: int
    prefill_waits: collections.deque[float]
    aborted: list[str]
    disconnected: list[str]
    running: dict[str, set[_Generation]]
    held: set[_Generation]
    hold_after: int | str | None  # 'end': held after the last event
    cache: PrefixCache
    prefill_us_per_token: float
    _prefill: asyncio.Lock
    http_error: int | None
    fault: str | None
    fault_after: int
    split_writes: int
    vocab_size: int
    max_model_len: int
    model_name: str

    if TYPE_CHECKING:  # ``Simulator``'s

        def _plan(self, body: dict) -> list[_Choice]: ...
        def _steps(self, gen: _Generation) -> AsyncIterator[tuple]: ...
        def _cached(self, gen: _Generation) -> int | None: ...
        @staticmethod
        def _choice(c: _Choice, start: int, end: int, final: bool, k: int | None) -> dict: ...
        @staticmethod
        def _usage(prompt: int, completion: int, details: bool = True, cached: int | None = None) -> dict: ...
