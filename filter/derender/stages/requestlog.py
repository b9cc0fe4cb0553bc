"""The request log as a stage: one line per request an exchange served (``ops.logs`` writes it as
JSON or text), its fields from the exchange's report, the routing decision and the trace ids."""

from __future__ import annotations

import logging
import time

from .base import RequestContext, Stage


def ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 1) if seconds is not None else None


class RequestLog(Stage):
    def end(self, ctx: RequestContext) -> None:
        report = ctx.report
        if not report.name:  # answered at once (/tokenize, count_tokens, ...): no line
            return
        fields: dict[str, object] = {
            "request_id": report.request_id,
            "x_request_id": report.x_request_id,
            "model": report.model,
        }
        ids = ctx.trace.ids if ctx.trace is not None else None
        if ids is not None:
            fields["trace_id"], fields["span_id"] = ids
        ttft = report.first_token - report.started if report.first_token is not None else None
        fields.update(
            status=report.client_status,
            stream=report.asked.stream,
            prompt_tokens=report.prompt_tokens,
            completion_tokens=report.completion_tokens,
            complete=report.complete,
            error=report.outcome,
            duration_ms=ms(time.monotonic() - report.started),
            ttft_ms=ms(ttft),
            body_ms=ms(report.body_at),
            render_ms=ms(report.render_time),
            producer_headers_ms=ms(report.headers_at),
        )
        if ctx.route is not None:
            fields.update(ctx.route.fields())
        handed = ctx.handed
        if handed is not None:  # the prefill/decode handoff
            fields.update(prefill=handed.outcome, prefill_ms=ms(handed.took) if handed.started else None)
        turn = ctx.turn
        if turn is not None and turn.since:  # it waited for room (flow control)
            fields.update(queued_ms=ms(turn.waited), queue=turn.outcome, band=turn.band, queue_key=turn.key)
        fields.update(report.fields)
        logging.getLogger(report.logger).info(report.name, extra={"fields": fields})
