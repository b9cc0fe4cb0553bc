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

    def end(self, exchange: Any, fields: dict[str, Any], started: float, first_token: float | None) -> None:
        """The request is over: its attributes and child spans from what the exchange kept
        (``fields``: its log line's), then every span ends."""
        span = self.span
        if not span.is_recording():
            if self.producer is not None:
                self.producer.end()
            span.end()
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        now_mono, now_ns = time.monotonic(), time.time_ns()
        operation = getattr(exchange, "operation", "") or "request"
        model = fields.get("model")
        span.update_name(f"{operation} {model}" if model else operation)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "vllm",
            "derender.endpoint": getattr(exchange, "endpoint", ""),
            "derender.stream": bool(fields.get("stream")),
            "derender.complete": bool(fields.get("complete")),
            "http.response.status_code": int(fields.get("status") or 0),
        }
        if model:
            attributes["gen_ai.request.model"] = model
        request_id = fields.get("request_id")
        if request_id:
            attributes["gen_ai.response.id"] = request_id
        if fields.get("x_request_id"):
            attributes["derender.x_request_id"] = fields["x_request_id"]
        if fields.get("prompt_tokens") is not None:
            attributes["gen_ai.usage.input_tokens"] = fields["prompt_tokens"]
        if fields.get("completion_tokens") is not None:
            attributes["gen_ai.usage.output_tokens"] = fields["completion_tokens"]
        reasons = finish_reasons(exchange)
        if reasons:
            attributes["gen_ai.response.finish_reasons"] = reasons
        if fields.get("ttft_ms") is not None:
            attributes["derender.time_to_first_chunk_ms"] = fields["ttft_ms"]
        attributes.update(request_attributes(exchange))
        error = fields.get("error")
        if error:
            attributes["error.type"] = error
            span.set_status(Status(StatusCode.ERROR, str(error)))
        span.set_attributes(attributes)

        parent = set_span_in_context(span)
        body_at, render_time = fields.get("body_ms"), fields.get("render_ms")
        if body_at is not None and render_time is not None:
            render_start = started + body_at / 1000
            render = self.tracer.start_span(
                "render", context=parent, start_time=_ns(render_start, now_mono, now_ns), kind=SpanKind.INTERNAL
            )
            render.set_attributes(
                {
                    "gen_ai.usage.input_tokens": fields.get("prompt_tokens") or 0,
                    "derender.images": len(getattr(getattr(exchange, "rendered", None), "media", ()) or ()),
                    "derender.render_ms": render_time,
                }
            )
            render.end(end_time=_ns(render_start + render_time / 1000, now_mono, now_ns))
        routed = getattr(exchange, "routed", None)
        upstream = getattr(exchange, "upstream", None)
        if self.producer is not None:
            # The decision of --routing (its mode, key blocks, replica), else Envoy's load balancer's.
            at = _ns(self._sent_at, now_mono, now_ns)
            route = self.tracer.start_span("route", context=parent, start_time=at, kind=SpanKind.INTERNAL)
            chosen = routed.fields() if routed is not None else {"routing": "envoy", "replica": upstream}
            route.set_attributes({f"derender.{k}": v for k, v in chosen.items() if v is not None})
            route.end(end_time=at)
        producer = self.producer
        if producer is not None:
            headers_ms = fields.get("producer_headers_ms")
            if headers_ms is not None:
                producer.add_event("response_headers", timestamp=_ns(started + headers_ms / 1000, now_mono, now_ns))
            if first_token is not None:
                producer.add_event("first_token", timestamp=_ns(first_token, now_mono, now_ns))
            status = getattr(exchange, "status", 0)
            producer_attributes: dict[str, Any] = {"http.request.method": "POST"}
            if status:
                producer_attributes["http.response.status_code"] = status
            if upstream:
                host, _, port = upstream.rpartition(":")
                producer_attributes["server.address"] = host
                if port.isdigit():
                    producer_attributes["server.port"] = int(port)
            if headers_ms is not None:
                producer_attributes["derender.producer.headers_ms"] = round(
                    headers_ms - (self._sent_at - started) * 1000, 1
                )
            if first_token is not None:
                producer_attributes["derender.producer.first_token_ms"] = round((first_token - self._sent_at) * 1000, 1)
            if getattr(exchange, "aborted", False):
                producer_attributes["derender.producer.aborted"] = True
            producer.set_attributes(producer_attributes)
            if status and status != 200:
                producer.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            producer.end()
        span.end()


def request_attributes(exchange: Any) -> dict[str, Any]:
    """The GenAI request attributes of what the client asked (``gen_ai.request.*``)."""
    rendered = getattr(exchange, "rendered", None)
    request = getattr(rendered, "request", None)
    if request is None:
        return {}
    out: dict[str, Any] = {}
    for name, attribute in (
        ("max_completion_tokens", "gen_ai.request.max_tokens"),
        ("max_tokens", "gen_ai.request.max_tokens"),
        ("temperature", "gen_ai.request.temperature"),
        ("top_p", "gen_ai.request.top_p"),
        ("top_k", "gen_ai.request.top_k"),
        ("seed", "gen_ai.request.seed"),
        ("frequency_penalty", "gen_ai.request.frequency_penalty"),
        ("presence_penalty", "gen_ai.request.presence_penalty"),
    ):
        value = getattr(request, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and attribute not in out:
            out[attribute] = value
    n = getattr(request, "n", None)
    if isinstance(n, int) and n != 1:
        out["gen_ai.request.choice.count"] = n
    return out


def finish_reasons(exchange: Any) -> list[str]:
    """Each finished choice's reason (``gen_ai.response.finish_reasons``): as the client read it
    (``tool_calls``, Messages' ``end_turn``, ...) where its API has one, else the engine's."""
    client = getattr(exchange, "client_reasons", None)
    if client:
        return list(client)
    stream = getattr(exchange, "stream", None)
    outputs = getattr(stream, "outputs", None)
    reasons = getattr(outputs, "reasons", None)
    if reasons:
        return [r for r in reasons if r]
    return list(getattr(exchange, "finish_reasons", None) or ())
