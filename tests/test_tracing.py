"""OpenTelemetry traces through the real Envoy: an OTLP receiver here (opentelemetry-proto's
TraceService over gRPC) gets the spans of Envoy's tracer and the filter's; the simulator keeps the
``traceparent`` the producer request carried. One trace id across all three, the filter's spans the
children of Envoy's ext_proc span, the GenAI attributes what the stream carried, the sampler
honoured, and a receiver that is down changing nothing for clients."""

from __future__ import annotations

import json
import threading
from concurrent import futures

import grpc
import httpx
import pytest
from derender.ops import envoy_config
from derender.ops.children import free_port
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as ts_grpc

from stack import Proc, start_envoy, start_filter, start_layout, start_sim, wait_for

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
EXT_PROC_SPAN = "async envoy.service.ext_proc.v3.ExternalProcessor.Process egress"  # Envoy's name for it


class Receiver(ts_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: every span it gets, as (service, span) pairs."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.port = free_port()
        self.server: grpc.Server | None = None

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), ""
                )
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        return ts.ExportTraceServiceResponse()

    def start(self) -> Receiver:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        ts_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0)
            self.server = None

    def trace(self, trace_id: str) -> list[tuple[str, object]]:
        with self.lock:
            return [(s, span) for s, span in self.spans if span.trace_id.hex() == trace_id]


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        out[a.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return out


class Traced:
    def __init__(self, receiver: Receiver, sim: Proc, sim_url: str, flt: Proc, filter_port: int, envoy: Proc, envoy_url: str):
        self.receiver, self.sim_url, self.filter_port, self.envoy_url = receiver, sim_url, filter_port, envoy_url
        self.procs = [envoy, flt, sim]

    def traceparents(self) -> list[str]:
        """The ``traceparent`` of each generate request the producer got (the last 50)."""
        headers = httpx.get(self.sim_url + "/sim/headers").json()
        return [v for h in headers for k, v in h.items() if k.lower() == "traceparent"]

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


def start(qwen3_dir: str, receiver: Receiver, envoy_traces: bool, *flags: str) -> Traced:
    sim, sim_url = start_sim(qwen3_dir)  # echo mode: the prompt's tokens come back, up to max_tokens
    procs: list[Proc] = [sim]
    try:
        model = ["--model", qwen3_dir, "--served-model-name", "qwen3", "--max-model-len", "4096"]
        model += ["--workers", "1"]
        model += ["--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}", *flags]
        flt, port = start_filter(model, sim_url)
        procs.append(flt)
        url = f"http://127.0.0.1:{receiver.port}"
        edit = (lambda config: envoy_config.add_tracing(config, url)) if envoy_traces else None
        envoy, envoy_url = start_envoy(port, sim_url, edit=edit)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return Traced(receiver, sim, sim_url, flt, port, envoy, envoy_url)


@pytest.fixture(scope="module")
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def fast_export():
    """The filters started here hand their spans to the exporter within 0.2 s (the SDK's default: 5 s)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def traced(qwen3_dir, receiver, fast_export):
    """Envoy's tracer on; the filter keeps no new trace of its own (ratio 0) and follows Envoy's."""
    t = start(qwen3_dir, receiver, True, "--trace-sample-ratio", "0")
    yield t
    t.stop()


def stream_chat(base: str, headers: dict | None = None, max_tokens: int = 12) -> list[dict]:
    """A streamed chat through Envoy: its chunks."""
    body = {
        "model": "qwen3",
        "messages": [{"role": "user", "content": "Tell me about traces."}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers or {}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def spans_of(receiver: Receiver, trace_id: str, want: set[tuple[str, str]]) -> dict[tuple[str, str], object]:
    """Wait for the spans ``want`` ((service, name) pairs) of one trace; all of that trace's, by pair."""

    def seen():
        got = {(s, span.name): span for s, span in receiver.trace(trace_id)}
        return got if want <= set(got) else None

    return wait_for(seen, f"spans {sorted(want)} of trace {trace_id}", timeout=30)


def test_a_streamed_chat_is_one_trace_from_envoy_to_the_producer(traced):
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    chunks = stream_chat(traced.envoy_url, {"traceparent": parent})
    usage = chunks[-1]["usage"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]

    spans = spans_of(
        traced.receiver,
        CLIENT_TRACE,
        {("derender", "chat qwen3"), ("derender", "render"), ("derender", "route"), ("derender", "producer"),
         ("envoy", "ingress"), ("envoy", EXT_PROC_SPAN)},
    )  # Envoy's tracer flushes every 5 s
    request = spans[("derender", "chat qwen3")]
    # Envoy's spans, in the same trace: the filter's request span is the child of Envoy's ext_proc call.
    envoy_spans = {span.span_id: span for s, span in traced.receiver.trace(CLIENT_TRACE) if s == "envoy"}
    assert request.parent_span_id in envoy_spans, "the filter's span is not a child of one of Envoy's"
    assert envoy_spans[request.parent_span_id].name == EXT_PROC_SPAN
    ingress = [span for span in envoy_spans.values() if span.parent_span_id.hex() == CLIENT_SPAN]
    assert ingress, "Envoy's ingress span does not continue the client's traceparent"
    for name in ("render", "route", "producer"):
        assert spans[("derender", name)].parent_span_id == request.span_id, name

    # The producer got the trace: a traceparent of this trace (Envoy's router span's, Envoy tracing).
    sent = [t for t in traced.traceparents() if CLIENT_TRACE in t]
    assert sent, "the producer request carried no traceparent of the trace"
    producer_parent = sent[-1].split("-")[2]
    assert producer_parent in {span.span_id.hex() for _, span in traced.receiver.trace(CLIENT_TRACE)}

    a = attrs(request)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "qwen3"
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.response.finish_reasons"] == finish
    assert a["gen_ai.response.id"] == chunks[0]["id"]
    assert a["derender.stream"] is True and a["derender.complete"] is True
    assert a["http.response.status_code"] == 200
    events = [e.name for e in spans[("derender", "producer")].events]
    assert events == ["response_headers", "first_token"]


@pytest.mark.parametrize("layout", ["sidecar", "replicas", "compose"])
def test_each_shipped_layouts_envoy_traces_into_one_trace_with_the_filter(traced, layout):
    """The real Envoy on envoy/{sidecar,replicas,compose}.yaml as shipped, only the addresses moved
    to this test's filter, simulator and receiver: its tracer's spans and the filter's are one
    trace, the filter's request span the child of Envoy's ext_proc call, and the producer request
    carries that trace. These layouts have the response leg, and the filter its default
    (``--response-leg auto``): the worker sends the producer request, its ``traceparent`` the filter's
    ``producer`` span's (through ext_proc it would be one of Envoy's, its router's)."""
    sim_port = int(traced.sim_url.rsplit(":", 1)[1])
    envoy, listen, _ = start_layout(
        layout, {"derender": [traced.filter_port], "producer": [sim_port], "otlp": [traced.receiver.port]})
    try:
        trace = f"{layout.encode().hex():0<32}"[:32]
        stream_chat(f"http://127.0.0.1:{listen}", {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"})
        spans = spans_of(traced.receiver, trace, {("derender", "chat qwen3"), ("derender", "producer"),
                                                  ("envoy", "ingress"), ("envoy", EXT_PROC_SPAN)})
    finally:
        envoy.stop()
    envoy_spans = {span.span_id: span for s, span in traced.receiver.trace(trace) if s == "envoy"}
    request = spans[("derender", "chat qwen3")]
    assert envoy_spans[request.parent_span_id].name == EXT_PROC_SPAN
    assert spans[("envoy", "ingress")].parent_span_id.hex() == CLIENT_SPAN
    sent = [t for t in traced.traceparents() if trace in t]
    assert sent and sent[-1].split("-")[2] == spans[("derender", "producer")].span_id.hex()


@pytest.fixture(scope="module")
def untraced_envoy(qwen3_dir, receiver, fast_export):
    """The filter tracing at ratio 0 behind an Envoy without a tracer: only client parents count."""
    t = start(qwen3_dir, receiver, False, "--trace-sample-ratio", "0")
    yield t
    t.stop()


def test_without_envoys_tracer_the_clients_traceparent_is_followed(untraced_envoy):
    sampled = "2" * 32
    stream_chat(untraced_envoy.envoy_url, {"traceparent": f"00-{sampled}-{CLIENT_SPAN}-01"})
    spans = spans_of(untraced_envoy.receiver, sampled, {("derender", "chat qwen3"), ("derender", "producer")})
    assert spans[("derender", "chat qwen3")].parent_span_id.hex() == CLIENT_SPAN
    # Without Envoy's tracer the producer gets the filter's producer span as its parent.
    sent = [t for t in untraced_envoy.traceparents() if sampled in t]
    assert sent and sent[-1] == f"00-{sampled}-{spans[('derender', 'producer')].span_id.hex()}-01"

    # A new trace at ratio 0, and a parent that is not sampled: nothing exported; the producer still
    # gets the context (not sampled), as W3C trace context asks.
    unsampled = "3" * 32
    stream_chat(untraced_envoy.envoy_url, {"traceparent": f"00-{unsampled}-{CLIENT_SPAN}-00"})
    stream_chat(untraced_envoy.envoy_url)
    sent = [t for t in untraced_envoy.traceparents() if unsampled in t]
    assert sent and sent[-1].endswith("-00")
    stream_chat(untraced_envoy.envoy_url, {"traceparent": f"00-{'4' * 32}-{CLIENT_SPAN}-01"})
    spans_of(untraced_envoy.receiver, "4" * 32, {("derender", "chat qwen3")})  # exported after the others
    assert not untraced_envoy.receiver.trace(unsampled)
    new_traces = {t.split("-")[1] for t in untraced_envoy.traceparents()} - {sampled, unsampled, "4" * 32}
    assert len(new_traces) == 1  # the request without a parent got a trace of its own ...
    assert not untraced_envoy.receiver.trace(new_traces.pop())  # ... not kept at ratio 0


class StuckReceiver(Receiver):
    """A receiver that takes each export and does not answer it until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.calls = 0

    def Export(self, request, context):
        with self.lock:
            self.calls += 1
        self.release.wait(120)
        return super().Export(request, context)


@pytest.mark.parametrize("kind", ["down", "stuck"])
def test_a_receiver_that_is_down_or_stuck_changes_nothing_for_clients(qwen3_dir, fast_export, kind):
    """Every request answered whole while the collector refuses connections, or takes exports and
    never answers (the exporter's thread is then held in one): a request that waited for an export
    would hang here. And SIGTERM still ends the filter cleanly: its exit waits for the exporter at most 3 s."""
    receiver = Receiver() if kind == "down" else StuckReceiver().start()  # down: never started, its port refuses
    t = start(qwen3_dir, receiver, False)
    try:
        for i in range(8):
            chunks = stream_chat(t.envoy_url, {"traceparent": f"00-{'5' * 31}{i}-{CLIENT_SPAN}-01"})
            assert chunks[-1]["usage"]["completion_tokens"] > 0
            if i == 3 and isinstance(receiver, StuckReceiver):  # the rest are sent while the exporter is stuck
                wait_for(lambda: receiver.calls >= 1, "an export held by the stuck receiver")
        flt = t.procs[1]
        flt.stop(timeout=20)
        assert flt.popen is not None and flt.popen.returncode == 0, flt.popen.returncode if flt.popen else None
    finally:
        t.stop()
        if isinstance(receiver, StuckReceiver):
            receiver.release.set()
            receiver.stop()


def sse_events(base: str, path: str, body: dict, headers: dict) -> list[dict]:
    out = []
    with httpx.stream("POST", base + path, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_messages_and_responses_streams_are_one_trace_too(traced, api):
    trace_id = {"messages": "6" * 32, "responses": "7" * 32}[api]
    headers = {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}
    ask = [{"role": "user", "content": "Tell me about traces."}]
    if api == "messages":
        events = sse_events(traced.envoy_url, "/v1/messages",
                            {"model": "qwen3", "max_tokens": 10, "messages": ask, "stream": True}, headers)
        start = next(e for e in events if e["type"] == "message_start")["message"]
        delta = next(e for e in events if e["type"] == "message_delta")
        input_tokens, output_tokens = start["usage"]["input_tokens"], delta["usage"]["output_tokens"]
        finish = [delta["delta"]["stop_reason"]]  # as the client read it (end_turn, max_tokens: not the engine's)
    else:
        events = sse_events(traced.envoy_url, "/v1/responses",
                            {"model": "qwen3", "max_output_tokens": 10, "input": ask, "stream": True}, headers)
        final = next(e for e in events if e["type"] in ("response.completed", "response.incomplete"))["response"]
        usage = final["usage"]
        input_tokens, output_tokens = usage["input_tokens"], usage["output_tokens"]
        # No finish reason in the Responses API: the engine's, as the response's status says it.
        cut = final["status"] == "incomplete"
        assert final["incomplete_details"] == ({"reason": "max_output_tokens"} if cut else None)
        finish = ["length" if cut else "stop"]
    name = f"{api} qwen3"
    spans = spans_of(traced.receiver, trace_id, {("derender", name), ("derender", "producer"),
                                                 ("envoy", "ingress"), ("envoy", EXT_PROC_SPAN)})
    request = spans[("derender", name)]
    envoy_spans = {span.span_id: span for s, span in traced.receiver.trace(trace_id) if s == "envoy"}
    assert envoy_spans[request.parent_span_id].name == EXT_PROC_SPAN
    assert spans[("derender", "producer")].parent_span_id == request.span_id
    assert any(trace_id in t for t in traced.traceparents()), "the producer request carried no traceparent of the trace"
    a = attrs(request)
    assert a["gen_ai.operation.name"] == api
    assert a["gen_ai.usage.input_tokens"] == input_tokens
    assert a["gen_ai.usage.output_tokens"] == output_tokens
    assert a["gen_ai.response.finish_reasons"] == finish
    assert a["derender.complete"] is True


def test_on_grpcio_the_filter_reads_envoys_context_from_the_streams_metadata_too(qwen3_dir, receiver, fast_export):
    t = start(qwen3_dir, receiver, True, "--transport", "grpcio")
    try:
        trace_id = "8" * 32
        stream_chat(t.envoy_url, {"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"})
        spans = spans_of(receiver, trace_id, {("derender", "chat qwen3"), ("envoy", EXT_PROC_SPAN)})
        assert spans[("derender", "chat qwen3")].parent_span_id == spans[("envoy", EXT_PROC_SPAN)].span_id
    finally:
        t.stop()
