"""Which endpoint and which model a request is for, and the answers the filter gives by itself.

A ``Backend`` is one served model: its names, how it is rendered (a local vLLM
``Model``, or a render tier URL) and the Envoy cluster of its producers.
``Router.route`` looks at the request headers. Endpoints that need the body
(``/v1/chat/completions``, ``/v1/completions``, ``/tokenize``, ``/detokenize``)
get a ``ModelExchange``: once the body is in, it picks the backend from the
body's ``model`` and hands over to that backend's exchange for the endpoint; a
request for a producer gets the ``x-derender-cluster`` header, which Envoy
routes on after the route cache is cleared. Health and models are answered at
once (a ``Reply``), without a producer round trip.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable
from urllib.parse import unquote

import orjson

from ..ops import metrics
from ..translate.errors import HTTPError, anthropic_error_body, dumps
from ..translate.model import Model
from .balance import ENDPOINT_KEY, KEY_HEADER, Balancer, Decision, RoutingSpec
from .producer import Producer, abort_replica_first
from ..extproc.actions import Exchange, Reply, ResponseStart, Rewrite

CLUSTER_HEADER = "x-derender-cluster"
# Request headers that steer Envoy (which cluster, which replica): only the filter sets them. The
# server removes the client's copies of these, and of every other x-derender-* header, on every path.
STEERING_HEADERS = (CLUSTER_HEADER, KEY_HEADER, ENDPOINT_KEY)
STEERING_PREFIX = "x-derender-"
DEFAULT_CLUSTER = "producer"  # the producer cluster of envoy/local.yaml
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
MESSAGES_PATH, COUNT_TOKENS_PATH = "/v1/messages", "/v1/messages/count_tokens"
RESPONSES_PATH = "/v1/responses"
BODY_PATHS = (CHAT_PATH, COMPLETIONS_PATH, MESSAGES_PATH, COUNT_TOKENS_PATH, RESPONSES_PATH, "/tokenize", "/detokenize")
ANTHROPIC_PATHS = (MESSAGES_PATH, COUNT_TOKENS_PATH)
MODELS_PATH = "/v1/models"


def model_not_found(name: str, aliases: list[str]) -> HTTPError:
    """vLLM's 404 for an unknown model (``BaseServing._check_model``)."""
    return HTTPError(
        404, f"The model `{name}` does not exist. Valid aliases: {', '.join(aliases)}.", "NotFoundError", "model"
    )


class ClusterProducers:
    """The producers of one Envoy cluster. Envoy says which one it picked once the response
    has started (``UPSTREAM_HEADER``); before that, or if that one cannot be reached, an
    abort goes to all of them (vLLM ignores unknown ids)."""

    def __init__(self, urls: list[str] | tuple[str, ...]) -> None:
        self.producers = [Producer(url) for url in urls]

    def abort_soon(self, request_id: str, why: str, upstream: str | None = None) -> None:
        self.producers[0].spawn(self.abort(request_id, why, upstream))

    async def close(self) -> None:
        for producer in self.producers:
            await producer.close()

    async def abort(self, request_id: str, why: str, upstream: str | None = None) -> bool:
        return await abort_replica_first(self.producers[0], self.producers, request_id, why, upstream)


def producers(urls: list[str] | tuple[str, ...]) -> Producer | ClusterProducers:
    return Producer(urls[0]) if len(urls) == 1 else ClusterProducers(urls)


