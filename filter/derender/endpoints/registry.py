"""The endpoints the filter serves: one line each.

An endpoint is one module of this folder that defines its exchange (the ``exchange.Exchange``
that serves one request) and its ``exchange.Endpoint``: the path, how to build the exchange and
the error shape its clients read, what render-tier mode makes of it (``tier``) and the paths below
it (``under``). Adding one is that module (or package) plus its line below; the router
(``router.Router``) serves every path listed here, renders it with the body's model, and sends
it on to that model's producers.
"""

from __future__ import annotations

from ..exchange import Endpoint
from ..stages import Stage, budget, flow, handoff, metrics, requestlog, routing, tracing
from ..translate.errors import HTTPError
from . import chat, completions, messages, responses, tokenization

ENDPOINTS: dict[str, Endpoint] = {
    endpoint.path: endpoint
    for endpoint in (
        chat.ENDPOINT,
        completions.ENDPOINT,
        messages.ENDPOINT,
        messages.COUNT_TOKENS,
        responses.ENDPOINT,
        tokenization.TOKENIZE,
        tokenization.DETOKENIZE,
    )
}


def stages(budgets: budget.Budgets) -> list[Stage]:
    """The stages around every request, in the order they run (``stages``): a new stage is its
    module in ``stages/`` plus its line here."""
    return [
        budgets,  # admit: reserve the key's tokens, or refuse (before anything is routed)
        flow.FlowControl(budgets),  # admit: wait for room at the producers (--replica-capacity)
        routing.Routing(),  # admit: the producer replica
        handoff.Handoffs(),  # admit: the prompt prefilled on a prefill replica first (--prefill)
        tracing.Tracing(),  # admit: the producer request continues the trace
        metrics.Metrics(),
        requestlog.RequestLog(),
    ]


def shaped(path: str, exc: HTTPError) -> HTTPError:
    """``exc`` in the error shape of the endpoint at ``path`` (OpenAI's where none is)."""
    endpoint = ENDPOINTS.get(path.split("?", 1)[0])
    return endpoint.error(exc) if endpoint is not None else exc
