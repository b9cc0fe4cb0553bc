"""A producer that goes quiet mid-stream: noticed by the filter, before Envoy's idle timeout cuts it.

Once a streamed response has started, Envoy can only cut it; the filter can
still end it properly, but only in reply to a body chunk. So when a streaming
producer request has sent nothing for its stall timeout (``derender serve --stall-timeout``,
kept by the producer client: ``routing.producer.Producer.stall_timeout``), the filter
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


class StallWatch:
    """Watches one streaming response; ``on_stall`` runs once if it goes quiet too long."""

    def __init__(self, name: str | None, on_stall: Callable[[], None], timeout: float) -> None:
        self.name = name
        self.on_stall = on_stall
        self.timeout = timeout  # seconds without a producer event (0: never)
        self.stalled = False
        self._last = 0.0  # time.monotonic() of the producer's last body chunk
        self._handle: asyncio.TimerHandle | None = None
        self._over = False

    def message(self) -> str:
        return f"the producer sent nothing for {self.timeout:g} s; the request was aborted"

    def start(self) -> None:
        """The response started (call from the event loop; without one there is nothing to watch)."""
        if self.timeout <= 0:
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
        if quiet < self.timeout:
            self._handle = asyncio.get_running_loop().call_later(self.timeout - quiet, self._check)
            return
        log.warning("producer request of %s stalled: no event for %.1f s", self.name, quiet)
        self.stalled = True
        self._over = True
        self.on_stall()
