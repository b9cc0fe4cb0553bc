"""A key's token budgets (``ops.quota``, ``--quota-config``) as a stage.

begin: the request's key names its account, if limits apply to it. admit: the prompt and the
completion tokens the request may use are reserved, else it is refused (429 in the client's shape,
503 when the quota store is down and the file says closed); a streamed answer is held past what
the reservation covers (``Exchange.limit``). On every chunk: while the answer is held, more is
reserved in batches (``resume``) or the budget ends it there, as ``max_tokens`` would (``cut``).
started: the budget's headers. end: the reservation is settled to what was used.
"""

from __future__ import annotations

import asyncio

from ..exchange import Reply, ResponseStart, Rewrite
from ..ops import metrics, quota
from ..translate.errors import HTTPError
from .base import RequestContext, Stage

_SETTLING: set[asyncio.Task] = set()  # settlements under way (a reference keeps each alive)


class Budgets(Stage):
    def __init__(self, quotas: quota.Quotas | None = None) -> None:
        self.quotas = quotas  # None: no limits (a SIGHUP may set them: ``endpoints.router.Router.reload_quotas``)

    def begin(self, ctx: RequestContext) -> None:
        if self.quotas is not None:
            ctx.account = quota.Account.of(self.quotas, ctx.headers)

    async def admit(self, ctx: RequestContext, rewrite: Rewrite) -> Reply | None:
        """Reserve the request's prompt and completion tokens on its key's budgets; the 429 (or the
        503 when the quota store is down and the file says closed) that refuses it, or None."""
        account = ctx.account
        if account is None:
            return None
        report, anthropic = ctx.report, ctx.endpoint.anthropic
        asked = report.asked
        config = account.quotas.config
        most = asked.max_tokens
        completion = (
            most if most is not None and asked.named_max else min(most or config.reservation, config.reservation)
        )
        cap = config.max_reservation
        completion = asked.n * (min(completion, cap) if cap else completion)
        try:
            decision = await account.reserve(asked.model, len(rewrite.prompt_ids or ()), completion)
        except quota.QuotaUnavailable as exc:
            ctx.account = None
            return Reply.error(ctx.endpoint.error(HTTPError(503, str(exc))))
        if decision is None:
            if account.active and ctx.exchange.limit(account.covered, rewrite, completion < asked.n * (most or 0)):
                ctx.on_chunk.append(self.chunk)
            return None
        ctx.account = None  # nothing reserved: nothing to settle
        report.client_status = 429  # the request log's status
        error = HTTPError(
            429, quota.refusal_message(decision), "rate_limit_error" if anthropic else "rate_limit_exceeded"
        )
        return Reply.error(ctx.endpoint.error(error), quota.headers(decision, anthropic))

    @staticmethod
    async def chunk(ctx: RequestContext, out: bytes) -> bytes:
        """The stream reached the tokens its reservation covers: more if the budget has them, else
        the budget ends it here, as ``max_tokens`` would have."""
        exchange, account = ctx.exchange, ctx.account
        while account is not None and exchange.held:
            if await account.extend(exchange.generated + 1):
                out += await exchange.resume(account.covered)
            else:
                metrics.QUOTA_CUTS.labels(account.ident).inc()
                out += await exchange.cut()
        return out

    def started(self, ctx: RequestContext, start: ResponseStart) -> None:
        if ctx.account is not None:
            start.set_headers.update(quota.headers(ctx.account.decision, ctx.endpoint.anthropic))

    def end(self, ctx: RequestContext) -> None:
        account = ctx.account
        if account is not None and account.active:
            task = asyncio.get_running_loop().create_task(account.settle(ctx.report.completion_tokens or 0))
            _SETTLING.add(task)
            task.add_done_callback(_SETTLING.discard)
