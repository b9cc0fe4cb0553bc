"""One Responses request's session: vLLM's ``create_responses`` running as a task, fed the producer's
outputs through an engine stand-in (see ``responses``).

A streaming request's event generator (what ``create_responses`` returns) is then driven by hand,
as the chat stream drives vLLM's chat generator: each ``settle`` runs it until it waits for the
next output (``WAIT``), with no task, event or wake-up per producer event. Should it await anything
else (a store, a lock held elsewhere), a task finishes that step as asyncio would and ``settle``
waits for it; then driving by hand goes on."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

from ...translate.errors import HTTPError, from_exception, responses_error_event
from ...translate.model import _EngineStandIn
from ...translate.stream import WAIT, advance, close_chain
from .lean import Frame, LoopBody, event_frame

log = logging.getLogger("derender.responses")

ONE_GENERATION = (
    "This request needs more than one generation (a built-in tool call inside the request), "
    "which the filter does not serve: send function tools and run them in the client."
)  # vLLM asks for a second generation only with a tool server, which the filter does not have


class Session:
    """One Responses request: vLLM's ``create_responses`` as a task, fed the producer's outputs."""

    def __init__(self, request: Any, lean: bool = True) -> None:
        self.request = request
        self.lean = lean  # the lean path (``lean``) takes the middle outputs of a stream
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
        self._waiting = asyncio.Event()  # vLLM's generator waits for the next output (non-streaming)
        self.events: Any = None  # a streaming request's event generator, driven by hand (``settle``)
        self._step: Any = None  # its step suspended at WAIT
        self._over = False  # it has ended (or failed)
        self._sequence = -1  # of the last event sent
        self._pending: asyncio.Task | None = None  # a step that awaited something real, finished by a task
        self._resuming: _Resume | None = None  # that step
        self._loop: LoopBody | None = None  # the lean path: vLLM's per-output loop body, run here
        self._throw: BaseException | None = None  # raised by that body: into the suspended step
        self.lean_events = 0  # outputs the lean path took (tests read it)
        self.direct_events = 0  # of those, outputs handed in directly (``direct``)

    # -- the engine side -----------------------------------------------------------
    def generate(self, engine_input: Any, params: Any, kwargs: dict[str, Any]) -> Any:
        if self.called.is_set():
            raise HTTPError(400, ONE_GENERATION, param="tools")
        self.engine_input, self.params, self.engine_kwargs = engine_input, params, kwargs
        self.called.set()
        return self._outputs()

    def lend(self, body: LoopBody) -> None:
        """The filter's copy of vLLM's simple streaming loop lends its objects (``lean_serving_class``):
        the lean path runs its body for the outputs that finish nothing."""
        if self.request.stream and self.lean:
            self._loop = body

    async def _outputs(self):
        while True:
            while self._items:
                yield self._items.popleft()
            if self._failure is not None:
                raise self._failure
            if self._ended:
                return
            if self.events is not None:  # driven by hand: suspend the driver (``settle``)
                await WAIT
                continue
            self._wake.clear()
            self._waiting.set()
            await self._wake.wait()

    # -- the filter side -----------------------------------------------------------
    def start(self, serving: Any) -> None:
        self.task = asyncio.ensure_future(self._run(serving))

    async def _run(self, serving: Any) -> None:
        try:
            result = await serving.create_responses(self.request)
            if hasattr(result, "__aiter__"):
                # Its first events, then the engine call (``generate``), then the wait for the
                # first output; later events come out of ``settle``.
                self.events = result
                self._drive()
                while self._pending is not None:
                    await asyncio.wait({self._pending})
            else:
                self.result = result
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._failed(exc)
        finally:
            _STAND_IN_SESSIONS.pop(self.request.request_id, None)

    def _failed(self, exc: BaseException) -> None:
        self.error = exc
        if self.request.stream:
            # vLLM 0.33.0 meets an engine failure mid-stream by validating a chat-shaped
            # error as a Responses event, which fails: its own server then cuts the stream
            # with no event at all. The client gets the Responses error event instead; so
            # too for any other failure (the store unreachable when the answer is stored).
            if self._failure is None:
                log.warning("Responses stream %s failed: %r", self.request.request_id, exc)
            self.frames.append(_error_event(self._failure or exc, self._sequence + 1))

    def _event(self, event: Any) -> None:
        self._sequence = getattr(event, "sequence_number", self._sequence)
        if isinstance(event, Frame):
            self.frames.append(event.frame)
            return
        self.frames.append(event_frame(event))

    def _drive(self) -> None:
        """Run the event generator until it waits for the next output, ends, or awaits something
        real (a task then finishes that step: ``_finish``)."""
        if self._loop is not None and self._step is not None and self._throw is None:
            self._lean()
            if not (self._items or self._ended or self._failure is not None or self._throw is not None):
                return  # the generator would only wait again
        step, self._step = self._step, None
        throw, self._throw = self._throw, None
        step, awaited, error = advance(self.events, step, self._event, throw)
        if error is not None:  # vLLM's generator failed: its error event
            self._over = True
            self._failed(error)
        elif step is None:
            self._over = True
        elif awaited is WAIT:
            self._step = step
        else:
            self._resuming = _Resume(step, awaited)
            self._pending = asyncio.ensure_future(self._finish(self._resuming))

    def _lean(self) -> None:
        """The queued outputs that do not finish the choice, through vLLM's loop body (``LoopBody``)
        here, not through its generator chain; what that body raises goes into the suspended step."""
        items = self._items
        while items and items[0].outputs and items[0].outputs[0].finish_reason is None:
            if not self._take(items.popleft()):
                return

    def _take(self, res: Any) -> bool:
        """One output through the lean loop body; False if the body raised (kept for the step)."""
        try:
            self._loop.step(res, self._event)  # type: ignore[union-attr]
        except Exception as exc:
            self._throw = exc
            return False
        self.lean_events += 1
        return True

    def takes_direct(self) -> bool:
        """An output that finishes nothing may go into the lean loop body at once (``direct``):
        vLLM's generator waits for the next output, none is queued, nothing has failed or ended."""
        return (
            self._loop is not None
            and self._step is not None
            and self._throw is None
            and not self._items
            and not self._ended
            and self._failure is None
            and self._pending is None
            and not self._over
        )

    def direct(self, res: Any) -> None:
        """``res`` (finishing nothing; ``takes_direct``) through the lean loop body now, as ``_lean``
        would take it from the queue at the next ``settle``, with no queue, no wake-up."""
        if self._take(res):
            self.direct_events += 1

    async def _finish(self, resume: _Resume) -> None:
        """A step that awaited something other than the next output, finished as a task would."""
        try:
            value = await resume
        except StopAsyncIteration:
            self._over = True
            return
        except asyncio.CancelledError:
            self._over = True
            raise
        except BaseException as exc:
            self._over = True
            self._failed(exc)
            return
        finally:
            self._pending = self._resuming = None
        if value is _Resume.SUSPENDED:  # it went on to wait for the next output
            self._step = resume.step
            return
        self._event(value)
        self._drive()

    @property
    def done(self) -> bool:
        """vLLM's task has ended: its answer is in, or (streaming) its last event was written."""
        if self.task is None or not self.task.done():
            return False
        return self.events is None or self._over

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
        """Until vLLM's generator waits for the next output, or has ended."""
        if self.task is None:
            return
        if not self.task.done():  # create_responses: a streaming request's returns the event generator
            waiting = asyncio.ensure_future(self._waiting.wait())
            try:
                await asyncio.wait({waiting, self.task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()
            if not self.task.done():
                return
        while self.events is not None and not self._over:
            if self._pending is not None:
                await asyncio.wait({self._pending})
                continue
            self._drive()
            if self._pending is None:
                return

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
        if self.events is not None and not self._over:
            self._over = True
            step, self._step = self._step, None
            if self._pending is not None:  # it may not have started: the step is shut here, not by it
                self._pending.cancel()
                step, self._resuming.closed = self._resuming.step, True  # type: ignore[union-attr]
                self._pending = self._resuming = None
            close_chain(step, self.events)
        _STAND_IN_SESSIONS.pop(self.request.request_id, None)


class _Resume:
    """Awaiting this hands a suspended step of the event generator to the awaiting task: what the
    step awaits the task awaits, what is thrown into the task goes into the step. It gives what the
    step yields, or ``SUSPENDED`` once the step waits for the next output (``WAIT``)."""

    SUSPENDED = object()

    def __init__(self, step: Any, awaited: Any) -> None:
        self.step, self.awaited = step, awaited
        self.closed = False  # the session shut the step (cancelled): never touch it again

    def __await__(self):
        step, awaited = self.step, self.awaited
        while True:
            try:
                try:
                    sent = yield awaited
                except BaseException as exc:
                    if self.closed:
                        raise
                    awaited = step.throw(exc)
                else:
                    if self.closed:
                        raise asyncio.CancelledError
                    awaited = step.send(sent)
            except StopIteration as got:
                return got.value
            if awaited is WAIT:
                return self.SUSPENDED


def _error_event(failure: BaseException, sequence: int) -> bytes:
    """The Responses API's ``error`` event for a failure (its status as the code)."""
    error = failure if isinstance(failure, HTTPError) else from_exception(failure)  # type: ignore[arg-type]
    if getattr(failure, "status_code", None):
        error.status = int(failure.status_code)  # type: ignore[attr-defined]
    return responses_error_event(error, sequence)


# The sessions of this process, by Responses request id (the engine request id is that plus "_N").
_STAND_IN_SESSIONS: dict[str, Session] = {}


def lend_loop(request_id: str, body: LoopBody) -> None:
    """``lean_serving_class``'s loop lends its objects to the session of ``request_id``."""
    session = _STAND_IN_SESSIONS.get(request_id)
    if session is not None:
        session.lend(body)


class _ProducerEngine(_EngineStandIn):
    """What ``OpenAIServingResponses`` reads of an engine: ``generate`` hands out a session's outputs."""

    def generate(self, engine_input: Any, params: Any, request_id: str, **kwargs: Any) -> Any:
        session = _STAND_IN_SESSIONS.get(request_id.rsplit("_", 1)[0])
        if session is None:
            raise RuntimeError(f"no session for engine request {request_id}")
        return session.generate(engine_input, params, kwargs)
