"""The Envoy ext_proc gRPC server: one coroutine per HTTP stream owns that stream's state.

Envoy sends request headers, the buffered request body, response headers and
the response body chunks of one HTTP stream over one gRPC stream. This module
turns those messages into calls on the exchange for the request's endpoint
(``exchange.Exchange``) and its answers into ext_proc responses. Requests the
filter answers itself (health, models, errors) get an ``immediate_response``
before anything reaches a producer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc.aio import EOF

from ..endpoints import registry
from ..endpoints.router import ModelExchange, Router
from ..exchange import STRIP_REQUEST_HEADERS, Reply, ResponseStart, Rewrite
from ..ops import auth, loopwatch, metrics, quota, tracing
from ..ops.warmup import warm_up
from ..routing.balance import ENDPOINT_KEY, ENDPOINT_NAMESPACE, RoutingSpec
from ..routing.clusters import STEERING_HEADERS, STEERING_PREFIX, producers
from ..routing.producer import UPSTREAM_HEADER
from ..settings import Settings
from ..translate.errors import HTTPError, from_exception
from ..translate.model import Model
from . import http2, scale
from .health import EXT_PROC_SERVICE, Http2Health, add_health
from .leg import LEG_HEADER, WORKER_HEADER
from .leg.front import LegServer
from .listen import Listener, hostport, listen_hosts
from .messages import (
    _BUFFERED_RESPONSE,
    _PASS_RESPONSE,
    LEG_MODE,
    _body_mutation,
    _error,
    _extend,
    _header_map,
    _mutation,
    body_reply,
    encoded_body_reply,
    immediate,
)

log = logging.getLogger("derender.extproc")


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, router: Router, keys: auth.ApiKeys | None = None, leg: LegServer | None = None) -> None:
        self.router = router
        self.keys = keys or auth.ApiKeys()  # none: every request passes
        self.leg = leg  # --response-leg worker: rewritten requests come back to this worker's listener
        self.active = 0

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest], context) -> None:
        # grpc.aio's read()/write() on the call itself, not its request iterator and an async
        # generator of replies: two layers of async generators less per message. An echo server
        # spends 0.88x the CPU per message this way; the filter at 64 streams paced one token per
        # 20 ms, 430 against 462 us per token (medians of 8 interleaved rounds, each +-10 %).
        http2.METADATA.set(dict(context.invocation_metadata() or ()))  # what Envoy sent with the stream
        try:
            await self.serve_stream(context.read, context.write, encoded=False)
        except http2.Status as exc:  # the same status as the filter's own transport sends
            await context.abort(next(c for c in grpc.StatusCode if c.value[0] == exc.code), str(exc))

    async def serve_stream(
        self,
        read: Callable[[], Awaitable[Any]],
        write: Callable[[pb.ProcessingResponse], Awaitable[None]],
        encoded: bool = True,
    ) -> None:
        """One ext_proc stream: ``read`` the next message (``grpc.aio.EOF`` at the end), ``write`` a reply.
        Either transport's entry: grpc.aio's through ``Process``, ``http2``'s directly. ``encoded``: a
        streamed chunk's reply may be written in its wire form (``messages.Encoded``), as ``http2`` takes."""
        exchange: ModelExchange | None = None
        complete = False
        rewritten = False  # the request went on to a producer
        handed = False  # the exchange is the worker's leg's from here (``extproc.leg``), which closes it
        self.active += 1
        try:
            while True:
                message = await read()
                if message is EOF:
                    break
                kind = message.WhichOneof("request")
                if kind == "request_headers" and exchange is None:
                    headers = _header_map(message.request_headers)
                    denied = self.keys.check(headers)
                    if denied is not None:  # before anything is routed, let alone sent to a producer
                        complete = True
                        await write(_error(registry.shaped(headers.get(":path", "/"), denied)))
                        return
                    routed = await self.router.route(
                        headers, message.request_headers.end_of_stream, http2.METADATA.get()
                    )
                    if isinstance(routed, Reply):
                        complete = True
                        await write(immediate(routed.status, routed.body, routed.content_type, routed.headers))
                        return
                    exchange = routed
                    exchange.ctx.extend = functools.partial(_extend, write)
                    # The worker's leg answers it if this Envoy's config has the leg (``LegServer.takes``).
                    leg = self.leg if self.leg is not None and self.leg.takes(http2.METADATA.get()) else None
                    await write(self._request_headers(headers, leg is not None))
                elif kind == "request_body" and exchange is not None and not rewritten:
                    try:
                        rewrite = await exchange.request_body(message.request_body.body)
                    except HTTPError as exc:
                        complete = True
                        await write(_error(exc))
                        return
                    except Exception as exc:  # a bug: still an OpenAI error, never a broken gRPC stream
                        log.exception("request failed")
                        complete = True
                        await write(_error(from_exception(exc)))
                        return
                    if isinstance(rewrite, Reply):  # answered from the body (e.g. /tokenize)
                        complete = True
                        await write(immediate(rewrite.status, rewrite.body, rewrite.content_type, rewrite.headers))
                        return
                    rewritten = True
                    if leg is not None:
                        token = leg.hand(exchange, rewrite)
                        if token is None:
                            complete = True
                            await write(_error(exchange.ctx.endpoint.error(HTTPError(503, "the response leg is full"))))
                            return
                        handed = True
                        await write(self._request_rewrite(rewrite, (token, leg.address)))
                        return  # Envoy goes on without this stream; the leg answers
                    await write(self._request_rewrite(rewrite))
                    if rewrite.then is not None:  # sent: Envoy is reaching the producer meanwhile
                        rewrite.then()
                elif kind == "response_headers" and exchange is not None and not rewritten:
                    # Envoy answered before the body reached the filter (413: body too large).
                    complete = True
                    await write(
                        pb.ProcessingResponse(response_headers=pb.HeadersResponse(), mode_override=_PASS_RESPONSE)
                    )
                elif kind == "response_headers" and exchange is not None:
                    headers = _header_map(message.response_headers)
                    status = int(headers.get(":status", "0") or 0)
                    start = exchange.response_headers(status, headers.get(UPSTREAM_HEADER))
                    complete = message.response_headers.end_of_stream and not start.buffer
                    await write(self._response_start(start))
                elif kind == "response_body" and exchange is not None:
                    body = message.response_body
                    if exchange.streaming:  # one per token: its reply as bytes, not four messages built
                        out = await exchange.response_chunk(body.body, body.end_of_stream)
                        reply = encoded_body_reply(out) if encoded else body_reply(out)
                    else:
                        out, new_status = await exchange.response_body(body.body)
                        common = pb.CommonResponse(
                            header_mutation=_mutation(
                                {
                                    "content-length": str(len(out)),
                                    **({":status": str(new_status)} if new_status else {}),
                                }
                            ),
                            body_mutation=_body_mutation(out),
                        )
                        reply = pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))
                    complete = complete or body.end_of_stream
                    await write(reply)
                elif kind == "request_trailers":
                    await write(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
                elif kind == "response_trailers":
                    await write(pb.ProcessingResponse(response_trailers=pb.TrailersResponse()))
                else:  # never from Envoy with the filter's processing modes: the stream ends
                    raise http2.Status(http2.INVALID_ARGUMENT, f"unexpected ext_proc message {kind}")
        except (asyncio.CancelledError, http2.Status):
            raise
        except Exception:
            log.exception("ext_proc stream failed")
            raise
        finally:
            self.active -= 1
            if exchange is not None and not handed:
                exchange.close(complete)

    @staticmethod
    def _request_headers(headers: dict[str, str], leg: bool = False) -> pb.ProcessingResponse:
        """Go on to the body; the client's copies of the headers that steer Envoy are removed here,
        on every path, so that only the filter's own (set with the rewrite) can choose a cluster
        or a producer replica. ``leg``: the response will come from the worker's leg, not through here."""
        forged = [k for k in headers if k in STEERING_HEADERS or k.startswith(STEERING_PREFIX)]
        common = pb.CommonResponse(header_mutation=_mutation(remove=forged)) if forged else None
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=common), mode_override=LEG_MODE if leg else None
        )

    @staticmethod
    def _request_rewrite(rewrite: Rewrite, leg: tuple[str, str] | None = None) -> pb.ProcessingResponse:
        """The request as the producer gets it; ``leg`` (a token, this worker's leg address): for
        ``--response-leg worker``, sent on to that listener with no body (the worker sent it itself)."""
        body = rewrite.body if leg is None else b""
        headers = {":path": rewrite.path, "content-length": str(len(body)), **rewrite.set_headers}
        if leg is not None:
            headers[LEG_HEADER], headers[WORKER_HEADER] = leg
        response = pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    header_mutation=_mutation(headers, STRIP_REQUEST_HEADERS),
                    body_mutation=pb.BodyMutation(body=body) if leg is None else pb.BodyMutation(clear_body=True),
                    clear_route_cache=True,
                )
            )
        )
        if rewrite.destination is not None and leg is None:
            # Precise routing's replica, for Envoy's override_host policy: dynamic metadata, which no
            # client can send (Envoy accepts it only in the namespaces its metadata_options allow).
            response.dynamic_metadata.update({ENDPOINT_NAMESPACE: {ENDPOINT_KEY: rewrite.destination}})
        return response

    @staticmethod
    def _response_start(start: ResponseStart) -> pb.ProcessingResponse:
        response = pb.ProcessingResponse(
            response_headers=pb.HeadersResponse(
                response=pb.CommonResponse(
                    header_mutation=_mutation(start.set_headers, [*start.remove_headers, UPSTREAM_HEADER])
                )
            )
        )
        if start.buffer:
            response.mode_override.CopyFrom(_BUFFERED_RESPONSE)
        return response


