"""The command line's flags: what ``serve`` and ``up`` take, and the model they name (``model_spec``)."""

from __future__ import annotations

import argparse
import os

from .extproc import leg, listen, scale
from .ops import assets
from .routeflags import add_routing_arguments
from .settings import Settings


def add_model_arguments(parser: argparse.ArgumentParser, default_model: bool = False) -> None:
    """Model flags, named as ``vllm serve`` names them."""
    parser.add_argument(
        "--model",
        default=os.environ.get("DERENDER_MODEL") or None,
        help="folder with config.json, tokenizer.json and tokenizer_config.json, or a Hugging Face id "
        "(default: $DERENDER_MODEL, else the Qwen3 tokenizer fetched at set-up)",
    )
    parser.add_argument("--served-model-name", nargs="+", default=None, help="name(s) clients use (default: --model)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--chat-template", default=None, help="a chat template file or string")
    parser.add_argument("--reasoning-parser", default=None, help="vLLM reasoning parser name, e.g. qwen3, deepseek_r1")
    parser.add_argument("--tool-call-parser", default=None, help="vLLM tool parser name, e.g. hermes")
    parser.add_argument("--enable-auto-tool-choice", action="store_true", help="allow tool_choice=auto")
    parser.add_argument(
        "--default-chat-template-kwargs", default=None, help="JSON, e.g. '{\"enable_thinking\": false}'"
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens (Anthropic: cache_read_input_tokens) from the "
        "producers' own usage, as vllm serve with this flag (run the producers with it too)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="as vllm serve --lora-modules (name=path, or its JSON form): adapters served under their "
        "own names; a request naming one goes to the producer with GenerateRequest.model set to it "
        "(run the producers with the same adapters)",
    )
    parser.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="as vllm serve: a folder file:// image URLs may name (default: none may)",
    )
    parser.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="DOMAIN",
        help="as vllm serve: image URLs only from these hosts (default: any public host)",
    )
    parser.add_argument(
        "--allowed-media-networks",
        nargs="+",
        default=None,
        metavar="CIDR",
        help="networks besides public addresses that image URLs may be fetched from, e.g. "
        "10.0.0.0/8 (default: none: loopback, private, link-local and reserved addresses are "
        "refused); also with --config",
    )
    parser.add_argument(
        "--max-producer-body-bytes",
        type=int,
        default=16 << 20,
        help="a request that renders to more (images: their processed tensors) is a 413; Envoy's "
        "buffer must hold it (BODY_LIMIT_BYTES; derender up sets it to at least this; default 16 MiB); "
        "also with --config",
    )
    parser.add_argument(
        "--mm-processor-cache-gb",
        type=float,
        default=0.5,
        help="vLLM's processed-image cache per filter process (vLLM's default is 4; default 0.5)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="as vllm serve --stream-interval: streaming producer requests ask for an event every N "
        "tokens (fewer, larger events: less CPU per token, text in steps of N; default 1)",
    )


def settings(args: argparse.Namespace) -> Settings:
    """The process's ``Settings`` from ``derender serve``'s flags (a parser without them: the defaults)."""
    from .ops import auth

    defaults = Settings()
    return Settings(
        stream_path=getattr(args, "stream_path", None) or defaults.stream_path,
        stall_timeout=getattr(args, "stall_timeout", defaults.stall_timeout),
        drain_timeout=getattr(args, "drain_timeout", defaults.drain_timeout),
        transport=getattr(args, "transport", None) or defaults.transport,
        api_keys=auth.resolve(getattr(args, "api_key", None)),
        responses_store=getattr(args, "responses_store", None),
        responses_store_ttl=getattr(args, "responses_store_ttl", defaults.responses_store_ttl),
        otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None),
        trace_sample_ratio=getattr(args, "trace_sample_ratio", defaults.trace_sample_ratio),
        quota_config=getattr(args, "quota_config", None),
        response_leg=leg.mode(args) or defaults.response_leg,
        leg_host=getattr(args, "leg_host", None) or defaults.leg_host,
    )


def model_spec(args: argparse.Namespace, process: Settings | None = None):
    """The ``ModelSpec`` the model flags name, served with ``process`` (default: ``settings(args)``)."""
    from .translate.model import ModelSpec

    model = args.model or str(assets.fetch("qwen3", quiet=True))
    return ModelSpec(
        model=model,
        served_model_name=tuple(args.served_model_name or ()),
        max_model_len=args.max_model_len,
        chat_template=args.chat_template,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        stream_interval=args.stream_interval,
        lora_modules=tuple(args.lora_modules or ()),
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        allowed_media_networks=tuple(args.allowed_media_networks or ()),
        mm_processor_cache_gb=args.mm_processor_cache_gb,
        max_producer_body_bytes=args.max_producer_body_bytes,
        settings=process or settings(args),
    )


