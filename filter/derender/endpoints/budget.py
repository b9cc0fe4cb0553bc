"""What a key's token budget (``ops.quota``) does to a streamed answer: past the completion tokens its
reservation covers, the producer's next event waits (``held``) while ``router.ModelExchange`` asks
the budget for more; then the stream goes on (``resume``) or ends there (``cut``), as a ``max_tokens``
cut ends it, with the producer's request aborted. ``ChatExchange`` (and so every API built on it)
has these; its event loop (``_events``, or ``_collected`` for an answer not streamed) holds the events."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..translate.collect import Collected
from ..translate.sse import SSEError
from ..translate.stream import ChatStream


class Budgeted:
    """A ``ChatExchange``'s part of a key's budget."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The completion tokens the stream may reach before the events after them are held for the
        # budget to decide (None: no limit), and those events.
        self.token_limit: int | None = None
        self.held: tuple[list[bytes], SSEError | None, bool] | None = None

    if TYPE_CHECKING:  # what the ChatExchange it is part of has
        stream: Any

        @property
        def prompt_tokens(self) -> int: ...

        def _events(self, stream: ChatStream, payloads: list[bytes], bad: SSEError | None, end: bool) -> bytes: ...

        def _out(self, stream: ChatStream, out: list[bytes]) -> bytes: ...

        def _abort(self, why: str) -> None: ...

        async def _collected(self, collected: Collected, payloads: Callable[[], list[bytes]], end: bool) -> bytes: ...

    async def resume(self) -> bytes:
        """The events ``held`` at the token limit, now that it is higher."""
        stream, held = self.stream, self.held
        self.held = None
        if held is None:
            return b""
        if isinstance(stream, Collected):
            return await self._collected(stream, lambda: held[0], held[2])
        if not isinstance(stream, ChatStream):
            return b""
        return self._events(stream, *held)

    async def cut(self) -> bytes:
        """End the answer at the tokens generated so far, as the engine ends one at ``max_tokens``:
        every unfinished choice finishes with ``length`` (Messages: ``max_tokens``; Responses:
        incomplete), then usage and the end, all through the stream as the producer's own events
        would go (a non-streaming answer: the one JSON answer of those tokens); the producer's
        request is aborted. (A key's budget ran out: ``ops.quota``.)"""
        stream = self.stream
        if isinstance(stream, Collected) and not stream.finished:
            held, self.held = self.held, None
            stream.cut()
            self._abort("quota")
            return await self._collected(stream, list, True if held is None else held[2])
        if not isinstance(stream, ChatStream) or stream.finished:
            return b""
        rid = stream.producer_request_id
        events: list[dict[str, Any]] = [
            {
                "request_id": rid,
                "usage": None,
                "choices": [{"index": i, "finish_reason": "length", "stop_reason": None, "token_ids": []}],
            }
            for i, done in enumerate(stream.outputs.finished)
            if not done
        ]
        tokens = stream.completion_tokens
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": tokens,
            "total_tokens": self.prompt_tokens + tokens,
        }
        events.append({"request_id": rid, "usage": usage, "choices": []})
        self.held = None  # what the producer sent past the budget is dropped
        out = [stream.feed(json.dumps(e).encode())[0] for e in events]
        out.append(stream.feed(b"[DONE]")[0])
        self._abort("quota")
        return self._out(stream, out)