class ObservedProcessor(ExternalProcessor):
    """``ExternalProcessor`` seen from outside: per-message cost, active streams, route and status."""

    async def serve_stream(self, read, write, encoded: bool = True) -> None:
        observer = metrics.StreamObserver()

        async def observed_read() -> object:
            message = await read()
            if message is not EOF:
                observer.received(message)
            return message

        async def observed_write(response: pb.ProcessingResponse) -> None:
            observer.answered(response)
            await write(response)

        try:
            await super().serve_stream(observed_read, observed_write, encoded)
        finally:
            observer.close()


async def serve(
    model: Model,
    producer_url: str,
    host: str,
    port: int,
    ready: asyncio.Event | None = None,
    reuse_port: bool = False,
    routing: RoutingSpec | None = None,
    listener: Listener | None = None,
    settings: Settings | None = None,
) -> None:
    """Serve ext_proc on ``host:port``; ``reuse_port`` lets sibling workers bind the same port."""
    listener = listener or Listener()
    settings = settings or Settings()
    producer = producers(producer_url.split(","), settings.stall_timeout)
    router = Router(model, producer, routing, quota.configured(settings))
    for backend in router.backends:
        if backend.model is not None:
            await warm_up(backend.model)
            if backend.model.prompt_memo is not None and metrics.enabled():
                backend.model.prompt_memo.observe = metrics.prompt_memo
    # Without a metrics port nobody reads the per-message timings: skip their cost on every message.
    kind = ObservedProcessor if metrics.enabled() else ExternalProcessor
    leg = None
    if settings.response_leg == "worker":
        leg = LegServer(producer_url, settings.leg_host, on_defence=metrics.defence)
        await leg.start()
    processor = kind(router, auth.ApiKeys(settings.api_keys), leg=leg)
    hosts = listen_hosts(host)
    address = ", ".join(hostport(h, port) for h in hosts)
    if settings.transport == "http2":
        health = Http2Health(("", EXT_PROC_SERVICE))
        methods = {PROCESS: (pb.ProcessingRequest.FromString, processor.serve_stream), **health.methods()}
        server = http2.Server(methods, listener.limits, on_defence=metrics.defence)
        tls = None
        if listener.tls_cert:
            tls = http2.tls_context(listener.tls_cert, listener.tls_key, listener.tls_client_ca)
        await server.start(hosts, port if listener.tcp else None, reuse_port=reuse_port, ssl=tls, unix=listener.unix)
        if listener.unix is not None:
            where = listener.unix.getsockname()
            address = f"{address} and {where}" if listener.tcp else where
    else:
        server = grpc.aio.server(options=[*listener.grpc_options(), ("grpc.so_reuseport", 1 if reuse_port else 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
        health = await add_health(server)
        credentials = listener.grpc_credentials()
        for where in (hostport(h, port) for h in hosts):
            bound = (
                server.add_secure_port(where, credentials)
                if credentials is not None
                else server.add_insecure_port(where)
            )
            if bound == 0:
                raise OSError(f"cannot listen on {where}")
        await server.start()
    metrics.start_server()
    tracing.configure(settings.otlp_traces_endpoint, settings.trace_sample_ratio)
    watch = loopwatch.start()
    # --workers auto: this worker's reports to the supervisor, and its connections handed on when asked
    # (grpc.aio's server cannot hand a connection on: it reports its loop's busy ratio alone).
    if isinstance(server, http2.Server):
        sizing = scale.start(server.movable, server.retire_one)
    else:
        sizing = scale.start(lambda: 0, lambda: False)
    feeds = [b.balancer.kv for b in router.backends if b.balancer is not None and b.balancer.kv is not None]
    for kv in feeds:  # kv-events routing: each producer's KV cache events, read on this loop
        kv.start()
    signals = [b.flow.signal for b in router.backends if b.flow is not None and b.flow.signal is not None]
    for reported in signals:  # flow control: each producer's /metrics, read on this loop
        reported.start()
    log.info(
        "ext_proc listening on %s (transport %s%s), producer %s",
        address,
        settings.transport,
        ", mTLS" if listener.tls_client_ca else ", TLS" if listener.tls_cert else "",
        producer_url,
    )
    if settings.quota_config:  # SIGHUP: the quota file again
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, router.reload_quotas, settings)
    if ready is not None:
        ready.set()
    try:
        await _until_terminated(server, health, processor, settings.drain_timeout)
    finally:
        for task in (watch, sizing):
            if task is not None:
                task.cancel()
        await server.stop(grace=2)
        if leg is not None:
            await leg.close()
        for kv in feeds:
            await kv.stop()
        for reported in signals:
            await reported.stop()
        for backend in router.backends:  # the prefill replicas' client
            if backend.handoff is not None:
                await backend.handoff.close()
        await producer.close()
        tracing.shutdown()


PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


async def _until_terminated(server: grpc.aio.Server, health, processor: ExternalProcessor, drain: float) -> None:
    """Serve until the server ends; on SIGTERM, drain: refuse new streams, let open ones finish.

    The end of ``drain`` seconds (``derender serve --drain-timeout``) cuts whatever is still open. More SIGTERMs change nothing: a
    worker gets one from its supervisor and often one more from whoever signalled the process
    group (systemd, a shell). SIGINT (Ctrl-C) stops at once.
    """
    terminated = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigterm() -> None:
        if terminated.is_set():
            log.debug("SIGTERM again: still draining %d open streams", processor.active)
        terminated.set()

    try:
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    except (RuntimeError, ValueError, NotImplementedError):  # not the main thread: nothing to catch here
        pass
    ended = asyncio.ensure_future(server.wait_for_termination())
    told = asyncio.ensure_future(terminated.wait())
    await asyncio.wait({ended, told}, return_when=asyncio.FIRST_COMPLETED)
    told.cancel()
    if not terminated.is_set():
        return
    active = processor.active + len(processor.leg.legs if processor.leg is not None else ())  # legs: their answers
    log.info("SIGTERM: draining %d open streams (up to %g s); new streams are refused", active, drain)
    await health.enter_graceful_shutdown()  # NOT_SERVING to health checks
    started = time.monotonic()
    await server.stop(grace=drain)
    if processor.leg is not None:  # the answers the worker's leg carries
        await processor.leg.drain(drain - (time.monotonic() - started))
    log.info("drained in %.1f s", time.monotonic() - started)
