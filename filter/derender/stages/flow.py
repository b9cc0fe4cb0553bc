"""Flow control (``routing.flow``, ``--replica-capacity``) as a stage.

admit (after the budgets, before the replica is chosen): a request that finds room at its backend's
producers goes on, counted in flight; otherwise it waits in the backend's queue, in its priority band
and fairly across API keys (the token-budget file's ``priority`` and ``weight`` for its key; a key the
file does not list, or any key without a file, has band 0 and weight 1; the request's own ``priority``,
vLLM's field, may only lower it). A full queue answers 429 at once; a request that waited
``--queue-timeout`` gets 429 with ``Retry-After`` (503 when no replica is up); one whose client leaves
while it waits is dropped, and nothing reaches a producer. end: the request leaves the count, and the
next waiters with room go on.
"""

from __future__ import annotations

import asyncio
import time

import orjson

from ..exchange import Reply, Rewrite
from ..ops import flowmetrics
from ..ops.quota import Quotas, api_key, digest
from ..ops.quota.config import Key
from ..routing.flow import Flow, Turn, Waiter
from ..translate.errors import HTTPError
from .base import RequestContext, Stage
from .budget import Budgets

ANONYMOUS = "anonymous"
LOWER_BANDS = 16  # how far below its key's band a request may put itself (bands stay few: the metrics' labels)
EXTEND_MARGIN = 10.0  # seconds Envoy is asked to wait past the queue's timeout (the answer after it)


class FlowControl(Stage):
    def __init__(self, budgets: Budgets) -> None:
        self.budgets = budgets  # the token-budget file's keys: their priority and weight

    async def admit(self, ctx: RequestContext, rewrite: Rewrite) -> Reply | None:
        flow = ctx.flow
        if flow is None:
            return None
        found = self._key(ctx)
        key = found[0]
        if not flow.queue.count and flow.room(key):  # room: no cost but the count
            flow.sent(key)
            ctx.turn = Turn("sent", sent=True, flow_key=key)
            flowmetrics.OUTCOMES.labels("sent").inc()
            return None
        label, band, weight = self._place(found, rewrite)
        cost = len(rewrite.body)
        if not flow.queue.fits(key, cost):
            ctx.turn = Turn("refused", band, label)
            flowmetrics.OUTCOMES.labels("refused").inc()
            return self._refuse(ctx, flow, "the queue for this model's producers is full")
        waiter = Waiter(key, band, weight, cost)
        turn = ctx.turn = Turn("waiting", band, label, waiter.since, flow_key=key)
        flow.queue.push(waiter)
        gauge = flowmetrics.QUEUED.labels(str(band), label)
        gauge.inc()
        try:
            flow.release()  # room may have come meanwhile
            if not waiter.future.done():
                if ctx.extend is not None:  # Envoy waits for the filter's answer past its message_timeout
                    await ctx.extend(flow.spec.timeout + EXTEND_MARGIN)
                await asyncio.wait((waiter.future,), timeout=flow.spec.timeout)
        except asyncio.CancelledError:  # the client left while it waited
            if not flow.queue.remove(waiter) and waiter.future.done():
                self._ended(flow, key)  # it had been given room: give it back
            self._close(turn, "left")
            raise
        finally:
            gauge.dec()
        if waiter.future.done():
            turn.sent = True
            self._close(turn, "dispatched")
            return None
        flow.queue.remove(waiter)
        self._close(turn, "expired")
        return self._refuse(ctx, flow, f"no room at this model's producers within {flow.spec.timeout:g} seconds")

    @staticmethod
    def _close(turn: Turn, outcome: str) -> None:
        turn.outcome = outcome
        turn.waited = time.monotonic() - turn.since
        flowmetrics.OUTCOMES.labels(outcome).inc()
        flowmetrics.WAITED.labels(outcome).observe(turn.waited)

    @staticmethod
    def _refuse(ctx: RequestContext, flow: Flow, why: str) -> Reply:
        anthropic = ctx.endpoint.anthropic
        if not flow.up():
            ctx.report.client_status = 503
            error = HTTPError(503, "no producer replica is up: " + why, "overloaded_error" if anthropic else None)
            return Reply.error(ctx.endpoint.error(error))
        ctx.report.client_status = 429
        error = HTTPError(429, why + "; retry later", "rate_limit_error" if anthropic else "rate_limit_exceeded")
        return Reply.error(ctx.endpoint.error(error), {"retry-after": str(flow.retry_after())})

    def _key(self, ctx: RequestContext) -> tuple[str, Key | None, bool]:
        """(the request's key as flow control counts it, its entry in the budget file if any, whether the
        file lists it by name)."""
        quotas: Quotas | None = self.budgets.quotas
        found = quotas.key_for(ctx.headers) if quotas is not None else None
        if found is not None:
            assert quotas is not None
            return found[0], found[1], found[1] is not quotas.config.default
        secret = api_key(ctx.headers)  # the key the budgets would count it under, by the same reading
        return (digest(secret)[:16] if secret else ANONYMOUS), None, False

    @staticmethod
    def _place(found: tuple[str, Key | None, bool], rewrite: Rewrite) -> tuple[str, int, float]:
        """(its metrics label, its band, its weight) for a request that must wait."""
        key, entry, listed = found
        if entry is not None:
            label, band, weight = entry.name if listed else "default", entry.priority, entry.weight
        else:
            label, band, weight = "default" if key != ANONYMOUS else ANONYMOUS, 0, 1.0
        try:
            asked = orjson.loads(rewrite.body).get("priority")
        except (orjson.JSONDecodeError, AttributeError):
            asked = None
        if isinstance(asked, int) and not isinstance(asked, bool) and asked > band:
            band = min(asked, band + LOWER_BANDS)  # a client may lower its own requests, not raise them past its key
        return label, band, weight

    @staticmethod
    def _ended(flow: Flow, key: str) -> None:
        flow.ended(key)
        flow.release()
        if flow.signal is None:  # else at each of its reads
            flow.report()

    def end(self, ctx: RequestContext) -> None:
        turn, flow = ctx.turn, ctx.flow
        if turn is not None and turn.sent and flow is not None:
            turn.sent = False
            self._ended(flow, turn.flow_key)
