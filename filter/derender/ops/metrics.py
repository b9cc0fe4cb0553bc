"""Prometheus metrics of the filter, served on their own HTTP port (``--metrics-port``).

Names follow the OpenTelemetry GenAI semantic conventions where one fits, as
an OpenTelemetry-to-Prometheus exporter would spell them (dots become
underscores, the unit is appended): ``gen_ai.client.token.usage`` ->
``gen_ai_client_token_usage``. The filter is the producer's client, and the
OpenAI server its clients see, hence ``client`` for tokens and duration and
``server`` for time to first token. The rest are the filter's own
(``derender_*``). Bucket boundaries are the ones the conventions advise.

``derender serve --workers N`` forks N processes: their metrics meet in files
(prometheus-client's multiprocess mode, ``PROMETHEUS_MULTIPROC_DIR``, which
``cli`` sets before anything imports prometheus-client), and whichever worker
binds the metrics port first serves the sum of all of them.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    multiprocess,
    start_http_server,
)

log = logging.getLogger("derender.metrics")

MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
REGISTRY = CollectorRegistry(auto_describe=True)
if not MULTIPROCESS:
    ProcessCollector(registry=REGISTRY)  # one process: its CPU and memory too
_listen: tuple[str, int] | None = None

_GENAI = ["gen_ai_operation_name", "gen_ai_request_model"]

TOKEN_USAGE = Histogram(
    "gen_ai_client_token_usage",
    "Tokens per request (gen_ai.client.token.usage): input = prompt, output = tokens received from the producer",
    [*_GENAI, "gen_ai_token_type"],
    buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864),
    registry=REGISTRY,
)
OPERATION_DURATION = Histogram(
    "gen_ai_client_operation_duration_seconds",
    "From the request's headers at the filter to the end of its response (gen_ai.client.operation.duration)",
    [*_GENAI, "error_type"],
    buckets=(0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92),
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "gen_ai_server_time_to_first_token_seconds",
    "Streaming: from the request's headers at the filter to the first response event with tokens "
    "(gen_ai.server.time_to_first_token, as the filter sees it)",
    _GENAI,
    buckets=(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    registry=REGISTRY,
)
ACTIVE_STREAMS = Gauge(
    "derender_active_streams",
    "ext_proc streams in progress (one per HTTP request through Envoy)",
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
REQUESTS = Counter(
    "derender_requests",
    "Requests by route and the HTTP status the client got (route 'other': paths the filter does not serve; "
    "status 0: the client left before a response started)",
    ["route", "status"],
    registry=REGISTRY,
)
MESSAGE_DURATION = Histogram(
    "derender_ext_proc_message_duration_seconds",
    "Time the filter adds per ext_proc message: from its arrival to the filter's answer",
    ["message"],
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    registry=REGISTRY,
)
PRODUCER_ERRORS = Counter(
    "derender_producer_errors",
    "Requests the producer failed: status (an error HTTP status, Envoy's 503 for an unreachable producer "
    "included), error (an error reported in its output), incomplete (its stream ended before every choice finished)",
    ["type"],
    registry=REGISTRY,
)
PARSER_ERRORS = Counter(
    "derender_parser_errors",
    "Requests whose producer output the filter could not turn into an OpenAI response: "
    "stream (SSE framing, event JSON or shape, or vLLM's output parsers), response (a non-streaming body)",
    ["source"],
    registry=REGISTRY,
)


class _PooledCollector(multiprocess.MultiProcessCollector):
    """The workers' files, summed; a file caught at its creation is read again.

    A worker creates its file for a metric kind on its first write: for a moment
    the file is empty, and prometheus-client's reader fails on it (``struct.error``),
    which would answer that scrape with a 500.
    """

    def collect(self):
        for _ in range(2):
            try:
                return super().collect()
            except struct.error:
                time.sleep(0.01)
        return super().collect()


_loop_busy: Gauge | None = None


def loop_busy() -> Gauge:
    """The busy-ratio gauge, made on first use: in the worker, so that the supervisor (which
    forks the workers and runs no loop of streams) has no series of its own."""
    global _loop_busy
    if _loop_busy is None:
        _loop_busy = Gauge(
            "derender_event_loop_busy_ratio",
            "Per worker (pid): share of the last 10 s its event loop's thread spent on the CPU; near 1 the "
            "worker is saturated",
            registry=REGISTRY,
            multiprocess_mode="liveall",
        )
    return _loop_busy


LOOP_LAG = Histogram(
    "derender_event_loop_lag_seconds",
    "How late a tick scheduled every 0.1 s on a worker's event loop runs (all workers)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
    registry=REGISTRY,
)


def configure(host: str, port: int | None) -> None:
    """Where ``start_server`` listens; no port, no metrics server."""
    global _listen
    _listen = (host, port) if port else None


def enabled() -> bool:
    """Whether anyone can read the metrics (a ``--metrics-port`` was given)."""
    return _listen is not None


def start_server() -> bool:
    """Serve ``/metrics`` from a background thread of this process, if configured.

    With several workers each one calls this; the first to bind the port serves
    them all, the others find it taken. Returns whether this process serves.
    """
    if _listen is None:
        return False
    host, port = _listen
    registry = REGISTRY
    if MULTIPROCESS:
        registry = CollectorRegistry()
        _PooledCollector(registry)
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError:
        if MULTIPROCESS:
            return False
        raise
    log.info("metrics on http://%s:%d/metrics", host, port)
    return True


def chat_done(
    operation: str,
    model: str,
    *,
    prompt_tokens: int | None,
    completion_tokens: int | None,
    duration: float,
    time_to_first_token: float | None,
    error_type: str = "",
) -> None:
    """Record one finished operation (``chat``, ``text_completion``) that reached the producer."""
    labels = (operation, model)
    if prompt_tokens is not None:
        TOKEN_USAGE.labels(*labels, "input").observe(prompt_tokens)
    if completion_tokens is not None:
        TOKEN_USAGE.labels(*labels, "output").observe(completion_tokens)
    OPERATION_DURATION.labels(*labels, error_type).observe(duration)
    if time_to_first_token is not None:
        TIME_TO_FIRST_TOKEN.labels(*labels).observe(time_to_first_token)


_ROUTED = ["routing", "route", "replica"]
ROUTED_REQUESTS = Counter(
    "derender_routed_requests",
    "Producer requests by routing mode, decision (prefix: key; precise: match, bound, key) and the replica "
    "Envoy reached ('' if none answered)",
    _ROUTED,
    registry=REGISTRY,
)
ROUTED_PROMPT_TOKENS = Counter(
    "derender_routed_prompt_tokens", "Prompt tokens of those requests", _ROUTED, registry=REGISTRY
)
ROUTED_CACHED_TOKENS = Counter(
    "derender_routed_cached_prompt_tokens",
    "Of those, the tokens the replica found in its prefix cache, as its usage reports them (producers run "
    "with --enable-prompt-tokens-details; streams only when the client asked for usage)",
    _ROUTED,
    registry=REGISTRY,
)


def routed(
    mode: str,
    route: str,
    replica: str | None,
    prompt_tokens: int,
    cached_tokens: int | None,
    predicted_tokens: int = 0,
) -> None:
    """One routed producer request, once it is over."""
    labels = (mode, route, replica or "")
    ROUTED_REQUESTS.labels(*labels).inc()
    ROUTED_PROMPT_TOKENS.labels(*labels).inc(prompt_tokens)
    if predicted_tokens:
        ROUTED_PREDICTED_TOKENS.labels(*labels).inc(predicted_tokens)
    if cached_tokens:
        ROUTED_CACHED_TOKENS.labels(*labels).inc(cached_tokens)


ROUTED_PREDICTED_TOKENS = Counter(
    "derender_routed_predicted_cached_tokens",
    "Prompt tokens the routing expected the chosen replica to hold (kv-events, precise: matched blocks); "
    "beside derender_routed_cached_prompt_tokens, the index's accuracy",
    _ROUTED,
    registry=REGISTRY,
)


DEFENCES = Counter(
    "derender_ext_proc_defences",
    "Times a bound of the ext_proc port's HTTP/2 server acted, by defence (docs/operations.md, 'The ext_proc "
    "port'): max_streams, rapid_reset, message_size, buffer_full, control_flood, read_paused, settings_flood, "
    "priority_flood, window_update_flood, empty_frames, continuation_flood, header_list_size, frame_size, "
    "protocol_error, stream_error, preface_timeout, settings_timeout, idle_timeout, keepalive_timeout, "
    "max_connections",
    ["defence"],
    registry=REGISTRY,
)


def defence(name: str) -> None:
    """A defence of the ext_proc port acted (``extproc.http2.Server.on_defence``)."""
    DEFENCES.labels(name).inc()


PROMPT_MEMO_TOKENS = Counter(
    "derender_prompt_memo_tokens",
    "Tokens of prompts of 500+ characters by where their ids came from: held (the prefix memo kept them "
    "from an earlier request to this worker) or tokenized",
    ["source"],
    registry=REGISTRY,
)


def prompt_memo(held: int, tokenized: int) -> None:
    """A long prompt went through the prefix memo (``translate.prefixmemo.PrefixMemo.observe``)."""
    if held:
        PROMPT_MEMO_TOKENS.labels("held").inc(held)
    PROMPT_MEMO_TOKENS.labels("tokenized").inc(tokenized)


def producer_error(kind: str) -> None:
    PRODUCER_ERRORS.labels(kind).inc()


def parser_error(source: str) -> None:
    PARSER_ERRORS.labels(source).inc()


_MESSAGE_HISTOGRAMS: dict[str, Any] = {}  # MESSAGE_DURATION's child per message kind


def _header(headers: Any, name: str) -> str:
    for h in headers.headers.headers:
        if h.key == name:
            return h.raw_value.decode("latin-1") if h.raw_value else h.value
    return ""


class StreamObserver:
    """Watches one ext_proc stream from outside the servicer.

    ``received`` sees each incoming message, ``answered`` each reply: the
    time between the two is what the filter added to that message. The route
    is the request's path; the status is the one the client got (an immediate
    reply, a ``:status`` the filter set, or the producer's).
    """

    def __init__(self) -> None:
        self.path = ""
        self.status = 0
        self._refused_at_headers = False
        self._kind = "unknown"
        self._received = time.perf_counter()
        ACTIVE_STREAMS.inc()

    def received(self, message: Any) -> None:
        """Envoy sent ``message``; the reply that ``answered`` sees next is to it."""
        self._kind = message.WhichOneof("request") or "unknown"
        self._received = time.perf_counter()
        if self._kind == "request_headers":
            self.path = _header(message.request_headers, ":path").split("?", 1)[0]
        elif self._kind == "response_headers":
            self.status = int(_header(message.response_headers, ":status") or 0)

    def answered(self, response: Any) -> None:
        elapsed = time.perf_counter() - self._received
        histogram = _MESSAGE_HISTOGRAMS.get(self._kind)
        if histogram is None:
            histogram = _MESSAGE_HISTOGRAMS[self._kind] = MESSAGE_DURATION.labels(self._kind)
        histogram.observe(elapsed)
        if isinstance(response, bytes):  # a streamed chunk's reply in its wire form: no status in it
            return
        which = response.WhichOneof("response")
        if which == "immediate_response":
            self.status = response.immediate_response.status.code
            self._refused_at_headers = self._kind == "request_headers"
        elif which == "response_body":  # a buffered body may come with a new :status
            common = response.response_body.response
            if common.HasField("header_mutation"):
                for option in common.header_mutation.set_headers:
                    if option.header.key == ":status":
                        self.status = int(option.header.raw_value or option.header.value)

    def close(self) -> None:
        ACTIVE_STREAMS.dec()
        # The router answers 404 at once, on the headers, only for paths it does
        # not serve: those share one label, so random paths add no series.
        unknown = self.status == 404 and self._refused_at_headers
        REQUESTS.labels("other" if unknown or not self.path else self.path, str(self.status)).inc()


# -- token budgets (--quota-config): per key name (or a default key's id), never the secret -------
QUOTA_TOKENS = Counter(
    "derender_quota_tokens",
    "Tokens charged to a key's budgets, by key and kind (prompt, completion)",
    ["key", "kind"],
    registry=REGISTRY,
)
QUOTA_REFUSALS = Counter(
    "derender_quota_refusals",
    "Requests refused (429) by a key's budget, by key and limit",
    ["key", "limit"],
    registry=REGISTRY,
)
QUOTA_CUTS = Counter(
    "derender_quota_cuts", "Streams ended mid-way at a key's budget, by key", ["key"], registry=REGISTRY
)
QUOTA_REDIS_ERRORS = Counter(
    "derender_quota_redis_errors",
    "Quota checks Redis did not answer, by what the filter did (open, closed)",
    ["outcome"],
    registry=REGISTRY,
)
