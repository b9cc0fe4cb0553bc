"""The prefill/decode handoff (``routing.handoff``, ``--prefill``) as a stage.

admit (after the decode replica is chosen): a prompt of at least ``--pd-min-prompt-tokens`` tokens is
prefilled on a prefill replica first, and the decode request carries that replica's
``kv_transfer_params``; should every prefill replica tried fail, the decode replica prefills itself.
A client that leaves meanwhile cancels the prefill call, and nothing reaches a decode replica. A request
that names its own ``kv_transfer_params`` is left as it is (the client runs its own handoff); one whose
decode replica routing knows to hold most of its prompt's blocks (kv-events, precise) skips the prefill.
"""

from __future__ import annotations

import orjson

from ..exchange import Reply, Rewrite
from ..ops import handoffmetrics
from ..routing.handoff import Handed
from .base import RequestContext, Stage

CACHED_SHARE = 0.5  # a decode replica known to hold this share of the prompt's blocks prefills it itself


class Handoffs(Stage):
    async def admit(self, ctx: RequestContext, rewrite: Rewrite) -> Reply | None:
        handoff = ctx.handoff
        if handoff is None:
            return None
        prompt = rewrite.prompt_ids or []
        route, balancer = ctx.route, ctx.balancer
        cached = route.matched_blocks * balancer.prefix_key.hasher.block_size if route and balancer else 0
        if len(prompt) < handoff.spec.min_prompt_tokens:
            ctx.handed = Handed("short")
        elif cached >= len(prompt) * CACHED_SHARE:  # kv-events / precise: the decode replica holds most of it
            ctx.handed = Handed("cached")
        elif (request := orjson.loads(rewrite.body)).get("kv_transfer_params") is not None:
            ctx.handed = Handed("client")
        else:
            headers = {"content-type": "application/json"}
            if ctx.x_request_id:
                headers["x-request-id"] = ctx.x_request_id
            rewrite.body, handed = await handoff.prefill(rewrite.body, request, prompt, headers)
            ctx.handed = handed
            for replica, _ in handed.tries:
                handoffmetrics.PREFILL_ERRORS.labels(replica).inc()
            handoffmetrics.PREFILL_SECONDS.labels(handed.outcome).observe(handed.took)
        handoffmetrics.HANDOFFS.labels(ctx.handed.outcome).inc()
        return None
