"""Producer routing (``routing.balance``, ``--routing``) as a stage: which replica a rendered request
goes to (admit: the routing headers and Envoy's destination), the replica Envoy reached (started),
and the request counted off its replica with its outcome in the routing metrics (end)."""

from __future__ import annotations

import time

from ..exchange import Reply, ResponseStart, Rewrite
from ..ops import metrics
from .base import RequestContext, Stage


class Routing(Stage):
    async def admit(self, ctx: RequestContext, rewrite: Rewrite) -> Reply | None:
        balancer = ctx.balancer
        if balancer is not None:
            began = time.thread_time()
            headers, decision = balancer.route(rewrite.prompt_ids, rewrite.cache_salt, rewrite.lora, rewrite.media)
            decision.cpu_us = (time.thread_time() - began) * 1e6
            rewrite.set_headers.update(headers)
            rewrite.destination = decision.chosen
            ctx.route = decision
        return None

    def started(self, ctx: RequestContext, start: ResponseStart) -> None:
        if ctx.balancer is not None and ctx.route is not None:
            report = ctx.report
            ctx.balancer.started(ctx.route, report.upstream, report.status)

    def end(self, ctx: RequestContext) -> None:
        decision = ctx.route
        if ctx.balancer is not None and decision is not None:
            ctx.balancer.finished(decision)
            size = ctx.balancer.prefix_key.hasher.block_size
            predicted = decision.matched_blocks * size if decision.chosen == decision.served else 0
            metrics.routed(
                decision.mode,
                decision.why or "key",
                decision.served,
                decision.prompt_tokens,
                ctx.report.cached_tokens,
                min(predicted, decision.prompt_tokens),
            )
