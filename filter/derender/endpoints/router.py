"""Which endpoint and which model a request is for, and the answers the filter gives by itself.

A ``Backend`` is one served model: its names, how it is rendered (a local vLLM
``Model``, or a render tier URL) and the Envoy cluster of its producers.
``Router.route`` looks at the request headers. A path of the endpoint registry
(``registry.ENDPOINTS``) gets a ``ModelExchange``, the request's way through the
pipeline: once the body is in, it picks the backend from the body's ``model`` and
hands over to that backend's exchange for the endpoint; a request for a producer
gets the ``x-derender-cluster`` header, which Envoy routes on after the route cache
is cleared, and the stages (``registry.stages``: budgets, the producer replica,
traces, metrics, the request log) run around the exchange. Health and models are
answered at once (a ``Reply``), without a producer round trip.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any
from urllib.parse import unquote

import orjson

from ..exchange import Answered, Endpoint, Exchange, Reply, ResponseStart, Rewrite
from ..ops import quota
from ..routing.balance import Balancer, RoutingSpec
from ..routing.clusters import CLUSTER_HEADER, DEFAULT_CLUSTER, ClusterProducers
from ..routing.flow import Flow
from ..routing.handoff import Handoff
from ..routing.producer import Producer
from ..routing.saturation import flow_for
from ..stages import Pipeline, RequestContext
from ..stages.budget import Budgets
from ..translate.errors import HTTPError, dumps
from ..translate.model import Model
from . import registry, rendertier
from .completions import serving_completion
from .registry import ENDPOINTS

log = logging.getLogger("derender.router")
MODELS_PATH = "/v1/models"
PRIORITY_HEADER = "x-vllm-priority"  # vLLM's PRIORITY_HEADER, which its coupled server reads over the body's


def model_not_found(name: str, aliases: list[str]) -> HTTPError:
    """vLLM's 404 for an unknown model (``BaseServing._check_model``)."""
    return HTTPError(
        404, f"The model `{name}` does not exist. Valid aliases: {', '.join(aliases)}.", "NotFoundError", "model"
    )


def with_priority(rewrite: Rewrite, header: str | None) -> None:
    """The ``X-Vllm-Priority`` header over the body's ``priority``, as vLLM's coupled server reads it
    (``_get_priority``: an integer header wins, anything else leaves the body's); the generate
    endpoint reads only ``GenerateRequest.priority``, so the filter puts it there."""
    if header is None:
        return
    try:
        priority = int(header)
    except ValueError:
        return
    body = orjson.loads(rewrite.body)
    if body.get("priority") != priority:
        body["priority"] = priority
        rewrite.body = orjson.dumps(body)


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
        kv_events: tuple[str, ...] = (),
        kv_events_replay: tuple[str, ...] = (),
        replica_capacity: int | None = None,
        prefill: tuple[str, ...] = (),
    ) -> None:
        if (model is None) == (render_url is None):
            raise ValueError("a backend has either a local model or a render tier URL")
        # A local model's LoRA adapters are served under their own names, by its producers.
        self.names = list(names) + [a for a in (model.adapters if model is not None else ()) if a not in names]
        self.producer = producer
        self.cluster = cluster
        self.model = model
        self.tier = rendertier.RenderTier(render_url) if render_url else None
        self.routing = routing  # None: the server's --routing
        self.kv_events, self.kv_events_replay = kv_events, kv_events_replay  # None: the server's flags
        self.balancer: Balancer | None = None  # set by the Router
        self.replica_capacity = replica_capacity  # None: the server's --replica-capacity
        self.prefill = prefill  # prefill producers (none: the server's --prefill)
        self.flow: Flow | None = None  # flow control, set by the Router
        self.handoff: Handoff | None = None  # prefill replicas (--prefill), set by the Router
        if model is not None:  # built now, not on the first request
            serving_completion(model)

    @classmethod
    def local(cls, model: Model, producer: Producer | ClusterProducers, cluster: str = DEFAULT_CLUSTER) -> Backend:
        return cls(model.served_names, producer, cluster, model=model)

    def exchange(self, endpoint: Endpoint, x_request_id: str | None) -> Exchange:
        """The exchange object for one request to ``endpoint``."""
        if self.tier is not None:
            if endpoint.tier is None:
                message = endpoint.not_in_tier or f"{endpoint.path} is not served in render-tier mode"
                return NotServed(endpoint.error(HTTPError(501, message, "NotImplementedError")))
            return endpoint.tier(self.tier, self.producer, x_request_id)
        assert self.model is not None
        return endpoint.exchange(self.model, self.producer, x_request_id)

    async def models(self) -> list[dict[str, Any]]:
        """vLLM's model cards for this backend."""
        if self.tier is not None:
            return await self.tier.models()
        assert self.model is not None
        return (await self.model.registry.show_available_models()).model_dump()["data"]


class NotServed(Answered):
    """An endpoint this backend cannot serve: the error once the body is in."""

    def __init__(self, error: HTTPError) -> None:
        self.error = error

    async def request_body(self, body: bytes) -> Reply:
        return Reply.error(self.error)


