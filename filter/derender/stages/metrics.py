"""The request metrics (``ops.metrics``: requests, tokens, durations, time to first token, by
operation, model and outcome) as a stage: one count per request that reached a producer."""

from __future__ import annotations

import time

from ..ops import metrics
from .base import RequestContext, Stage


class Metrics(Stage):
    def end(self, ctx: RequestContext) -> None:
        report = ctx.report
        if not report.name or report.prompt_tokens is None:  # answered at once, or never reached a producer
            return
        metrics.chat_done(
            report.operation,
            report.model or "",
            prompt_tokens=report.prompt_tokens,
            completion_tokens=report.completion_tokens,
            duration=time.monotonic() - report.started,
            time_to_first_token=report.first_token - report.started if report.first_token is not None else None,
            error_type=report.outcome or "",
        )
