"""What ``derender serve`` is told for the whole process, in one object.

``options.settings(args)`` builds it once from the flags; ``cli`` hands it to the workers, and each
part goes where it is used: the stream path and the Responses store into every ``ModelSpec`` (a
``Model`` keeps them), the stall timeout into the producer clients, the API keys into the ext_proc
processor, the drain timeout and transport into the server. No module keeps a copy, so two settings
(a test's, two models') live side by side. Logging and Prometheus metrics are the process's own
facilities and are set up apart (``ops.logs``, ``ops.metrics``).

The bottom of the package: it imports nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass

STREAM_PATHS = ("lean", "vllm")
DAY = 24 * 3600


@dataclass(frozen=True)
class Settings:
    # Chat, Messages and Responses streams: 'lean' does the middle events itself with vLLM's parsers
    # (tests/test_lean.py proves the bytes), 'vllm' runs vLLM's stream generators for every event.
    stream_path: str = "lean"
    # Seconds a streaming producer request may stay silent before it is aborted (0: never).
    stall_timeout: float = 240.0
    # Seconds open streams get after SIGTERM.
    drain_timeout: float = 30.0
    # The ext_proc server: 'http2' (the filter's own, on the event loop's thread) or 'grpcio'.
    transport: str = "http2"
    # Keys a client must present on /v1 (Authorization: Bearer), none: open.
    api_keys: tuple[str, ...] = ()
    # Stored Responses in this Redis (redis://HOST:PORT[/DB]), None: off as in vLLM; and for how long.
    responses_store: str | None = None
    responses_store_ttl: int = 30 * DAY
    # OpenTelemetry traces: the OTLP collector (None: off), and the share of new traces kept (a client's
    # or Envoy's sampled parent is followed either way).
    otlp_traces_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    # Token budgets per API key: the quota file (``ops.quota``), None: no limits.
    quota_config: str | None = None
    # Who reaches the producer and hands the filter its answer: 'envoy' (over ext_proc), or 'worker':
    # the worker that rendered the request, on a listener of its own at leg_host (``extproc.leg``).
    response_leg: str = "envoy"
    leg_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.stream_path not in STREAM_PATHS:
            raise ValueError(f"stream_path must be one of {', '.join(STREAM_PATHS)}, not {self.stream_path!r}")
        if self.transport not in ("http2", "grpcio"):
            raise ValueError(f"transport must be http2 or grpcio, not {self.transport!r}")
        if self.response_leg not in ("envoy", "worker"):  # --response-leg auto is one of them by then (cli)
            raise ValueError(f"response_leg must be envoy or worker, not {self.response_leg!r}")
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio must be between 0 and 1, not {self.trace_sample_ratio!r}")
