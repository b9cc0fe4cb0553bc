"""One GPU's engine loop with prefill and decode in the same steps (``derender sim
--max-num-batched-tokens N``), as vLLM's scheduler runs chunked prefill: each step computes the next
token of every decoding sequence and, with what is left of its token budget (N, less one token per
decoding sequence), the next chunk of the waiting prompts, first come first served. A step lasts the
decode step (``--delay``) plus its prompt tokens times ``--prefill-us-per-token``, so a long prompt
prefilled on a replica stretches the steps of every stream decoding there: the inter-token latency a
disaggregated prefill takes away.

Without the flag the simulator keeps its simpler model (``StepClock``'s fixed steps, prefill one prompt
at a time beside them, never slowing a decode step).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager


class _Prompt:
    __slots__ = ("done", "left")

    def __init__(self, left: int, done: asyncio.Future) -> None:
        self.left, self.done = left, done  # tokens still to compute; set when none are left


class Engine:
    def __init__(self, budget: int, us_per_token: float) -> None:
        if budget <= 0:
            raise ValueError("--max-num-batched-tokens must be positive")
        self.budget, self.us_per_token = budget, us_per_token
        self.interval = 0.0  # the decode step, seconds (the simulator's --delay)
        self.done = 0  # steps run, ever
        self.prompt_tokens = 0  # prompt tokens computed, ever
        self.prefill_steps = 0  # steps that computed prompt tokens
        self.busy = 0.0  # seconds of steps spent on prompt tokens
        self._wakes: dict[int, asyncio.Future] = {}  # step number -> its waiters' shared future
        self.decoding = 0  # sequences past their prefill, each a token of every step's budget
        self._prompts: deque[_Prompt] = deque()  # in arrival order
        self._task: asyncio.Task | None = None

    async def step(self, steps: int, interval: float) -> None:
        """Until the ``steps``-th step from now ends, a token of one sequence computed in it. A waiter
        cancelled (its client gone) leaves the step's shared future as it is."""
        self.interval = interval
        target = self.done + max(steps, 1)
        future = self._wakes.get(target)
        if future is None:
            future = self._wakes[target] = asyncio.get_running_loop().create_future()
        self._run()
        await asyncio.shield(future)

    @contextmanager
    def running(self, seqs: int) -> Iterator[None]:
        """``seqs`` sequences decode (each takes a token of every step's budget) while inside."""
        self.decoding += seqs
        try:
            yield
        finally:
            self.decoding -= seqs

    async def prefill(self, tokens: int, interval: float) -> None:
        """Until ``tokens`` prompt tokens are computed, in chunks of the steps' spare budget."""
        if tokens <= 0:
            return
        self.interval = interval
        entry = _Prompt(tokens, asyncio.get_running_loop().create_future())
        self._prompts.append(entry)
        self._run()
        try:
            await asyncio.shield(entry.done)
        finally:
            if entry in self._prompts:  # its client left: its chunks are no longer scheduled
                self._prompts.remove(entry)

    def _run(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while self._wakes or self._prompts:
            number = self.done + 1
            room = max(self.budget - self.decoding, 0)
            work = 0
            for entry in self._prompts:  # first come first served: a prompt's chunk only after earlier ones
                if room <= 0:
                    break
                take = min(entry.left, room)
                entry.left -= take
                room -= take
                work += take
            seconds = work * self.us_per_token / 1e6
            await asyncio.sleep(self.interval + seconds)
            self.done = number
            if work:
                self.prompt_tokens += work
                self.prefill_steps += 1
                self.busy += seconds
            future = self._wakes.pop(number, None)
            if future is not None and not future.done():
                future.set_result(None)
            while self._prompts and self._prompts[0].left == 0:  # computed in full: their first token is next
                done = self._prompts.popleft().done
                if not done.done():
                    done.set_result(None)

    def stats(self) -> dict:
        return {
            "budget": self.budget,
            "steps": self.done,
            "prefill_steps": self.prefill_steps,
            "prompt_tokens": self.prompt_tokens,
            "prefill_seconds": round(self.busy, 6),
            "waiting_prompts": len(self._prompts),
        }
