"""The stages around every request: routing, budgets, traces, metrics and the request log.

A stage is one concern, in one module of this folder, that works on what a request carries
(``RequestContext``: the client's headers, the exchange and its typed ``Report``, and each stage's
own value: the routing decision, the budget account, the trace) at four points of the request:

    begin    the request's headers are in (a stage may set its value up: the trace, the account)
    admit    the body is rendered into the producer's request (a stage may change it or refuse it)
    started  the producer's response headers are in (a stage may add response headers)
    end      the exchange is closed and its report final (count, log, settle, end the trace)

and, for a request it engaged with, on every body chunk (``RequestContext.on_chunk``). Stages read
typed values only, never another stage's or the exchange's private names. ``endpoints.registry``
composes them, one line each, in the order they run.
"""

from __future__ import annotations

from .base import ChunkHook, Pipeline, RequestContext, Stage

__all__ = ["ChunkHook", "Pipeline", "RequestContext", "Stage"]
