"""What a stage is (``Stage``), what a request carries between stages (``RequestContext``) and the
stages run in their order (``Pipeline``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from ..exchange import Answered, Endpoint, Exchange, Reply, Report, ResponseStart, Rewrite
from ..ops.quota import Account
from ..ops.tracing import RequestTrace
from ..routing.balance import Balancer, Decision
from ..routing.flow import Flow, Turn
from ..routing.handoff import Handed, Handoff

# A stage's work on one body chunk of a request it engaged with: (the request, client bytes) -> client bytes.
ChunkHook = Callable[["RequestContext", bytes], Awaitable[bytes]]


@dataclass(eq=False)
class RequestContext:
    """One request, as the stages see it: set at its headers, filled as it goes."""

    endpoint: Endpoint
    headers: dict[str, str]  # the client's request headers
    stream_headers: dict[str, str] = field(default_factory=dict)  # the ext_proc stream's (Envoy's) own
    exchange: Exchange = field(default_factory=Answered)  # the backend's exchange, once the body named the model
    balancer: Balancer | None = None  # the backend's producer routing (``--routing``), if any
    route: Decision | None = None  # what producer routing decided (``stages.routing``)
    flow: Flow | None = None  # the backend's flow control (``--replica-capacity``), if on
    turn: Turn | None = None  # the request's pass through it (``stages.flow``)
    handoff: Handoff | None = None  # the backend's prefill replicas (``--prefill``), if any
    handed: Handed | None = None  # the request's prefill (``stages.handoff``)
    account: Account | None = None  # the key's budgets (``stages.budget``), if any apply
    trace: RequestTrace | None = None  # the request's trace (``stages.tracing``), when traces are exported
    on_chunk: list[ChunkHook] = field(default_factory=list)  # stages' work on every body chunk
    # Tell Envoy to wait this many seconds more for the filter's answer (ext_proc's
    # override_message_timeout, up to its max_message_timeout); set by the ext_proc server.
    extend: Callable[[float], Awaitable[None]] | None = None

    @property
    def report(self) -> Report:
        return self.exchange.report

    @property
    def x_request_id(self) -> str | None:
        return self.headers.get("x-request-id")


class Stage:
    """One concern around every request; each hook is optional (the base's do nothing)."""

    def begin(self, ctx: RequestContext) -> None:
        """The request's headers are in."""

    async def admit(self, ctx: RequestContext, rewrite: Rewrite) -> Reply | None:
        """The request is rendered for a producer: change ``rewrite``, or refuse it with a ``Reply``."""
        return None

    def started(self, ctx: RequestContext, start: ResponseStart) -> None:
        """The producer's response started (``ctx.report``: its status and replica)."""

    def end(self, ctx: RequestContext) -> None:
        """The exchange is closed: ``ctx.report`` is final."""


def _overrides(stage: Stage, hook: str) -> bool:
    return getattr(type(stage), hook) is not getattr(Stage, hook)


class Pipeline:
    """The stages, in the order they run at each point; a hook a stage leaves alone costs nothing."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = tuple(stages)
        self._begin = [s for s in self.stages if _overrides(s, "begin")]
        self._admit = [s for s in self.stages if _overrides(s, "admit")]
        self._started = [s for s in self.stages if _overrides(s, "started")]
        self._end = [s for s in self.stages if _overrides(s, "end")]

    def begin(self, ctx: RequestContext) -> None:
        for stage in self._begin:
            stage.begin(ctx)

    async def admit(self, ctx: RequestContext, rewrite: Rewrite) -> Reply | None:
        for stage in self._admit:
            refused = await stage.admit(ctx, rewrite)
            if refused is not None:
                return refused
        return None

    def started(self, ctx: RequestContext, start: ResponseStart) -> None:
        for stage in self._started:
            stage.started(ctx, start)

    def end(self, ctx: RequestContext) -> None:
        for stage in self._end:
            stage.end(ctx)