class ModelExchange:
    """One request through the pipeline: picks the backend from the body's ``model``, hands the
    request to that backend's exchange for the endpoint, and runs the stages around it."""

    def __init__(self, router: Router, ctx: RequestContext) -> None:
        self.router = router
        self.pipeline = router.pipeline
        self.ctx = ctx

    @property
    def streaming(self) -> bool:
        return self.ctx.exchange.streaming

    async def request_body(self, body: bytes) -> Rewrite | Reply:
        ctx = self.ctx
        endpoint = ctx.endpoint
        try:
            backend = self.router.backend_for(body)
        except HTTPError as exc:
            raise endpoint.error(exc) from None
        ctx.exchange = backend.exchange(endpoint, ctx.x_request_id)
        ctx.balancer = backend.balancer
        ctx.flow = backend.flow
        ctx.handoff = backend.handoff
        result = await ctx.exchange.request_body(body)
        if isinstance(result, Rewrite):
            with_priority(result, ctx.headers.get(PRIORITY_HEADER))
            result.set_headers[CLUSTER_HEADER] = backend.cluster
            # Envoy's access log prints this header in place of the rewritten path when present:
            # there, requests read as what the client asked for, not all as /inference/v1/generate.
            result.set_headers["x-envoy-original-path"] = endpoint.path
            refused = await self.pipeline.admit(ctx, result)
            if refused is not None:
                return refused
        return result

    def response_headers(self, status: int, upstream: str | None = None) -> ResponseStart:
        start = self.ctx.exchange.response_headers(status, upstream)
        self.pipeline.started(self.ctx, start)
        return start

    async def response_chunk(self, chunk: bytes, end: bool) -> bytes:
        ctx = self.ctx
        out = await ctx.exchange.response_chunk(chunk, end)
        for hook in ctx.on_chunk:
            out = await hook(ctx, out)
        return out

    async def response_body(self, body: bytes) -> tuple[bytes, int | None]:
        return await self.ctx.exchange.response_body(body)

    def close(self, complete: bool) -> None:
        self.ctx.exchange.close(complete)
        self.pipeline.end(self.ctx)


class Router:
    """Which endpoint and model a request is for, and the answers the filter gives itself.

    ``served`` is one ``Model`` (served with ``producer``), or the ``Backend``s
    of several models; the first one is the default when a body names no model.
    ``routing``: how requests pick a producer replica (``balance``), for every backend
    that names no mode of its own.
    """

    def __init__(
        self,
        served: Model | Backend | list[Backend],
        producer: Producer | ClusterProducers | None = None,
        routing: RoutingSpec | None = None,
        quotas: quota.Quotas | None = None,
    ) -> None:
        self.budgets = Budgets(quotas)  # token budgets per API key (``--quota-config``)
        self.pipeline = Pipeline(registry.stages(self.budgets))
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
            producer = backend.producer
            urls = [p.url for p in producer.producers] if isinstance(producer, ClusterProducers) else [producer.url]
            backend.balancer = routing.balancer(
                tokenizer, backend.routing, urls, backend.kv_events, backend.kv_events_replay
            )
            spec = routing.flow
            if backend.replica_capacity is not None:
                spec = replace(spec, capacity=backend.replica_capacity)
            backend.flow = flow_for(spec, urls, backend.cluster)
            handoff = routing.handoff
            if backend.prefill:
                handoff = replace(handoff, prefill=backend.prefill)
            if handoff.prefill:
                backend.handoff = Handoff(handoff)
        self.by_name: dict[str, Backend] = {}
        for backend in served:
            for name in backend.names:
                if self.by_name.setdefault(name, backend) is not backend:
                    raise ValueError(f"the model name {name!r} is served twice")

    def reload_quotas(self, settings: Any) -> None:
        """SIGHUP: the ``Settings``' quota file again; admitted requests settle on the budgets they
        began with. A file that does not load now changes nothing."""
        try:
            quotas = quota.configured(settings)
        except quota.QuotaConfigError as exc:
            log.error("SIGHUP: the quota file is not reloaded: %s", exc)
            return
        if quotas is not None:
            quotas.succeed(self.quotas)
        elif self.quotas is not None:
            self.quotas.connection.retire()
        self.budgets.quotas = quotas
        log.info("SIGHUP: quota file %s reloaded", settings.quota_config)

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

    @property
    def quotas(self) -> quota.Quotas | None:
        """Token budgets per API key (``--quota-config``), or None."""
        return self.budgets.quotas

    async def route(
        self, headers: dict[str, str], end_of_stream: bool, stream_headers: dict[str, str] | None = None
    ) -> ModelExchange | Reply:
        """The exchange of a request with these headers, or the answer the filter gives itself.
        ``stream_headers``: the ext_proc stream's own (Envoy's trace context, for ``stages.tracing``)."""
        method = headers.get(":method", "GET")
        path = headers.get(":path", "/").split("?", 1)[0]
        try:
            endpoint = ENDPOINTS.get(path)
            if endpoint is not None:
                if method != "POST":
                    return Reply.error(HTTPError(405, f"Method {method} not allowed for {path}"))
                if end_of_stream:
                    return Reply.error(HTTPError(400, "The request body is empty: a JSON request body is required"))
                ctx = RequestContext(endpoint, headers, stream_headers or {})
                self.pipeline.begin(ctx)
                return ModelExchange(self, ctx)
            if path in ("/health", "/ping") and method == "GET":
                return Reply(200, b"")
            if path == MODELS_PATH and method == "GET":
                return Reply(200, dumps({"object": "list", "data": await self._cards()}))
            if path.startswith(MODELS_PATH + "/") and method == "GET":
                return await self._card(unquote(path[len(MODELS_PATH) + 1 :]))
            for endpoint in ENDPOINTS.values():
                if endpoint.under is not None and path.startswith(endpoint.path + "/"):
                    return await endpoint.under(self.backends[0].model, method, unquote(path[len(endpoint.path) + 1 :]))
        except HTTPError as exc:
            return Reply.error(exc)
        return Reply.error(HTTPError(404, f"Route {method} {path} is not served here", "NotFoundError"))

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