def _sample_ratio() -> float:
    try:
        return float(os.environ.get("OTEL_TRACES_SAMPLER_ARG") or 1.0)
    except ValueError:
        return 1.0


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """``derender serve``: the filter."""
    add_model_arguments(serve)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="the ext_proc port's addresses, comma-separated; a network (e.g. 172.30.90.0/24) stands "
        "for this machine's address in it (default 127.0.0.1: only Envoy on this host reaches it)",
    )
    serve.add_argument("--port", type=int, default=9002, help="gRPC port Envoy connects to")
    serve.add_argument(
        "--producer",
        default="http://127.0.0.1:8100",
        help="producer base URL, or several comma-separated (one Envoy cluster's replicas): where "
        "aborts go when Envoy has not yet named the replica it reached",
    )
    serve.add_argument(
        "--config", default=None, metavar="FILE", help="YAML file listing several models (replaces the model flags)"
    )
    add_routing_arguments(serve)
    serve.add_argument(
        "--render-url",
        default=None,
        metavar="URL",
        help="render-tier mode: vLLM's render server (vllm launch render) renders and derenders; no model is loaded",
    )
    scale.add_arguments(serve)
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("DERENDER_METRICS_PORT") or 0) or None,
        help="serve Prometheus metrics on this port at /metrics (default: none)",
    )
    serve.add_argument("--metrics-host", default=None, help="address for the metrics port (default: --host)")
    serve.add_argument(
        "--log-prompts",
        action="store_true",
        help="put prompt and completion text in the per-request log line (default: never logged)",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (repeatable; default: $DERENDER_API_KEYS, comma-separated)",
    )
    serve.add_argument(
        "--stall-timeout",
        type=float,
        default=float(os.environ.get("DERENDER_STALL_TIMEOUT") or 240),
        metavar="SECONDS",
        help="abort a streaming producer request silent this long and end the client's stream with an "
        "error event (default: 240; 0: never); keep it below Envoy's stream idle timeout (300 s)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=float(os.environ.get("DERENDER_DRAIN_TIMEOUT") or 30),
        metavar="SECONDS",
        help="on SIGTERM, refuse new streams and give open ones this long to finish (default: 30; "
        "SIGINT stops at once)",
    )
    serve.add_argument(
        "--responses-store",
        default=os.environ.get("DERENDER_RESPONSES_STORE") or None,
        metavar="URL",
        help="keep stored Responses (store, previous_response_id, GET /v1/responses/{id}) in this Redis, "
        "redis://HOST:PORT[/DB], shared by every worker and filter replica (default: $DERENDER_RESPONSES_STORE, "
        "else off as in vLLM)",
    )
    serve.add_argument(
        "--quota-config",
        default=os.environ.get("DERENDER_QUOTA_CONFIG") or None,
        metavar="FILE",
        help="token budgets per API key (YAML, docs/quotas.md), kept in Redis (the file's redis:, else "
        "--responses-store); checked at start, reloaded on SIGHUP (default: $DERENDER_QUOTA_CONFIG, else no limits)",
    )
    serve.add_argument(
        "--responses-store-ttl",
        type=int,
        default=30 * 24 * 3600,
        metavar="SECONDS",
        help="how long a stored response is kept (default: 30 days)",
    )
    serve.add_argument(
        "--stream-path",
        choices=("lean", "vllm"),
        default=os.environ.get("DERENDER_STREAM_PATH") or "lean",
        help="chat streams: 'lean' (default) does the events between the first and the last itself, with "
        "vLLM's parsers, and sends vLLM's bytes (proven by tests/test_lean.py); 'vllm' runs vLLM's chat "
        "stream generator for every event (default: $DERENDER_STREAM_PATH, else lean)",
    )
    leg.add_arguments(serve)
    serve.add_argument(
        "--transport",
        choices=("http2", "grpcio"),
        default=os.environ.get("DERENDER_TRANSPORT") or "http2",
        help="the ext_proc server: 'http2' (default) speaks gRPC's HTTP/2 on each worker's event loop thread; "
        "'grpcio' runs grpc.aio, which hands every message between three threads (default: $DERENDER_TRANSPORT, "
        "else http2)",
    )
    serve.add_argument(
        "--otlp-traces-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None,
        metavar="URL",
        help="export OpenTelemetry traces (a few spans per request) to this OTLP collector, over grpc or "
        "http/protobuf as $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says (default: "
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off)",
    )
    serve.add_argument(
        "--trace-sample-ratio",
        type=float,
        default=_sample_ratio(),
        metavar="RATIO",
        help="the share of new traces kept, 0 to 1; a sampled parent (Envoy's, a client's traceparent) is "
        "always followed (default: $OTEL_TRACES_SAMPLER_ARG, else 1)",
    )
    listen.add_arguments(serve)
    serve.add_argument(
        "--tool-parser-plugin", default=None, metavar="FILE", help="a Python file registering a vLLM tool parser"
    )
    serve.add_argument(
        "--reasoning-parser-plugin",
        default=None,
        metavar="FILE",
        help="a Python file registering a vLLM reasoning parser",
    )


