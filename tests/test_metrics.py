"""Metrics, health and request logs of a real filter, through the real Envoy.

The filter runs as ``derender serve --metrics-port --workers 2`` (forked
processes: the metrics port sums them). Each test scrapes the
metrics port before and after its requests and checks that each series moved
by what the request implies: token counts come from the tokenizer and from
the prompt the producer received, never from the filter's own output.
"""

from __future__ import annotations

import http.server
import json
import re
import threading
import urllib.request
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from derender.extproc import health as derender_health
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from stack import (
    DERENDER,
    Proc,
    free_port,
    http_get,
    http_post,
    start_envoy,
    start_filter,
    start_layout,
    start_sim,
    wait_for,
)

IM_END = 151645
CHAT = "/v1/chat/completions"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
MODEL_FLAGS = ["--served-model-name", "qwen3", "--max-model-len", "4096"]


class Metrics:
    """Samples of one scrape, by name and labels."""

    def __init__(self, url: str) -> None:
        self.samples: dict[tuple[str, tuple], float] = {}
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                self.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value

    def get(self, name: str, **labels: str) -> float:
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}


GENAI = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "qwen3"}


def tokens(m: Metrics, kind: str, what: str = "sum") -> float:
    return m.get(f"gen_ai_client_token_usage_{what}", **GENAI, gen_ai_token_type=kind)


def requests(m: Metrics, route: str = CHAT, status: int = 200) -> float:
    return m.get("derender_requests_total", route=route, status=str(status))