class Backend:
    """One served model: its names, how it is rendered and its producer cluster."""

    def __init__(
        self,
        names: list[str] | tuple[str, ...],
        producer: Producer | ClusterProducers,
        cluster: str = DEFAULT_CLUSTER,
        model: Model | None = None,
        render_url: str | None = None,
        routing: str | None = None,
    ) -> None:
        from ..endpoints.rendertier import RenderTier

        if (model is None) == (render_url is None):
            raise ValueError("a backend has either a local model or a render tier URL")
        self.names = list(names)
        self.producer = producer
        self.cluster = cluster
        self.model = model
        self.tier = RenderTier(render_url) if render_url else None
        self.routing = routing  # None: the server's --routing
        self.balancer: Balancer | None = None  # set by the Router
        if model is not None:  # built now, not on the first request
            from ..endpoints.completions import serving_completion

            serving_completion(model)

    @classmethod
    def local(cls, model: Model, producer: Producer, cluster: str = DEFAULT_CLUSTER) -> Backend:
        return cls(model.served_names, producer, cluster, model=model)

    def exchange(self, path: str, x_request_id: str | None) -> Exchange:
        """The exchange object for one request to ``path``."""
        if self.tier is not None:
            from ..endpoints.rendertier import CHAT, COMPLETION, TierExchange, TierPassThrough

            if path in (CHAT_PATH, COMPLETIONS_PATH):
                return TierExchange(self.tier, CHAT if path == CHAT_PATH else COMPLETION, self.producer, x_request_id)
            if path in ANTHROPIC_PATHS:
                return NotServed(TIER_HAS_NO_MESSAGES)
            if path == RESPONSES_PATH:
                return NotServed(TIER_HAS_NO_RESPONSES, anthropic=False)
            return TierPassThrough(self.tier, path, x_request_id)
        assert self.model is not None
        if path == CHAT_PATH:
            from ..endpoints.chat import ChatExchange

            return ChatExchange(self.model, self.producer, x_request_id)
        if path == COMPLETIONS_PATH:
            from ..endpoints.completions import CompletionExchange

            return CompletionExchange(self.model, self.producer, x_request_id)
        if path == MESSAGES_PATH:
            from ..endpoints.messages import MessagesExchange

            return MessagesExchange(self.model, self.producer, x_request_id)
        if path == COUNT_TOKENS_PATH:
            from ..endpoints.messages import CountTokensExchange

            return CountTokensExchange(self.model, x_request_id)
        if path == RESPONSES_PATH:
            from ..endpoints.responses import ResponsesExchange

            return ResponsesExchange(self.model, self.producer, x_request_id)
        from ..endpoints.tokenization import TokenizationExchange

        return TokenizationExchange(self.model, path, x_request_id)

    async def models(self) -> list[dict[str, Any]]:
        """vLLM's model cards for this backend."""
        if self.tier is not None:
            return await self.tier.models()
        assert self.model is not None
        return (await self.model.registry.show_available_models()).model_dump()["data"]


TIER_HAS_NO_MESSAGES = (
    "/v1/messages is not served in render-tier mode: vLLM's render tier renders Messages requests but "
    "its derender tier turns token ids into chat and completion streams only. Serve the model with "
    "--model (the filter renders and derenders Messages itself), or use /v1/chat/completions."
)


TIER_HAS_NO_RESPONSES = (
    "/v1/responses is not served in render-tier mode: vLLM's render tier renders Responses requests but "
    "its derender tier turns token ids into chat and completion streams only. Serve the model with "
    "--model (the filter renders and derenders Responses itself), or use /v1/chat/completions."
)


class NotServed:
    """An endpoint this backend cannot serve: the error once the body is in."""

    stream = None

    def __init__(self, message: str, status: int = 501, anthropic: bool = True) -> None:
        self.message = message
        self.status = status
        self.anthropic = anthropic

    async def request_body(self, body: bytes) -> Reply:
        if self.anthropic:
            return Reply(self.status, anthropic_error_body(self.status, self.message))
        return Reply.error(HTTPError(self.status, self.message, "NotImplementedError"))

    def close(self, complete: bool) -> None:
        pass


class ModelExchange:
    """Picks the backend from the body's ``model``, then hands everything to its exchange."""

    def __init__(self, router: Router, path: str, x_request_id: str | None) -> None:
        self.router = router
        self.path = path
        self.x_request_id = x_request_id
        self.inner: Exchange | None = None
        self.balancer: Balancer | None = None
        self.decision: Decision | None = None

    @property
    def stream(self) -> Any:
        return self.inner.stream if self.inner is not None else None

    async def request_body(self, body: bytes) -> Rewrite | Reply:
        backend = self.router.backend_for(body)
        self.inner = backend.exchange(self.path, self.x_request_id)
        result = await self.inner.request_body(body)
        if isinstance(result, Rewrite):
            result.set_headers[CLUSTER_HEADER] = backend.cluster
            # Envoy's access log prints this header in place of the rewritten path when present:
            # there, requests read as what the client asked for, not all as /inference/v1/generate.
            result.set_headers["x-envoy-original-path"] = self.path
            if backend.balancer is not None:
                began = time.thread_time()
                headers, self.decision = backend.balancer.route(result.prompt_ids, result.cache_salt)
                self.decision.cpu_us = (time.thread_time() - began) * 1e6
                result.set_headers.update(headers)
                result.destination = self.decision.chosen
                self.balancer = backend.balancer
        return result

    def response_headers(self, status: int, upstream: str | None = None) -> ResponseStart:
        if self.balancer is not None and self.decision is not None:
            self.balancer.started(self.decision, upstream, status)
            self.inner.routed = self.decision
        return self.inner.response_headers(status, upstream)

    def response_chunk(self, chunk: bytes, end: bool) -> bytes | Awaitable[bytes]:
        return self.inner.response_chunk(chunk, end)

    async def response_body(self, body: bytes) -> tuple[bytes, int | None]:
        return await self.inner.response_body(body)

    def close(self, complete: bool) -> None:
        if self.balancer is not None and self.decision is not None:
            self.balancer.finished(self.decision)
            d, inner = self.decision, self.inner
            cached = getattr(getattr(inner, "stream", None), "producer_cached_tokens", None)
            metrics.routed(d.mode, d.why or "key", d.served, d.prompt_tokens,
                           cached if cached is not None else getattr(inner, "producer_cached_tokens", None))
        if self.inner is not None:
            self.inner.close(complete)


