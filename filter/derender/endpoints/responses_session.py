"""One Responses request's session: vLLM's ``create_responses`` running as a task, fed the producer's
outputs through an engine stand-in (see ``responses``)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from typing import Any

from ..translate.errors import HTTPError, from_exception
from ..translate.model import _EngineStandIn

log = logging.getLogger("derender.responses")

ONE_GENERATION = (
    "This request needs more than one generation (a built-in tool call inside the request), "
    "which the filter does not serve: send function tools and run them in the client."
)  # vLLM asks for a second generation only with a tool server, which the filter does not have


class Session:
    """One Responses request: vLLM's ``create_responses`` as a task, fed the producer's outputs."""

    def __init__(self, request: Any) -> None:
        self.request = request
        self.frames: list[bytes] = []
        self.result: Any = None  # create_responses' return value (a response, an error, or a stream)
        self.error: BaseException | None = None
        self.engine_input: Any = None
        self.params: Any = None
        self.engine_kwargs: dict[str, Any] = {}
        self.called = asyncio.Event()  # vLLM asked the engine to generate
        self.task: asyncio.Task | None = None
        self._items: deque[Any] = deque()
        self._ended = False
        self._failure: BaseException | None = None
        self._wake = asyncio.Event()
        self._waiting = asyncio.Event()  # vLLM's generator waits for the next output

    # -- the engine side -----------------------------------------------------------
    def generate(self, engine_input: Any, params: Any, kwargs: dict[str, Any]) -> Any:
        if self.called.is_set():
            raise HTTPError(400, ONE_GENERATION, param="tools")
        self.engine_input, self.params, self.engine_kwargs = engine_input, params, kwargs
        self.called.set()
        return self._outputs()

    async def _outputs(self):
        while True:
            while self._items:
                yield self._items.popleft()
            if self._failure is not None:
                raise self._failure
            if self._ended:
                return
            self._wake.clear()
            self._waiting.set()
            await self._wake.wait()

    # -- the filter side -----------------------------------------------------------
    def start(self, serving: Any) -> None:
        self.task = asyncio.ensure_future(self._run(serving))

    async def _run(self, serving: Any) -> None:
        sequence = -1  # of the last event sent
        try:
            result = await serving.create_responses(self.request)
            if hasattr(result, "__aiter__"):
                async for event in result:
                    sequence = getattr(event, "sequence_number", sequence)
                    self.frames.append(
                        f"event: {getattr(event, 'type', 'unknown')}\ndata: "
                        f"{event.model_dump_json(indent=None, by_alias=True)}\n\n".encode()
                    )
            else:
                self.result = result
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the answer
            self.error = exc
            if self.request.stream:
                # vLLM 0.33.0 meets an engine failure mid-stream by validating a chat-shaped
                # error as a Responses event, which fails: its own server then cuts the stream
                # with no event at all. The client gets the Responses error event instead; so
                # too for any other failure (the store unreachable when the answer is stored).
                if self._failure is None:
                    log.warning("Responses stream %s failed: %r", self.request.request_id, exc)
                self.frames.append(_error_event(self._failure or exc, sequence + 1))
        finally:
            _STAND_IN_SESSIONS.pop(self.request.request_id, None)

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()

    def push(self, outputs: list[Any]) -> None:
        if outputs:
            self._items.extend(outputs)
            self._resume()

    def end(self) -> None:
        self._ended = True
        self._resume()

    def fail(self, exc: BaseException) -> None:
        self._failure = exc
        self._resume()

    def _resume(self) -> None:
        self._waiting.clear()
        self._wake.set()

    async def settle(self) -> None:
        """Until vLLM's task waits for the next output, or has ended."""
        if self.task is None or self.task.done():
            return
        waiting = asyncio.ensure_future(self._waiting.wait())
        try:
            await asyncio.wait({waiting, self.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()

    async def until_called(self) -> None:
        """Until vLLM asks the engine for outputs, or answers without (an error)."""
        assert self.task is not None
        called = asyncio.ensure_future(self.called.wait())
        try:
            await asyncio.wait({called, self.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            called.cancel()

    def take_frames(self) -> bytes:
        frames, self.frames = self.frames, []
        return b"".join(frames)

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
        _STAND_IN_SESSIONS.pop(self.request.request_id, None)


def _error_event(failure: BaseException, sequence: int) -> bytes:
    """The Responses API's ``error`` event for a failure (its status as the code)."""
    error = failure if isinstance(failure, HTTPError) else from_exception(failure)  # type: ignore[arg-type]
    if getattr(failure, "status_code", None):
        error.status = int(failure.status_code)  # type: ignore[attr-defined]
    data = {"type": "error", "code": str(error.status), "message": error.message, "param": error.param,
            "sequence_number": sequence}
    return f"event: error\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


# The sessions of this process, by Responses request id (the engine request id is that plus "_N").
_STAND_IN_SESSIONS: dict[str, Session] = {}


class _ProducerEngine(_EngineStandIn):
    """What ``OpenAIServingResponses`` reads of an engine: ``generate`` hands out a session's outputs."""

    def generate(self, engine_input: Any, params: Any, request_id: str, **kwargs: Any) -> Any:
        session = _STAND_IN_SESSIONS.get(request_id.rsplit("_", 1)[0])
        if session is None:
            raise RuntimeError(f"no session for engine request {request_id}")
        return session.generate(engine_input, params, kwargs)
