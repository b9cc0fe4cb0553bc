"""``POST /tokenize`` and ``/detokenize``, answered by vLLM's ``ServingTokenization`` in the filter.

Nothing goes to a producer: the answer is ready once the request body is in,
and goes back as Envoy's immediate response (a ``routes.Reply``).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

from pydantic import TypeAdapter

from ..exchange import Answered, Endpoint, Reply
from ..translate.errors import HTTPError, dumps, from_exception, parse_body
from ..translate.model import Model
from . import rendertier


@functools.cache
def _adapter(path: str) -> TypeAdapter:
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

    return TypeAdapter(TokenizeRequest if path == "/tokenize" else DetokenizeRequest)


class TokenizationExchange(Answered):
    """One ``/tokenize`` or ``/detokenize`` request; never reaches a producer."""

    def __init__(self, model: Model, path: str, x_request_id: str | None) -> None:
        super().__init__()
        self.model = model
        self.path = path
        self.x_request_id = x_request_id

    async def request_body(self, body: bytes) -> Any:
        request = parse_body(_adapter(self.path).validate_python, body)
        serving = self.model.serving_tokenization
        raw = SimpleNamespace(headers={"X-Request-Id": self.x_request_id} if self.x_request_id else {})
        try:
            if self.path == "/tokenize":
                result = await serving.create_tokenize(request, raw)
            else:
                result = await serving.create_detokenize(request, raw)
        except Exception as exc:  # vLLM raises for some bad input instead of returning
            raise from_exception(exc) from None
        if hasattr(result, "error"):
            raise HTTPError.from_vllm(result)
        return Reply(200, dumps(result.model_dump()))


TOKENIZE = Endpoint(
    "/tokenize",
    lambda model, producer, x_request_id: TokenizationExchange(model, "/tokenize", x_request_id),
    tier=rendertier.pass_through("/tokenize"),
)
DETOKENIZE = Endpoint(
    "/detokenize",
    lambda model, producer, x_request_id: TokenizationExchange(model, "/detokenize", x_request_id),
    tier=rendertier.pass_through("/detokenize"),
)
