"""``derender up``: Envoy + the filter (+ the simulator) on 127.0.0.1, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from .extproc import health
from .extproc.leg import resolve, unsupported
from .ops import assets, envoy_config
from .ops.children import Child, claim, free_port, http_ok
from .routeflags import flow_flags, handoff_flags
from .routing.config import ConfigError, envoy_clusters, load

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class _Stop(Exception):
    """Ctrl-C, SIGTERM or SIGHUP: the first one; the ones after it change nothing."""


class Stack:
    """Child processes started in order and stopped in reverse order (their output: our stderr).

    The first stop signal interrupts ``run`` (``_Stop``), the ones after it change nothing:
    a second Ctrl-C, or SIGTERM from make and from a supervisor, must not break off the stop
    path and leave children running. A signal while a child is being started waits until
    it is on the list, so that it is stopped too.
    """

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.stopping = False
        self._starting = False

    def on_signal(self, signum, _frame) -> None:
        if self.stopping:
            return
        self.stopping = True
        if not self._starting:
            raise _Stop()

    def start(self, name: str, argv: list[str]) -> Child:
        self._starting = True
        try:
            child = Child(name, argv).start()
            self.children.append(child)
        finally:
            self._starting = False
        if self.stopping:
            raise _Stop()
        return child

    def failed(self) -> str | None:
        for child in self.children:
            code = child.exited()
            if code is not None:
                return f"{child.name} exited with code {code}"
        return None

    def stop(self) -> None:
        # Signals from here on are already being obeyed: ignored (once ``run`` returns, the
        # interpreter would otherwise take one with the default action).
        self.stopping = True
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        for child in reversed(self.children):
            child.stop()


def model_flags(args: argparse.Namespace) -> list[str]:
    if getattr(args, "config", None):
        return ["--config", args.config]
    if getattr(args, "render_url", None):  # the render tier has the model; the simulator still uses --model
        return [
            "--render-url",
            args.render_url,
            *(["--served-model-name", *args.served_model_name] if args.served_model_name else []),
        ]
    flags = ["--model", args.model]
    if args.served_model_name:
        flags += ["--served-model-name", *args.served_model_name]
    for name in (
        "max_model_len",
        "chat_template",
        "reasoning_parser",
        "tool_call_parser",
        "default_chat_template_kwargs",
    ):
        value = getattr(args, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    if args.enable_auto_tool_choice:
        flags.append("--enable-auto-tool-choice")
    if args.enable_prompt_tokens_details:
        flags.append("--enable-prompt-tokens-details")
    if getattr(args, "stream_interval", 1) != 1:
        flags += ["--stream-interval", str(args.stream_interval)]
    if getattr(args, "lora_modules", None):
        flags += ["--lora-modules", *args.lora_modules]
    for name in ("allowed_media_domains", "allowed_media_networks"):
        if getattr(args, name, None):
            flags += ["--" + name.replace("_", "-"), *getattr(args, name)]
    if getattr(args, "allowed_local_media_path", None):
        flags += ["--allowed-local-media-path", args.allowed_local_media_path]
    if getattr(args, "max_producer_body_bytes", 16 << 20) != 16 << 20:
        flags += ["--max-producer-body-bytes", str(args.max_producer_body_bytes)]
    if getattr(args, "mm_processor_cache_gb", 0.5) != 0.5:
        flags += ["--mm-processor-cache-gb", str(args.mm_processor_cache_gb)]
    return flags


# The simulated fleet's prefix cache, in 16-token blocks (~262k tokens a replica), when it models one.
SIM_CACHE_BLOCKS = 16384


def kv_events_config(pub: str, replay: str) -> str:
    """A simulator's ``--kv-events-config``: vllm serve's JSON. ``derender up`` gives each simulator
    Unix sockets in its own folder (vLLM binds ``ipc://`` endpoints; a ``tcp://HOST`` one it would
    connect to, and ``tcp://*`` would listen on every interface)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay})


def simulated_cache(args: argparse.Namespace) -> list[str]:
    """Simulator flags so that a simulated fleet shows what prefix routing is for: with several
    replicas, or ``--enable-prompt-tokens-details``, each models vLLM's prefix cache and reports
    its hits (``cached_tokens``), and the filter passes them on. ``--sim-arg`` still wins."""
    if args.replicas <= 1 and not args.enable_prompt_tokens_details:
        return []
    args.enable_prompt_tokens_details = True
    given = " ".join(args.sim_arg)
    flags = [] if "--prefix-cache-blocks" in given else ["--prefix-cache-blocks", str(SIM_CACHE_BLOCKS)]
    return flags + ([] if "--enable-prompt-tokens-details" in given else ["--enable-prompt-tokens-details"])


def run(args: argparse.Namespace) -> int:
    claim(args.port, args.filter_port)  # no child of this stack draws a port it must bind
    entries = None
    if getattr(args, "config", None):  # several models: their producers are in the file
        try:
            entries = load(args.config)
        except ConfigError as exc:
            print(f"derender: {exc}", file=sys.stderr, flush=True)
            return 1
    elif not args.model:  # the default model, served by its name as the compose stack serves it
        args.model = str(assets.fetch("qwen3"))
        args.served_model_name = args.served_model_name or ["qwen3"]
    derender = [sys.executable, "-m", "derender.cli", "--log-level", args.log_level, "--log-format", args.log_format]
    stack = Stack()
    folder: str | None = None

    for sig in STOP_SIGNALS:
        signal.signal(sig, stack.on_signal)
    try:
        producer = args.producer or (entries[0].producer_url if entries else None)
        urls = [producer] if producer else []
        if producer is None:  # the simulator: one per replica, in one producer cluster
            sim_args = [*simulated_cache(args), *args.sim_arg]
            sims = []
            events: list[tuple[str, str]] = []  # kv-events routing: each simulator's PUB and replay sockets
            if args.routing == "kv-events":
                folder = tempfile.mkdtemp(prefix="derender-up-")  # removed when the stack stops
            for i in range(max(1, args.replicas)):
                port = free_port()
                name = "simulator" if args.replicas <= 1 else f"simulator-{i + 1}"
                more = []
                if args.routing == "kv-events":
                    events.append((f"ipc://{folder}/events-{i + 1}", f"ipc://{folder}/replay-{i + 1}"))
                    more = [
                        "--kv-events-config",
                        kv_events_config(*events[-1]),
                        "--block-size",
                        str(args.prefix_block_size),
                    ]
                    more += ["--prefix-caching-hash-algo", args.prefix_caching_hash_algo]
                if args.prefill_replicas > 0:
                    more += ["--kv-role", "decode"]
                argv = [*derender, "sim", "--model", args.model, "--port", str(port), *sim_args, *more]
                sims.append((port, stack.start(name, argv)))
            prefill = []
            for i in range(max(0, args.prefill_replicas)):  # prefill producers (--kv-role prefill)
                port = free_port()
                argv = [*derender, "sim", "--model", args.model, "--port", str(port), *sim_args, "--kv-role", "prefill"]
                prefill.append((port, stack.start(f"prefill-{i + 1}", argv)))
            if prefill:
                args.prefill = ",".join(f"http://127.0.0.1:{port}" for port, _ in prefill)
            for port, sim in prefill:
                sim.wait(functools.partial(http_ok, f"http://127.0.0.1:{port}/health"), 60)
            if events:
                args.kv_events = ",".join(pub for pub, _ in events)
                args.kv_events_replay = ",".join(replay for _, replay in events)
            for port, sim in sims:
                sim.wait(functools.partial(http_ok, f"http://127.0.0.1:{port}/health"), 60)
            urls = [f"http://127.0.0.1:{port}" for port, _ in sims]
            producer = urls[0]
        producer_host, producer_port = envoy_config.split_url(producer)
        routing = [
            "--routing",
            args.routing,
            "--prefix-block-size",
            str(args.prefix_block_size),
            "--prefix-caching-hash-algo",
            args.prefix_caching_hash_algo,
            "--prefix-key-blocks",
            str(args.prefix_key_blocks),
        ]
        for flag in ("kv_events", "kv_events_replay", "kv_events_topic"):
            if getattr(args, flag, ""):
                routing += ["--" + flag.replace("_", "-"), getattr(args, flag)]

        filter_port = args.filter_port or free_port()
        workers = ["--workers", str(args.workers)] if getattr(args, "workers", None) else []
        metrics_port = getattr(args, "metrics_port", None)
        keys = [flag for key in getattr(args, "api_key", None) or () for flag in ("--api-key", key)]
        if getattr(args, "responses_store", None):
            keys += ["--responses-store", args.responses_store]
        if getattr(args, "quota_config", None):
            keys += ["--quota-config", args.quota_config]
        keys += flow_flags(args) + handoff_flags(args)
        if getattr(args, "stream_path", None):
            keys += ["--stream-path", args.stream_path]
        lacking = unsupported(entries, getattr(args, "render_url", None), getattr(args, "routing", "least-request"),
                              getattr(args, "prefill", None) or getattr(args, "prefill_replicas", 0))  # fmt: skip
        try:  # the filter's leg, and Envoy's config for it
            leg = resolve(getattr(args, "response_leg", "auto"), lacking) == "worker"
        except ValueError as exc:
            print(f"derender: {exc}", file=sys.stderr, flush=True)
            return 1
        keys += ["--response-leg", "worker" if leg else "envoy"]
        traces = getattr(args, "otlp_traces_endpoint", None)
        if traces:
            keys += ["--otlp-traces-endpoint", traces]
        filter_ports = [filter_port] + [free_port() for _ in range(max(1, getattr(args, "filters", 1)) - 1)]
        sockets: list[str] = []  # --filter-socket unix: each filter process's, in the stack's folder (0700)
        if args.filter_socket == "unix":
            folder = folder or tempfile.mkdtemp(prefix="derender-up-")  # removed when the stack stops
            sockets = [f"{folder}/ext_proc-{i + 1}.sock" for i in range(len(filter_ports))]
        filters = []
        for i, port in enumerate(filter_ports):  # --filters: filter processes as replicas, each its own
            more = ["--metrics-port", str(metrics_port + i)] if metrics_port else []  # --filters: the next ports
            more += ["--uds", sockets[i], "--no-tcp"] if sockets else []  # only this user reaches it
            flt = stack.start(
                "filter" if i == 0 else f"filter{i + 1}",
                [
                    *derender,
                    "serve",
                    *model_flags(args),
                    "--port",
                    str(port),
                    "--producer",
                    ",".join(urls),
                    *routing,
                    *workers,
                    *more,
                    *keys,
                ],
            )
            filters.append(flt)
        for i, (flt, port) in enumerate(zip(filters, filter_ports, strict=True)):  # each model loads
            address = f"unix:{sockets[i]}" if sockets else f"127.0.0.1:{port}"
            flt.wait(functools.partial(health.check, address, timeout=1), 180 * len(entries or [None]))

        clusters = ""
        if entries:
            clusters = envoy_clusters(entries, args.routing)
        elif len(urls) > 1 or args.routing != "least-request":  # local.yaml's producer cluster, balanced
            # "producer": the cluster the filter names when it serves one model (routing.clusters.DEFAULT_CLUSTER)
            clusters = "  - " + json.dumps(envoy_config.producer_cluster("producer", urls, args.routing))
        config = envoy_config.render(
            "multi.yaml" if clusters else "local.yaml",
            PRODUCER_CLUSTERS=clusters,
            LISTEN_PORT=args.port,
            ADMIN_PORT=free_port(),
            FILTER_PORT=filter_port,
            PRODUCER_HOST=producer_host,
            PRODUCER_PORT=producer_port,
            MAX_CONNECTIONS=args.max_connections,
            BODY_LIMIT_BYTES=max(16 << 20, getattr(args, "max_producer_body_bytes", 0)),
        )
        if traces or len(filter_ports) > 1 or sockets or leg:
            import yaml

            parsed = yaml.safe_load(config)
            if leg:  # requests the filter rewrote go back to its workers (extproc.leg)
                parsed = envoy_config.response_leg(parsed)
            if traces:  # Envoy's tracer too: its spans are the parents of the filter's
                parsed = envoy_config.add_tracing(parsed, traces)
            if sockets:
                parsed = envoy_config.unix_filter_endpoints(parsed, sockets)
            elif len(filter_ports) > 1:
                parsed = envoy_config.add_filter_endpoints(parsed, filter_ports)
            config = yaml.safe_dump(parsed, sort_keys=False)
        folder = folder or tempfile.mkdtemp(prefix="derender-up-")  # removed when the stack stops
        config_file = Path(folder) / "envoy.yaml"
        config_file.write_text(config)
        envoy = stack.start(
            "envoy",
            [
                envoy_config.envoy_binary(),
                "-c",
                str(config_file),
                "--concurrency",
                str(getattr(args, "envoy_threads", 1)),
                "--log-level",
                "warn",
                "--disable-hot-restart",
            ],
        )
        envoy.wait(lambda: http_ok(f"http://127.0.0.1:{args.port}/health"), 30)
        where = f"producer {producer}" if len(urls) == 1 else f"{len(urls)} producer replicas, {args.routing} routing"
        if getattr(args, "prefill", None):
            where += f", prefill {args.prefill}"
        print(f"derender: OpenAI endpoint ready at http://127.0.0.1:{args.port}/v1 ({where})", flush=True)
        while True:
            problem = stack.failed()
            if problem:
                print(f"derender: {problem}; stopping", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.3)
    except _Stop:
        return 0
    except RuntimeError as exc:
        print(f"derender: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        stack.stop()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