class Router:
    """Which endpoint and model a request is for, and the answers the filter gives itself.

    ``served`` is one ``Model`` (served with ``producer``), or the ``Backend``s
    of several models; the first one is the default when a body names no model.
    ``routing``: how requests pick a producer replica (``balance``), for every backend
    that names no mode of its own.
    """

    def __init__(
        self, served: Model | Backend | list[Backend], producer: Producer | None = None, routing: RoutingSpec | None = None
    ) -> None:
        if isinstance(served, Backend):
            served = [served]
        elif not isinstance(served, list):
            assert producer is not None
            served = [Backend.local(served, producer)]
        if not served:
            raise ValueError("nothing to serve")
        self.backends: list[Backend] = served
        routing = routing or RoutingSpec()
        for backend in served:
            tokenizer = backend.model.tokenizer if backend.model is not None else None
            backend.balancer = routing.balancer(tokenizer, backend.routing)
        self.by_name = {name: b for b in served for name in b.names}

    def backend_for(self, body: bytes) -> Backend:
        """The backend of the body's ``model``; a body vLLM will refuse goes to the default one."""
        if len(self.backends) == 1:
            return self.backends[0]  # it checks the model name itself, as vLLM does
        try:
            name = orjson.loads(body).get("model")
        except (ValueError, AttributeError):
            name = None
        if not isinstance(name, str) or not name:
            return self.backends[0]
        backend = self.by_name.get(name)
        if backend is None:
            raise model_not_found(name, list(self.by_name))
        return backend

    async def route(self, headers: dict[str, str], end_of_stream: bool) -> ModelExchange | Reply:
        method = headers.get(":method", "GET")
        path = headers.get(":path", "/").split("?", 1)[0]
        try:
            if path in BODY_PATHS:
                if method != "POST":
                    return Reply.error(HTTPError(405, f"Method {method} not allowed for {path}"))
                if end_of_stream:
                    return Reply.error(HTTPError(400, "The request body is empty: a JSON request body is required"))
                return ModelExchange(self, path, headers.get("x-request-id"))
            if path in ("/health", "/ping") and method == "GET":
                return Reply(200, b"")
            if path == MODELS_PATH and method == "GET":
                return Reply(200, dumps({"object": "list", "data": await self._cards()}))
            if path.startswith(MODELS_PATH + "/") and method == "GET":
                return await self._card(unquote(path[len(MODELS_PATH) + 1 :]))
            if path.startswith(RESPONSES_PATH + "/"):
                return await self._stored_response(method, unquote(path[len(RESPONSES_PATH) + 1 :]))
        except HTTPError as exc:
            return Reply.error(exc)
        return Reply.error(HTTPError(404, f"Route {method} {path} is not served here", "NotFoundError"))

    async def _stored_response(self, method: str, rest: str) -> Reply:
        """``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``: vLLM's answers (405 otherwise)."""
        cancel = rest.endswith("/cancel")
        response_id = rest.removesuffix("/cancel")
        if "/" in response_id or not response_id:
            raise HTTPError(404, f"Route {method} {RESPONSES_PATH}/{rest} is not served here", "NotFoundError")
        if method != ("POST" if cancel else "GET"):
            raise HTTPError(405, "Method Not Allowed", "Method Not Allowed")
        backend = self.backends[0]
        if backend.model is None:
            raise HTTPError(501, TIER_HAS_NO_RESPONSES, "NotImplementedError")
        from ..endpoints.responses import StoredResponseExchange

        return await StoredResponseExchange(backend.model, response_id, cancel).answer()

    async def _cards(self) -> list[dict[str, Any]]:
        cards: list[dict[str, Any]] = []
        for backend in self.backends:
            cards += await backend.models()
        return cards

    async def _card(self, model_id: str) -> Reply:
        cards = await self._cards()
        for card in cards:
            if card.get("id") == model_id:
                return Reply(200, dumps(card))
        return Reply.error(model_not_found(model_id, [c.get("id", "") for c in cards]))
