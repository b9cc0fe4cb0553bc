"""Which endpoint a request is for, and the answers the filter gives by itself.

``Router.route`` returns an exchange object for endpoints that go to a producer
(one class per endpoint, e.g. ``chat.ChatExchange``) or a ``Reply`` the filter
sends at once (health, models, errors) without a producer round trip.
"""

from __future__ import annotations

from dataclasses import dataclass

from .chat import ChatExchange
from .errors import HTTPError, dumps
from .model import Model
from .producer import Producer


@dataclass
class Reply:
    """An immediate response."""

    status: int
    body: bytes
    content_type: str = "application/json"

    @classmethod
    def error(cls, exc: HTTPError) -> "Reply":
        return cls(exc.status, exc.body())


class Router:
    """Which endpoint a request is for, and the answers the filter gives itself."""

    def __init__(self, model: Model, producer: Producer) -> None:
        self.model = model
        self.producer = producer

    async def route(self, headers: dict[str, str], end_of_stream: bool) -> ChatExchange | Reply:
        method = headers.get(":method", "GET")
        path = headers.get(":path", "/").split("?", 1)[0]
        if path == "/v1/chat/completions":
            if method != "POST":
                return Reply.error(HTTPError(405, f"Method {method} not allowed for {path}"))
            if end_of_stream:
                return Reply.error(HTTPError(400, "The request body is empty: a JSON chat completion request is required"))
            return ChatExchange(self.model, self.producer, headers.get("x-request-id"))
        if path in ("/health", "/ping") and method == "GET":
            return Reply(200, b"")
        if path == "/v1/models" and method == "GET":
            models = await self.model.registry.show_available_models()
            return Reply(200, dumps(models.model_dump()))
        return Reply.error(HTTPError(404, f"Route {method} {path} is not served here", "NotFoundError"))
