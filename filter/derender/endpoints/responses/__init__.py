"""``/v1/responses`` (OpenAI Responses), one endpoint in four modules: ``endpoint`` (rendering, the
stream, the exchange, stored responses, its ``ENDPOINT``), ``session`` (vLLM's ``create_responses``
as a task, fed the producer's outputs), ``lean`` (the lean path: vLLM's per-output loop body) and
``store`` (stored responses in Redis)."""

from .endpoint import (
    ENDPOINT,
    RESPONSES_PATH,
    RenderedResponse,
    ResponsesExchange,
    ResponsesStream,
    render_responses,
    serving_responses,
    stored_response,
)

__all__ = [
    "ENDPOINT",
    "RESPONSES_PATH",
    "RenderedResponse",
    "ResponsesExchange",
    "ResponsesStream",
    "render_responses",
    "serving_responses",
    "stored_response",
]