class BrokenProducer:
    """A producer that answers /inference/v1/generate with fixed bytes (200): malformed or cut streams."""

    def __init__(self) -> None:
        self.stream = b""
        self.body = b""
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["content-length"])))
                streaming = bool(request.get("stream"))
                data = owner.stream if streaming else owner.body
                self.send_response(200)
                self.send_header("content-type", "text/event-stream" if streaming else "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class MetricsStack:
    def __init__(self, qwen3_dir: str, tmp: Path) -> None:
        self.script = tmp / "script.jsonl"
        self.script.write_text("")
        self.procs: list[Proc] = []
        self.broken: BrokenProducer | None = None
        try:
            sim, self.sim_url = start_sim(qwen3_dir, "--mode", "script", "--script", str(self.script))
            self.procs.append(sim)
            self.metrics_port = free_port()
            flt, self.filter_port = start_filter(
                ["--model", qwen3_dir, *MODEL_FLAGS, "--metrics-port", str(self.metrics_port), "--workers", "2"],
                self.sim_url,
            )
            self.filter = flt
            self.procs.append(flt)
            envoy, self.envoy_url = start_envoy(self.filter_port, self.sim_url)
            self.procs.append(envoy)
        except Exception:
            self.stop()
            raise

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def scrape(self) -> Metrics:
        return Metrics(self.metrics_url)

    def settled(self, check, what: str) -> Metrics:
        """Scrape until ``check(metrics)`` holds, then once more, and return that last scrape.

        The filter records a request when its ext_proc stream closes: histograms first,
        the request counter last. A scrape is not one snapshot: the pooled metrics are
        read file by file (one per worker and kind, in directory order), so the scrape
        that first shows the counter may have read the histograms before they were
        written. One started after the counter was seen holds every write before it.
        """
        wait_for(lambda: check(self.scrape()), what)
        return self.scrape()

    def set_script(self, *choices: dict) -> None:
        self.script.write_text("".join(json.dumps(c) + "\n" for c in choices))

    def sim_config(self, **knobs) -> None:
        defaults = {"mode": "script", "tokens_per_event": 1, "delay": 0.0, "finish_only_tail": False,
                    "split_writes": 1, "error_after": None, "http_error": None}
        status, body = http_post(self.sim_url + "/sim/config", {**defaults, **knobs})
        assert status == 200, body

    def prompt_ids(self) -> list[int]:
        return json.loads(http_get(self.sim_url + "/sim/requests")[1])[-1]["token_ids"]

    def broken_envoy(self) -> tuple[BrokenProducer, str]:
        """The same filter behind a second Envoy whose producer is ``BrokenProducer``."""
        if self.broken is None:
            self.broken = BrokenProducer()
            envoy, self.broken_url = start_envoy(self.filter_port, self.broken.url)
            self.procs.append(envoy)
        return self.broken, self.broken_url

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        if self.broken is not None:
            self.broken.close()


@pytest.fixture(scope="module")
def stack(qwen3_dir, tmp_path_factory):
    s = MetricsStack(qwen3_dir, tmp_path_factory.mktemp("metrics"))
    yield s
    s.stop()


@pytest.fixture()
def ms(stack):
    stack.sim_config()
    yield stack
    stack.sim_config()


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def chat(base: str, stream: bool, content: str = "hi", headers: dict | None = None, **extra) -> httpx.Response:
    body = {"model": "qwen3", "messages": [{"role": "user", "content": content}], "stream": stream, **extra}
    return httpx.post(base + CHAT, json=body, headers=headers or {}, timeout=60)


# -- counters and histograms ----------------------------------------------------------------------
def test_streaming_request(ms, qwen3_tokenizer):
    ids = encode(qwen3_tokenizer, "The metrics count every token, once.")
    ms.set_script({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    before = ms.scrape()
    r = chat(ms.envoy_url, stream=True)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    after = ms.settled(lambda m: requests(m) > requests(before), "the request counted")
    prompt = ms.prompt_ids()

    assert requests(after) - requests(before) == 1
    assert tokens(after, "input") - tokens(before, "input") == len(prompt)
    assert tokens(after, "output") - tokens(before, "output") == len(ids) + 1
    assert tokens(after, "input", "count") - tokens(before, "input", "count") == 1
    assert tokens(after, "output", "count") - tokens(before, "output", "count") == 1
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    assert after.get(ttft, **GENAI) - before.get(ttft, **GENAI) == 1
    duration = "gen_ai_client_operation_duration_seconds_count"
    assert after.get(duration, **GENAI, error_type="") - before.get(duration, **GENAI, error_type="") == 1
    per_message = "derender_ext_proc_message_duration_seconds_count"
    for message in ("request_headers", "request_body", "response_headers"):
        assert after.get(per_message, message=message) - before.get(per_message, message=message) == 1, message
    assert after.get(per_message, message="response_body") - before.get(per_message, message="response_body") >= 1
    assert after.get("derender_producer_errors_total", type="status") == before.get("derender_producer_errors_total", type="status")


def test_non_streaming_request(ms, qwen3_tokenizer):
    ids = encode(qwen3_tokenizer, "One body, all at once.")
    ms.set_script({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    before = ms.scrape()
    r = chat(ms.envoy_url, stream=False)
    assert r.status_code == 200
    after = ms.settled(lambda m: requests(m) > requests(before), "the request counted")
    assert requests(after) - requests(before) == 1
    assert tokens(after, "input") - tokens(before, "input") == len(ms.prompt_ids())
    assert tokens(after, "output") - tokens(before, "output") == len(ids) + 1
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    assert after.get(ttft, **GENAI) == before.get(ttft, **GENAI)  # streaming only
    per_message = "derender_ext_proc_message_duration_seconds_count"
    assert after.get(per_message, message="response_body") - before.get(per_message, message="response_body") == 1


def test_active_streams_while_a_stream_runs(ms, qwen3_tokenizer):
    ids = encode(qwen3_tokenizer, "word " * 200)
    ms.set_script({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    ms.sim_config(delay=0.02)
    ms.settled(lambda m: m.get("derender_active_streams") == 0, "no stream in progress")
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", ms.envoy_url + CHAT, json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert ms.scrape().get("derender_active_streams") == 1
        for _ in lines:
            pass
    ms.settled(lambda m: m.get("derender_active_streams") == 0, "no stream in progress")


def test_requests_by_route_and_status(ms):
    before = ms.scrape()
    assert httpx.post(ms.envoy_url + CHAT, content=b"{not json", headers={"content-type": "application/json"}, timeout=30).status_code == 400
    assert chat(ms.envoy_url, stream=False, model="gpt-4").status_code == 404
    assert httpx.get(ms.envoy_url + "/v1/models", timeout=30).status_code == 200
    path = f"/no/such/{uuid.uuid4().hex}"
    assert httpx.get(ms.envoy_url + path, timeout=30).status_code == 404
    assert httpx.get(ms.envoy_url + CHAT, timeout=30).status_code == 405

    expected = {(CHAT, 400): 1, (CHAT, 404): 1, ("/v1/models", 200): 1, ("other", 404): 1, (CHAT, 405): 1}
    after = ms.settled(
        lambda m: all(requests(m, r, s) - requests(before, r, s) >= n for (r, s), n in expected.items()), "five requests"
    )
    for (route, status), n in expected.items():
        assert requests(after, route, status) - requests(before, route, status) == n, (route, status)
    assert not any(path in dict(labels).get("route", "") for _, labels in after.samples)
    # Refused before the producer: no tokens, no producer errors.
    assert tokens(after, "input", "count") == tokens(before, "input", "count")


def test_producer_http_error(ms, qwen3_tokenizer):
    ms.set_script({"index": 0, "token_ids": encode(qwen3_tokenizer, "x") + [IM_END], "finish_reason": "stop"})
    ms.sim_config(http_error=503)
    before = ms.scrape()
    assert chat(ms.envoy_url, stream=True).status_code == 503
    after = ms.settled(lambda m: requests(m, status=503) > requests(before, status=503), "the 503 counted")
    errors = "derender_producer_errors_total"
    assert after.get(errors, type="status") - before.get(errors, type="status") == 1
    duration = "gen_ai_client_operation_duration_seconds_count"
    key = dict(**GENAI, error_type="producer_status")
    assert after.get(duration, **key) - before.get(duration, **key) == 1
    assert tokens(after, "output", "count") == tokens(before, "output", "count")


def test_producer_error_mid_stream(ms, qwen3_tokenizer):
    ms.set_script({"index": 0, "token_ids": encode(qwen3_tokenizer, "alpha beta gamma delta") + [IM_END]})
    ms.sim_config(error_after=2)
    before = ms.scrape()
    r = chat(ms.envoy_url, stream=True)
    assert r.status_code == 200 and '"error"' in r.text
    after = ms.settled(lambda m: requests(m) > requests(before), "the request counted")
    errors = "derender_producer_errors_total"
    assert after.get(errors, type="error") - before.get(errors, type="error") == 1
    assert after.get("derender_parser_errors_total", source="stream") == before.get("derender_parser_errors_total", source="stream")


@pytest.mark.parametrize(
    "stream, producer_bytes, counter, label, status",
    [
        (True, b"data: {not json}\n\ndata: [DONE]\n\n", "derender_parser_errors_total", ("source", "stream"), 200),
        (True, b"data: {\"request_id\": \"r\", \"choices\": \"many\"}\n\n", "derender_parser_errors_total", ("source", "stream"), 200),
        (False, b"{\"choices\": 7}", "derender_parser_errors_total", ("source", "response"), 502),
        (True, b"data: {\"request_id\": \"r\", \"choices\": [{\"index\": 0, \"token_ids\": [9707]}]}\n\ndata: [DONE]\n\n",
         "derender_producer_errors_total", ("type", "incomplete"), 200),
    ],
    ids=["not-json", "bad-shape", "bad-body", "ends-unfinished"],
)
def test_unusable_producer_output(ms, stream, producer_bytes, counter, label, status):
    broken, base = ms.broken_envoy()
    broken.stream = broken.body = producer_bytes
    before = ms.scrape()
    r = chat(base, stream=stream)
    assert r.status_code == status
    after = ms.settled(lambda m: requests(m, status=status) > requests(before, status=status), "the request counted")
    assert after.get(counter, **dict([label])) - before.get(counter, **dict([label])) == 1


# -- request log ----------------------------------------------------------------------------------
def _log_fields(line: str) -> dict:
    """``key=value`` fields after the message, values as the text format writes them."""
    fields = {}
    for key, value in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line.split(": chat ", 1)[1]):
        fields[key] = json.loads(value) if value[0] in '"[{' or value in ("true", "false", "null") or value[0].isdigit() else value
    return fields


def test_one_log_line_per_request_without_text(ms, qwen3_tokenizer):
    secret = f"tell nobody {uuid.uuid4().hex}"
    answer = f"answer {uuid.uuid4().hex}"
    ids = encode(qwen3_tokenizer, answer)
    ms.set_script({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    x_request_id = f"log-{uuid.uuid4().hex}"
    before = ms.scrape()
    assert chat(ms.envoy_url, stream=True, content=secret, headers={"x-request-id": x_request_id}).status_code == 200
    ms.settled(lambda m: requests(m) > requests(before), "the request counted")
    lines = wait_for(
        lambda: [line for line in ms.filter.log.read_text().splitlines() if x_request_id in line], "the request's log line"
    )
    assert len(lines) == 1
    fields = _log_fields(lines[0])
    assert fields["x_request_id"] == x_request_id and fields["request_id"].startswith("chatcmpl-")
    assert (fields["model"], fields["status"], fields["stream"], fields["complete"]) == ("qwen3", 200, True, True)
    assert fields["prompt_tokens"] == len(ms.prompt_ids()) and fields["completion_tokens"] == len(ids) + 1
    assert fields["duration_ms"] >= fields["ttft_ms"] >= fields["producer_headers_ms"] >= fields["render_ms"] > 0
    assert fields["producer_headers_ms"] >= fields["body_ms"] >= 0
    log = ms.filter.log.read_text()
    assert secret not in log and answer not in log


@pytest.fixture(scope="module")
def prompt_logging(stack, qwen3_dir):
    """A second filter (one worker) with --log-prompts and JSON logs, behind its own Envoy."""
    port = free_port()
    flt = Proc(
        "filter-log-prompts",
        [*DERENDER, "--log-format", "json", "serve", "--model", qwen3_dir, *MODEL_FLAGS,
         "--workers", "1", "--log-prompts", "--port", str(port), "--producer", stack.sim_url],
    ).start()
    try:
        flt.wait(lambda: derender_health.check(f"127.0.0.1:{port}", timeout=1), 240)
        envoy, base = start_envoy(port, stack.sim_url)
    except Exception:
        flt.stop()
        raise
    yield flt, base
    envoy.stop()
    flt.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_log_prompts_flag_logs_the_text_as_json(ms, prompt_logging, qwen3_tokenizer, stream):
    flt, base = prompt_logging
    answer = f"the answer is {uuid.uuid4().hex}"
    ids = encode(qwen3_tokenizer, answer)
    ms.set_script({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    question = f"what is it? {uuid.uuid4().hex}"
    x_request_id = f"prompts-{uuid.uuid4().hex}"
    assert chat(base, stream=stream, content=question, headers={"x-request-id": x_request_id}).status_code == 200
    line = wait_for(
        lambda: next((x for x in flt.log.read_text().splitlines() if x_request_id in x and '"message": "chat"' in x), None),
        "the request's log line",
    )
    record = json.loads(line)
    assert record["logger"] == "derender.chat" and record["status"] == 200 and record["stream"] is stream
    assert record["prompt"] == [{"role": "user", "content": question}]
    assert record["completion"] == [qwen3_tokenizer.decode(ids)]


# -- health ----------------------------------------------------------------------------------------
def test_grpc_health_service_answers_serving(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.filter_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", EXT_PROC_SERVICE):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert derender_health.main([f"127.0.0.1:{stack.filter_port}"]) == 0
    assert derender_health.main([f"127.0.0.1:{free_port()}"]) == 1


class CountingHealth(health.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def Check(self, request, context):
        self.checks += 1
        return super().Check(request, context)


@pytest.fixture()
def not_serving():
    """A gRPC server whose health service says NOT_SERVING (its port accepts connections)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = CountingHealth()
    for service in ("", EXT_PROC_SERVICE):
        servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, servicer
    server.stop(None)


def test_envoy_health_check_keeps_a_not_serving_replica_out(ms, not_serving, qwen3_tokenizer):
    """envoy/replicas.yaml with two replicas: the filter, and a server that is up but NOT_SERVING."""
    not_serving, fake = not_serving
    envoy, listen, admin = start_layout(
        "replicas", {"derender": [ms.filter_port, not_serving], "producer": [int(ms.sim_url.rsplit(":", 1)[1])]},
        wait_ready=False)
    try:
        def flags() -> dict[int, str]:
            text = http_get(f"http://127.0.0.1:{admin}/clusters", timeout=2)[1].decode()
            found = dict(re.findall(r"^derender::127\.0\.0\.1:(\d+)::health_flags::(\S+)$", text, re.MULTILINE))
            return {int(k): v for k, v in found.items()}

        def checks() -> dict[str, int]:
            url = f"http://127.0.0.1:{admin}/stats?filter=^cluster\\.derender\\.health_check\\."
            text = http_get(url, timeout=2)[1].decode()
            return {k: int(v) for k, v in re.findall(r"health_check\.(\w+): (\d+)", text)}

        # Hosts start as failed until checked, and checks of a cluster without traffic come
        # 60 s apart: wait for the first round. Only the filter can succeed, so one success and
        # one failure mean both answered, the fake with NOT_SERVING (a TCP check would pass it).
        envoy.wait(lambda: fake.checks >= 1 and _quiet(lambda: (c := checks()) and c["success"] >= 1 and c["failure"] >= 1), 60)
        states = flags()
        assert states[ms.filter_port] == "healthy"
        assert states[not_serving] == "/failed_active_hc"
        # Every request goes to the replica that is SERVING (the other one would answer UNIMPLEMENTED: a 502).
        ids = encode(qwen3_tokenizer, "routed")
        ms.set_script({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
        for stream in (True, False, True, False):
            r = chat(f"http://127.0.0.1:{listen}", stream=stream)
            assert r.status_code == 200, r.text
    finally:
        envoy.stop()


def _quiet(check):
    try:
        return check()
    except OSError:
        return None



def test_busy_ratio_is_cpu_over_wall_time_of_the_last_window():
    """The busy ratio's arithmetic, on given clocks: thread CPU time over wall time, over the last
    10 s of ticks (the oldest tick kept is the last one at least 10 s back)."""
    from derender.ops.loopwatch import LoopWatch

    watch = LoopWatch(window=10.0)
    ratios = [watch.sample(0.0, wall=w, cpu=c) for w, c in [(0, 0), (5, 2.5), (10, 5), (15, 10), (20, 10), (30, 10)]]
    assert ratios == [0.0, 0.5, 0.5, 0.75, 0.5, 0.0]


def test_event_loop_saturation_signal_per_worker(ms):
    """Each worker's loop reports its busy ratio (one gauge per worker, by pid) and the lateness of
    its ticks (one histogram for all workers): ticks keep coming, ten a second per worker."""
    import psutil

    workers = {str(p.pid) for p in psutil.Process(ms.filter.proc.pid).children()}
    assert len(workers) >= 2
    lag = "derender_event_loop_lag_seconds_count"

    def busy(m: Metrics) -> dict[str, float]:
        return {dict(labels)["pid"]: value for (name, labels), value in m.samples.items()
                if name == "derender_event_loop_busy_ratio"}

    before = ms.scrape()
    after = ms.settled(lambda m: m.get(lag) >= before.get(lag) + 10 * len(workers) and set(busy(m)) == workers,
                       "every worker ticking")
    assert all(0.0 <= v <= 1.0 for v in busy(after).values()), busy(after)
    assert after.get("derender_event_loop_lag_seconds_bucket", le="+Inf") == after.get(lag)


@pytest.mark.parametrize("path, operation", [("/v1/messages", "messages"), ("/v1/responses", "responses")])
def test_agent_endpoints_are_counted_and_logged_as_their_operation(ms, qwen3_tokenizer, path, operation):
    """The chat path's metrics and request log, for Anthropic Messages and OpenAI Responses."""
    ids = encode(qwen3_tokenizer, "Counted as its own operation.")
    ms.set_script({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    labels = {"gen_ai_operation_name": operation, "gen_ai_request_model": "qwen3"}
    x_request_id = f"{operation}-{uuid.uuid4().hex}"
    body = ({"model": "qwen3", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            if operation == "messages" else {"model": "qwen3", "input": "hi", "stream": True})
    before = ms.scrape()
    r = httpx.post(ms.envoy_url + path, json=body, headers={"x-request-id": x_request_id}, timeout=60)
    assert r.status_code == 200
    after = ms.settled(lambda m: requests(m, path) > requests(before, path), "the request counted")
    ttft = "gen_ai_server_time_to_first_token_seconds_count"
    usage = "gen_ai_client_token_usage_sum"
    assert after.get(usage, **labels, gen_ai_token_type="input") - before.get(usage, **labels, gen_ai_token_type="input") == len(ms.prompt_ids())
    assert after.get(usage, **labels, gen_ai_token_type="output") - before.get(usage, **labels, gen_ai_token_type="output") == len(ids) + 1
    assert after.get(ttft, **labels) - before.get(ttft, **labels) == 1
    lines = wait_for(lambda: [line for line in ms.filter.log.read_text().splitlines() if x_request_id in line],
                     "the request's log line")
    assert len(lines) == 1 and f": {operation} " in lines[0]
    assert "status=200" in lines[0] and "stream=true" in lines[0] and f"completion_tokens={len(ids) + 1}" in lines[0]


# -- a client leaving: after the last event (served whole) or before it (cancelled) ---------------
# Each API's request and the line of its stream's last event (what the client waits for).
LEAVING = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
             lambda line: line == "data: [DONE]"),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64},
                 lambda line: line == "event: message_stop"),
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 64, "store": False},
                  lambda line: line == "event: response.completed"),
}


def _request_line(stack: MetricsStack, x_request_id: str) -> dict:
    """The filter's one log line of a request, as fields (any endpoint)."""
    line = wait_for(lambda: next((x for x in stack.filter.log.read_text().splitlines() if f"x_request_id={x_request_id}" in x), None),
                    "the request's log line")
    fields = {}
    for key, value in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line.split(": ", 1)[1]):
        fields[key] = json.loads(value) if value[0] in '"[{' or value in ("true", "false", "null") or value[0].isdigit() else value
    return fields


@pytest.mark.parametrize("leaves", ["after the last event", "mid-stream"])
@pytest.mark.parametrize("api", list(LEAVING))
def test_a_client_leaving_after_the_last_event_was_served_whole(ms, qwen3_tokenizer, api, leaves):
    """Codex closes its connection right after ``response.completed``, often before the producer's
    body has ended: that client got everything, and is logged and counted so, its producer request
    left alone. A client leaving before the last event is cancelled, and its producer request aborted.
    The producer holds each request (after its last token and usage, before ``[DONE]``; or after
    2 events) until the client has gone, so the order is certain."""
    ids = encode(qwen3_tokenizer, "A whole answer, every word of it sent.")
    ms.set_script({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    ms.sim_config(hold_after="end" if leaves == "after the last event" else 2)
    path, body, last = LEAVING[api]
    operation = api
    x_request_id = f"leave-{uuid.uuid4().hex}"
    before = ms.scrape()
    lines = []
    with httpx.stream("POST", ms.envoy_url + path, json={"model": "qwen3", "stream": True, **body},
                      headers={"x-request-id": x_request_id}, timeout=60) as r:
        assert r.status_code == 200
        if leaves == "mid-stream":
            wait_for(lambda: json.loads(http_get(ms.sim_url + "/sim/stats")[1])["held"], "the producer holding it")
        else:
            for line in r.iter_lines():
                lines.append(line)
                if last(line):
                    break
            assert last(lines[-1]), lines
            assert json.loads(http_get(ms.sim_url + "/sim/stats")[1])["held"]  # the producer's body is not over
    fields = _request_line(ms, x_request_id)
    engine = f"generate-tokens-{x_request_id}"
    duration = "gen_ai_client_operation_duration_seconds_count"
    labels = {"gen_ai_operation_name": operation, "gen_ai_request_model": "qwen3"}
    error_type = "" if leaves == "after the last event" else "cancelled"
    after = ms.settled(lambda m: m.get(duration, **labels, error_type=error_type)
                       > before.get(duration, **labels, error_type=error_type), "the request counted")
    other = "cancelled" if error_type == "" else ""
    assert after.get(duration, **labels, error_type=other) == before.get(duration, **labels, error_type=other)
    assert fields["stream"] is True and fields["status"] == 200
    if leaves == "after the last event":
        assert (fields["complete"], fields["error"]) == (True, None), fields
        assert fields["completion_tokens"] == len(ids) + 1
        # A later request, served whole, and still no abort of this one: nothing was left to abort.
        ms.sim_config()
        assert chat(ms.envoy_url, stream=True).status_code == 200
        assert engine not in json.loads(http_get(ms.sim_url + "/sim/aborted")[1])
    else:
        assert (fields["complete"], fields["error"]) == (False, "cancelled"), fields
        wait_for(lambda: engine in json.loads(http_get(ms.sim_url + "/sim/aborted")[1]), "the producer request aborted")


@pytest.mark.parametrize("api", list(LEAVING))
def test_a_refused_streaming_request_is_logged_as_streaming(ms, api):
    """A 400 on a ``stream: true`` body: its log line says what the client asked for."""
    path, body, _ = LEAVING[api]
    x_request_id = f"refused-{uuid.uuid4().hex}"
    bad = {**body, "temperature": "very hot"}
    r = httpx.post(ms.envoy_url + path, json={"model": "qwen3", "stream": True, **bad},
                   headers={"x-request-id": x_request_id}, timeout=60)
    assert r.status_code == 400, r.text
    fields = _request_line(ms, x_request_id)
    assert (fields["status"], fields["stream"]) == (400, True), fields
