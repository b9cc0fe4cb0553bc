"""OpenTelemetry traces of the filter: a few spans per request, never one per token.

Off unless ``--otlp-traces-endpoint`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) names a collector:
then each worker process exports over OTLP (``grpc`` or ``http/protobuf``, as
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` say, as vLLM reads them) from
the SDK's batch processor, whose thread does the exporting: the event loop only hands it ended spans,
and a collector that is down or slow costs it nothing (the queue drops what it cannot hold).

One request is one trace. Its parent is the span Envoy opened for the ext_proc call (the
``traceparent`` of the gRPC stream, when Envoy's tracer is on), else the client's own ``traceparent``
header; without either, a new trace. Under the request's span (``{operation} {model}``, kind SERVER):
``render`` (prompt tokens, images), ``route`` (the routing decision) and ``producer`` (kind CLIENT:
the generate request; its events ``response_headers`` and ``first_token``). The producer request
carries the ``producer`` span's context as its ``traceparent`` (Envoy's router replaces it with its
own child span when Envoy traces). Spans are built when the request ends, from the times the
exchange keeps anyway, except the two whose ids travel (the request's and the producer's).

Attributes follow the OpenTelemetry semantic conventions 1.37 for GenAI (development status) and
HTTP; the filter's own are ``derender.*`` (see ``docs/tracing.md``).

Like metrics and logging, tracing is the process's own facility: ``configure`` sets it once per
worker (after the fork: the batch processor's thread does not survive one).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..exchange import Report

log = logging.getLogger("derender.tracing")

SEMCONV = "1.37.0"  # the OpenTelemetry semantic conventions the attributes follow

_tracer: Any = None
_provider: Any = None


def enabled() -> bool:
    return _tracer is not None


def protocol() -> str:
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()


def configure(endpoint: str | None, sample_ratio: float = 1.0, service: str | None = None) -> None:
    """Export this process's spans to ``endpoint``; None: tracing stays off (no cost per request)."""
    global _tracer, _provider
    if not endpoint:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    kind = protocol()
    exporter: Any
    if kind == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    elif kind in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
        exporter = HttpExporter(endpoint=url)
    else:
        raise ValueError(f"OTLP traces protocol must be grpc or http/protobuf, not {kind!r}")
    name = service or os.environ.get("OTEL_SERVICE_NAME") or "derender"
    _provider = TracerProvider(
        resource=Resource.create({"service.name": name}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
    )
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = _provider.get_tracer("derender", schema_url=f"https://opentelemetry.io/schemas/{SEMCONV}")
    log.info("traces to %s over %s, sampled at %g", endpoint, kind, sample_ratio)


def shutdown(wait: float = 3.0) -> None:
    """Export what is queued (at the end of a worker), waiting at most ``wait`` seconds: a collector
    that is down never holds a worker's exit (the SDK's own shutdown may wait 30 s)."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    if provider is not None:
        import threading

        done = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
        done.start()
        done.join(wait)


def _propagator():
    """W3C trace context (``traceparent``, ``tracestate``): the SDK's own reader and writer."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


def _context(carrier: dict[str, str] | None):
    if not carrier or "traceparent" not in carrier:
        return None
    return _propagator().extract(carrier)


def begin(headers: dict[str, str], stream: dict[str, str] | None) -> RequestTrace | None:
    """The trace of a request whose exchange starts now, or None when tracing is off. ``headers``: the
    client's request headers; ``stream``: the trace headers of the ext_proc stream (Envoy's span)."""
    if _tracer is None:
        return None
    parent = _context(stream) or _context(headers)
    return RequestTrace(_tracer, parent)


def _ns(at: float, now_mono: float, now_ns: int) -> int:
    """A ``time.monotonic()`` instant as the wall-clock nanoseconds spans carry."""
    return now_ns - int((now_mono - at) * 1e9)


class RequestTrace:
    """One request's spans: its own (started now) and, once it is sent, the producer call's."""

    __slots__ = ("_sent_at", "producer", "span", "tracer")

    def __init__(self, tracer: Any, parent: Any) -> None:
        from opentelemetry.trace import SpanKind

        self.tracer = tracer
        self.span = tracer.start_span("request", context=parent, kind=SpanKind.SERVER)
        self.producer: Any = None
        self._sent_at = 0.0

    @property
    def ids(self) -> tuple[str, str] | None:
        """(trace id, span id) in hex, for the log line; None when not sampled."""
        from opentelemetry.trace import format_span_id, format_trace_id

        context = self.span.get_span_context()
        if not context.trace_flags.sampled:
            return None
        return format_trace_id(context.trace_id), format_span_id(context.span_id)

    def sent(self) -> dict[str, str]:
        """The request goes on to a producer: its span starts; the trace headers the producer gets."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._sent_at = time.monotonic()
        self.producer = self.tracer.start_span("producer", context=set_span_in_context(self.span), kind=SpanKind.CLIENT)
        headers: dict[str, str] = {}
        _propagator().inject(headers, context=set_span_in_context(self.producer))
        return headers

    def span_between(self, name: str, start: float, end: float, attributes: dict[str, Any]) -> None:
        """A finished child span of the request's, between two ``time.monotonic()`` instants."""
        if not self.span.is_recording():
            return
        from opentelemetry.trace import SpanKind, set_span_in_context

        now_mono, now_ns = time.monotonic(), time.time_ns()
        span = self.tracer.start_span(
            name,
            context=set_span_in_context(self.span),
            start_time=_ns(start, now_mono, now_ns),
            kind=SpanKind.INTERNAL,
        )
        span.set_attributes(attributes)
        span.end(end_time=_ns(end, now_mono, now_ns))

    def end(self, report: Report, route: dict[str, object] | None) -> None:
        """The request is over: its attributes and child spans from its exchange's final ``report``
        and the routing decision's fields (``route``), then every span ends."""
        span = self.span
        if not span.is_recording():
            if self.producer is not None:
                self.producer.end()
            span.end()
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        now_mono, now_ns = time.monotonic(), time.time_ns()
        started, first_token = report.started, report.first_token
        operation = report.operation or "request"
        model = report.model
        span.update_name(f"{operation} {model}" if model else operation)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "vllm",
            "derender.endpoint": report.name,
            "derender.stream": report.asked.stream,
            "derender.complete": report.complete,
            "http.response.status_code": report.client_status,
        }
        if model:
            attributes["gen_ai.request.model"] = model
        if report.request_id:
            attributes["gen_ai.response.id"] = report.request_id
        if report.x_request_id:
            attributes["derender.x_request_id"] = report.x_request_id
        if report.prompt_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = report.prompt_tokens
        if report.completion_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = report.completion_tokens
        if report.finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = list(report.finish_reasons)
        if first_token is not None:
            attributes["derender.time_to_first_chunk_ms"] = round((first_token - started) * 1000, 1)
        attributes.update(report.asked.sampling)
        error = report.outcome if report.name else None
        if error:
            attributes["error.type"] = error
            span.set_status(Status(StatusCode.ERROR, str(error)))
        span.set_attributes(attributes)

        parent = set_span_in_context(span)
        if report.body_at is not None and report.render_time is not None:
            render_start = started + report.body_at
            render = self.tracer.start_span(
                "render", context=parent, start_time=_ns(render_start, now_mono, now_ns), kind=SpanKind.INTERNAL
            )
            render.set_attributes(
                {
                    "gen_ai.usage.input_tokens": report.prompt_tokens or 0,
                    "derender.images": report.asked.images,
                    "derender.render_ms": round(report.render_time * 1000, 1),
                }
            )
            render.end(end_time=_ns(render_start + report.render_time, now_mono, now_ns))
        upstream = report.upstream
        producer = self.producer
        if producer is not None:
            # The decision of --routing (its mode, key blocks, replica), else Envoy's load balancer's.
            at = _ns(self._sent_at, now_mono, now_ns)
            route_span = self.tracer.start_span("route", context=parent, start_time=at, kind=SpanKind.INTERNAL)
            chosen = route if route is not None else {"routing": "envoy", "replica": upstream}
            route_span.set_attributes({f"derender.{k}": v for k, v in chosen.items() if v is not None})
            route_span.end(end_time=at)
            headers_at = report.headers_at
            if headers_at is not None:
                producer.add_event("response_headers", timestamp=_ns(started + headers_at, now_mono, now_ns))
            if first_token is not None:
                producer.add_event("first_token", timestamp=_ns(first_token, now_mono, now_ns))
            status = report.status
            producer_attributes: dict[str, Any] = {"http.request.method": "POST"}
            if status:
                producer_attributes["http.response.status_code"] = status
            if upstream:
                host, _, port = upstream.rpartition(":")
                producer_attributes["server.address"] = host
                if port.isdigit():
                    producer_attributes["server.port"] = int(port)
            if headers_at is not None:
                producer_attributes["derender.producer.headers_ms"] = round(
                    (headers_at - (self._sent_at - started)) * 1000, 1
                )
            if first_token is not None:
                producer_attributes["derender.producer.first_token_ms"] = round((first_token - self._sent_at) * 1000, 1)
            if report.aborted:
                producer_attributes["derender.producer.aborted"] = True
            producer.set_attributes(producer_attributes)
            if status and status != 200:
                producer.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            producer.end()
        span.end()
