"""A thread's busy ratio: the share of the last ``WINDOW`` seconds it was on a CPU.

Read by ``ops.loopwatch`` (the saturation metric) and ``extproc.scale`` (when to add a worker).
Imports nothing of the filter's: ``extproc.scale`` is imported while the command line is parsed,
before ``derender serve`` sets up pooled metrics, which ``ops.metrics`` reads at import.
"""

from __future__ import annotations

import collections
import time

WINDOW = 10.0  # seconds the busy ratio covers


class BusyRatio:
    """The share of the last ``window`` seconds a thread was on a CPU, from samples of its CPU time."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self._history: collections.deque[tuple[float, float]] = collections.deque()  # (wall, thread CPU)

    def sample(self, wall: float | None = None, cpu: float | None = None) -> float:
        """The ratio from the first sample still in the window to this one (0.0 on the first)."""
        wall = time.monotonic() if wall is None else wall
        cpu = time.thread_time() if cpu is None else cpu
        history = self._history
        history.append((wall, cpu))
        while len(history) > 2 and wall - history[1][0] >= self.window:
            history.popleft()
        first_wall, first_cpu = history[0]
        return min(1.0, (cpu - first_cpu) / (wall - first_wall)) if wall > first_wall else 0.0
