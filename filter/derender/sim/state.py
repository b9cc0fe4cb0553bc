"""What a ``Simulator`` holds and does for its handlers: ``simulator.Simulator.__init__`` and
``configure`` set the attributes and ``Simulator`` implements the methods, which ``serving.Serving``'s
handlers (a base of ``Simulator``) use."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import PrefixCache
    from .engine import Engine
    from .generation import _Choice, _Generation
    from .handoff import KvHandoff
    from .scheduler import Scheduler


class SimulatorState:
    requests: collections.deque
    numbered: collections.deque
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
    scheduler: Scheduler  # --max-num-seqs
    handoff: KvHandoff  # --kv-role
    loras: dict[str, tuple[str, str, int]]  # --lora-modules: name -> (name, path, vLLM's id)
    prefill_us_per_token: float
    _prefill: asyncio.Lock
    engine: Engine | None  # --max-num-batched-tokens
    kv_transfer_us_per_token: float
    delay: float
    http_error: int | None
    fault: str | None
    fault_after: int
    split_writes: int
    vocab_size: int
    max_model_len: int
    model_name: str

    # What ``Simulator`` implements for ``Serving``'s handlers.
    def _plan(self, body: dict) -> list[_Choice]:
        raise NotImplementedError

    def _steps(self, gen: _Generation) -> AsyncIterator[tuple]:
        raise NotImplementedError

    def _cached(self, gen: _Generation) -> int | None:
        raise NotImplementedError

    @staticmethod
    def _choice(c: _Choice, start: int, end: int, final: bool, k: int | None) -> dict:
        raise NotImplementedError

    @staticmethod
    def _usage(prompt: int, completion: int, details: bool = True, cached: int | None = None) -> dict:
        raise NotImplementedError