def add_up_arguments(up: argparse.ArgumentParser) -> None:
    """``derender up``: Envoy, the filter and (without ``--producer``) the simulator on this machine."""
    add_model_arguments(up, default_model=True)
    up.add_argument("--port", type=int, default=8080, help="OpenAI endpoint port on 127.0.0.1")
    up.add_argument("--producer", default=None, help="producer base URL; without it the simulator runs")
    up.add_argument("--filter-port", type=int, default=0, help="ext_proc port (default: a free one)")
    up.add_argument(
        "--filter-socket",
        choices=("unix", "tcp"),
        default="unix",
        help="how Envoy reaches the filter: a Unix socket in the stack's private folder, the filter on no TCP "
        "port (the default: only this user can connect) or loopback TCP on --filter-port (any local process can)",
    )
    up.add_argument(
        "--config", default=None, metavar="FILE", help="YAML file listing several models and their producer clusters"
    )
    up.add_argument(
        "--render-url", default=None, metavar="URL", help="render-tier mode: the filter uses this vLLM render server"
    )
    up.add_argument(
        "--workers",
        type=scale.workers_flag,
        default="auto",
        help="filter processes: a number, or auto (the default: one, more as they fill, up to the CPU count)",
    )
    up.add_argument(
        "--envoy-threads",
        type=int,
        default=1,
        help="Envoy's worker threads (--concurrency; default 1: one thread keeps up with one filter worker "
        "and costs less per token than two on a few cores, docs/performance.md)",
    )
    up.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="the filter's Prometheus metrics port (default: none; with --filters N, N ports from it)",
    )
    up.add_argument(
        "--otlp-traces-endpoint",
        default=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None,
        metavar="URL",
        help="OpenTelemetry traces of Envoy and the filter to this OTLP/gRPC collector (default: "
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off)",
    )
    up.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 (repeatable; default: $DERENDER_API_KEYS)",
    )
    up.add_argument("--responses-store", default=None, metavar="URL", help="the filter's --responses-store (Redis URL)")
    up.add_argument(
        "--quota-config",
        default=None,
        metavar="FILE",
        help="the filter's --quota-config: token budgets per API key, and flow control's priority and weight",
    )
    up.add_argument(
        "--stream-path",
        choices=("lean", "vllm"),
        default=None,
        help="the filter's --stream-path (default: its default, lean)",
    )
    up.add_argument(
        "--response-leg",
        choices=("envoy", "worker", "auto"),
        default="auto",
        help="the filter's --response-leg, and Envoy's config for it (default auto: the leg where the flags allow)",
    )
    up.add_argument("--sim-arg", action="append", default=[], help="extra flag for the simulator (repeatable)")
    up.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="simulated producer replicas in one Envoy cluster (without --producer; default 1); with "
        "several, each models vLLM's prefix cache and reports its hits (cached_tokens)",
    )
    up.add_argument(
        "--prefill-replicas",
        type=int,
        default=0,
        help="simulated prefill replicas (without --producer): the simulators split into prefill and decode "
        "(--kv-role), and the filter hands each long prompt's KV from one to the other (default 0: none)",
    )
    up.add_argument(
        "--filters",
        type=int,
        default=1,
        help="filter processes (each with --workers of its own) behind Envoy's ext_proc cluster, as filter "
        "replicas run (default 1)",
    )
    up.add_argument(
        "--max-connections",
        type=int,
        default=10000,
        help="client connections Envoy accepts at once; past it a new one is closed (default 10000)",
    )
    add_routing_arguments(up)


MODEL_FLAGS = (
    "model",
    "served_model_name",
    "max_model_len",
    "chat_template",
    "reasoning_parser",
    "tool_call_parser",
    "enable_auto_tool_choice",
    "default_chat_template_kwargs",
    "render_url",
    "enable_prompt_tokens_details",
    "lora_modules",
    "allowed_local_media_path",
    "allowed_media_domains",
)


def check_config_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--config`` replaces the model flags; with ``--render-url`` the render tier loads the model."""
    if getattr(args, "config", None):
        given = [flag for flag in MODEL_FLAGS if getattr(args, flag, None)]
        given += ["stream_interval"] if getattr(args, "stream_interval", 1) != 1 else []
        if given:
            parser.error(f"--config lists the models: drop --{given[0].replace('_', '-')}")
    elif args.command == "serve" and args.render_url and args.model:
        parser.error("--render-url: the render tier loads the model, drop --model")
