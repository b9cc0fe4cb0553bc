"""A producer that goes quiet mid-stream: noticed by the filter, before Envoy's idle timeout cuts it.

Once a streamed response has started, Envoy can only cut it; the filter can
still end it properly, but only in reply to a body chunk. So when a streaming
producer request has sent nothing for ``STALL_TIMEOUT`` seconds, the filter
asks the producer to abort it; the producer's final (abort) event, or the end
of its body, is the chunk the filter answers with an error event and
``[DONE]``. A producer too wedged to answer the abort is left to Envoy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("derender.stall")

# Seconds a streaming response may go without a producer event (0: never). ``derender serve
# --stall-timeout`` sets it; keep it below Envoy's stream idle timeout (300 s in envoy/).
STALL_TIMEOUT = 240.0


def message() -> str:
    return f"the producer sent nothing for {STALL_TIMEOUT:g} s; the request was aborted"


class StallWatch:
    """Watches one streaming response; ``on_stall`` runs once if it goes quiet too long."""

    def __init__(self, name: str | None, on_stall: Callable[[], None]) -> None:
        self.name = name
        self.on_stall = on_stall
        self.stalled = False
        self._last = 0.0  # time.monotonic() of the producer's last body chunk
        self._handle: asyncio.TimerHandle | None = None
        self._over = False

    def start(self) -> None:
        """The response started (call from the event loop; without one there is nothing to watch)."""
        if STALL_TIMEOUT <= 0:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._last = time.monotonic()
        self._check()

    def chunk(self) -> bool:
        """A body chunk came from the producer; True if it comes after a stall (the stream is over)."""
        self._last = time.monotonic()
        return self.stalled

    def stop(self) -> None:
        self._over = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        if self._over:
            return
        quiet = time.monotonic() - self._last
        if quiet < STALL_TIMEOUT:
            self._handle = asyncio.get_running_loop().call_later(STALL_TIMEOUT - quiet, self._check)
            return
        log.warning("producer request of %s stalled: no event for %.1f s", self.name, quiet)
        self.stalled = True
        self._over = True
        self.on_stall()
