"""How busy a worker's event loop is: the saturation signal.

One worker is one Python process with one event loop; every ext_proc message
of every stream it holds runs there. Two numbers say how close it is to full:

- ``derender_event_loop_busy_ratio`` (a gauge per worker): the share of the
  last ``WINDOW`` seconds the loop's thread spent on the CPU (its thread CPU
  time over wall time). Near 1, the worker has no time left: more streams only
  wait longer.
- ``derender_event_loop_lag_seconds`` (a histogram, all workers pooled): how
  late a tick scheduled every ``TICK`` seconds runs. It grows when callbacks
  queue up behind each other, or when the process waits for a CPU that others
  hold (which the busy ratio cannot see: the thread is not running then).
"""

from __future__ import annotations

import asyncio

from . import metrics
from .busy import WINDOW, BusyRatio

TICK = 0.1  # seconds between ticks


class LoopWatch:
    """Ticks on the running loop; ``sample`` records one tick's lateness and the busy ratio."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._busy = metrics.loop_busy()
        self._ratio = BusyRatio(window)

    def sample(self, lag: float, wall: float | None = None, cpu: float | None = None) -> float:
        """One tick ``lag`` seconds late; returns the busy ratio over the window so far."""
        metrics.LOOP_LAG.observe(max(lag, 0.0))
        ratio = self._ratio.sample(wall, cpu)
        self._busy.set(ratio)
        return ratio

    async def run(self, tick: float = TICK) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + tick
            await asyncio.sleep(tick)
            self.sample(loop.time() - due)


def start() -> asyncio.Task | None:
    """Watch this process's loop if anyone reads the metrics (call from the loop)."""
    if not metrics.enabled():
        return None
    return asyncio.get_running_loop().create_task(LoopWatch().run(), name="derender-loop-watch")
