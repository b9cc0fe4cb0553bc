"""Traces (``ops.tracing``, ``--otlp-traces-endpoint``) as a stage: the request's trace begins at its
headers, a child of Envoy's span for the ext_proc stream (its ``traceparent``) or of the client's;
the producer request carries the producer span's context; at the end the spans are built from the
report, the routing decision and the timings."""

from __future__ import annotations

from ..exchange import Reply, Rewrite
from ..ops import tracing
from .base import RequestContext, Stage


class Tracing(Stage):
    def begin(self, ctx: RequestContext) -> None:
        if tracing.enabled():
            ctx.trace = tracing.begin(ctx.headers, ctx.stream_headers)

    async def admit(self, ctx: RequestContext, rewrite: Rewrite) -> Reply | None:
        trace = ctx.trace
        if trace is not None:
            ctx.report.keep_finish_reasons = True  # the client's, for the span
            rewrite.set_headers.update(trace.sent())  # the producer's request continues the trace
        return None

    def end(self, ctx: RequestContext) -> None:
        if ctx.trace is not None:
            turn = ctx.turn
            if turn is not None and turn.since:  # it waited for room (flow control)
                ctx.trace.span_between(
                    "queue",
                    turn.since,
                    turn.since + turn.waited,
                    {
                        "derender.queue.outcome": turn.outcome,
                        "derender.queue.band": turn.band,
                        "derender.queue.key": turn.key,
                    },
                )
            handed = ctx.handed
            if handed is not None and handed.started:  # prefilled on a prefill replica first
                ctx.trace.span_between(
                    "prefill",
                    handed.started,
                    handed.started + handed.took,
                    {"derender.prefill.outcome": handed.outcome, "derender.prefill.replica": handed.replica or ""},
                )
            ctx.trace.end(ctx.report, ctx.route.fields() if ctx.route is not None else None)
