"""vLLM's scheduler as the simulator models it: at most ``max_num_seqs`` sequences run at once, the rest
wait in arrival order (vLLM's default first-come-first-served policy), and ``/metrics`` serves vLLM's
gauges for them: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (the prefix cache's blocks in use, of its capacity)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class Scheduler:
    def __init__(self, max_num_seqs: int = 0) -> None:
        self.max_num_seqs = max_num_seqs  # 0: no limit
        self.running = 0  # sequences (a request of n choices is n)
        self.waiting: deque[tuple[int, asyncio.Future]] = deque()
        self.waited_ever = 0  # requests that waited for room, ever
        self.started = 0  # requests given room, ever (their order is the order they run in)
        self.peak = 0  # the most sequences ever running at once

    @asynccontextmanager
    async def slot(self, seqs: int) -> AsyncIterator[None]:
        """Room for ``seqs`` sequences, once every request ahead of this one has its room."""
        limit = self.max_num_seqs
        seqs = min(seqs, limit) if limit else seqs
        if limit and (self.waiting or self.running + seqs > limit):
            waiter = asyncio.get_running_loop().create_future()
            entry = (seqs, waiter)
            self.waiting.append(entry)
            self.waited_ever += 1
            try:
                await waiter
            except asyncio.CancelledError:  # its client left while it waited
                if entry in self.waiting:
                    self.waiting.remove(entry)
                elif waiter.done() and not waiter.cancelled():
                    self.running -= seqs  # it had been given room: give it back
                    self._admit()
                raise
        else:
            self._run(seqs)
        try:
            yield
        finally:
            self.running -= seqs
            self._admit()

    def _admit(self) -> None:
        while self.waiting and self.running + self.waiting[0][0] <= self.max_num_seqs:
            seqs, waiter = self.waiting.popleft()
            if waiter.done():
                continue
            self._run(seqs)
            waiter.set_result(None)

    def _run(self, seqs: int) -> None:
        self.running += seqs
        self.started += 1
        self.peak = max(self.peak, self.running)

    def stats(self) -> dict[str, int]:
        return {
            "running": self.running,
            "waiting": len(self.waiting),
            "started": self.started,
            "peak": self.peak,
            "waited": self.waited_ever,
        }

    def metrics(self, model: str, cache_usage: Callable[[], float]) -> str:
        """vLLM's Prometheus text for the scheduler's gauges (its names, help and labels)."""
        labels = f'engine="0",model_name="{model}"'
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", self.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(self.waiting)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", cache_usage()),
        )
        lines = []
        for name, text, value in gauges:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {float(value)}"]
        return "\n".join(lines) + "\n"
