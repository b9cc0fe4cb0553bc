"""``derender``: ``serve`` (the ext_proc filter), ``sim`` (a producer simulator), ``up`` (the local stack)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import replace
from typing import Any

from . import options, routeflags
from .extproc import listen
from .ops import assets
from .options import model_spec
from .settings import Settings


def served(args: argparse.Namespace, process: Settings):
    """What ``serve`` serves: the models of ``--config``, a render tier, or one model from the flags,
    with the process's settings."""
    from .endpoints.router import Backend
    from .routing.clusters import producers
    from .routing.producer import Producer
    from .translate.model import Model

    if args.config:
        from .routing import config

        try:
            entries = config.load(args.config)
        except config.ConfigError as exc:
            raise SystemExit(f"derender: {exc}") from None
        networks = tuple(getattr(args, "allowed_media_networks", None) or ())
        limit = getattr(args, "max_producer_body_bytes", 16 << 20)
        return [
            Backend(
                e.names,
                producers(e.producer_urls, process.stall_timeout),
                e.cluster,
                Model(replace(e.spec, allowed_media_networks=networks, max_producer_body_bytes=limit, settings=process))
                if e.spec
                else None,
                e.render_url,
                e.routing,
                e.kv_events,
                e.kv_events_replay,
                e.replica_capacity,
                e.prefill,
            )
            for e in entries
        ]
    if args.render_url:
        producer = Producer(args.producer, process.stall_timeout)
        return Backend(args.served_model_name or [], producer, render_url=args.render_url)
    return Model(model_spec(args, process))


def _logging(args: argparse.Namespace) -> None:
    from .ops import logs

    logs.setup(args.log_level, args.log_format, getattr(args, "log_prompts", False))


def _kv_events(args: argparse.Namespace) -> bool:
    """Whether any served model routes by the producers' KV events (then a hub process reads them)."""
    if args.routing == "kv-events":
        return True
    if not args.config:
        return False
    from .routing import config

    try:
        return any(e.routing == "kv-events" for e in config.load(args.config))
    except config.ConfigError:
        return False  # reported where the entries are served


def _worker_counts(args: argparse.Namespace) -> tuple[int, int]:
    """Workers at start and at most: ``--workers N`` is N throughout; ``auto`` one, up to
    ``--max-workers`` as they fill (one with ``--port 0``, which workers cannot share)."""
    if args.workers != "auto":
        return args.workers, args.workers
    return 1, max(1, args.max_workers) if args.port else 1


def cmd_serve(args: argparse.Namespace) -> int:
    # Loading the model (vLLM's modules, the tokenizer, the parsers) makes millions of objects that
    # live as long as the process, and the collector would walk them over and over: about a fifth
    # of the start's CPU. It stays off until ``workers.run`` freezes them and turns it back on.
    gc.disable()
    hub = _kv_events(args)
    start, most = _worker_counts(args)
    if args.metrics_port and (most > 1 or hub) and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Forked workers (and the KV events hub) pool their metrics in files: prometheus-client reads
        # the variable at import.
        import atexit
        import shutil
        import tempfile

        os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder = tempfile.mkdtemp(prefix="derender-metrics-")
        atexit.register(shutil.rmtree, folder, True)  # the supervisor's exit (workers leave by os._exit)
        if "prometheus_client.values" in sys.modules:  # imported already (vLLM imports it): pool from now on
            from prometheus_client import values

            values.ValueClass = values.get_value_class()
    from .extproc import workers
    from .ops import metrics

    try:
        hosts = listen.listen_hosts(args.host)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"derender: {exc}") from None
    metrics.configure(args.metrics_host or hosts[0], args.metrics_port)
    try:
        process = options.settings(args)
    except ValueError as exc:  # --response-leg worker with a flag it does not support yet (``leg.resolve``)
        raise SystemExit(f"derender: {exc}") from None
    if process.api_keys:
        print("derender: API keys required on /v1 (Authorization: Bearer)", file=sys.stderr)
    _import_parser_plugins(args)
    if process.responses_store:
        from .endpoints.responses import store

        try:
            store.of(process)  # a URL Redis cannot take: refused now, not on the first request
        except ValueError as exc:
            raise SystemExit(f"derender: {exc}") from None
        print(f"derender: stored responses kept in {process.responses_store}", file=sys.stderr)

    if process.quota_config:
        from .ops import quota

        try:
            quotas = quota.load(process.quota_config, process.responses_store)  # a bad entry stops the start
        except quota.QuotaConfigError as exc:
            raise SystemExit(f"derender: {exc}") from None
        listed = f"{len(quotas.keys)} keys" + (", a default" if quotas.default else "")
        print(f"derender: token budgets from {process.quota_config} ({listed}) in {quotas.redis}", file=sys.stderr)

    model = served(args, process)
    routing = routeflags.routing_spec(args)
    if hub:  # one reader of the producers' KV events for every worker (routing.kvhub)
        from .routing import kvhub

        path, sock = kvhub.listen()
        pid = workers.fork_helper("kv-events hub", lambda: kvhub.Hub().serve(sock))
        sock.close()
        print(f"derender: kv-events hub (pid {pid}) reads the producers' events for the workers", file=sys.stderr)
        routing = replace(routing, kv_hub=path)
    unix = None
    if args.uds:  # bound here, before the workers fork: every worker accepts on it
        try:
            unix = listen.bind_unix(args.uds)
        except OSError as exc:
            raise SystemExit(f"derender: {exc}") from None
    # The workers listen on the addresses resolved here (a network in --host named them once).
    serve = workers.filter_server(
        model, args.producer, ",".join(hosts), args.port, routing, listen.listener(args, unix), process
    )
    code = workers.run(serve, args.port, start, most, args.scale_busy)
    if unix is not None:
        listen.unbind_unix(unix)
    # Everything is stopped: leave without the interpreter's teardown, where Triton's extension
    # (imported by vLLM, never used here) prints a nanobind "leaked" dump on every exit.
    import atexit
    import logging

    atexit._run_exitfuncs()  # our own (the metrics folder) and the libraries' exit work
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _import_parser_plugins(args: argparse.Namespace) -> None:
    """``--tool-parser-plugin`` / ``--reasoning-parser-plugin``: register parsers from a file, as vLLM does."""
    from .translate import model  # noqa: F401  (vLLM's environment defaults, before vLLM is imported)

    if args.tool_parser_plugin:
        from vllm.tool_parsers import ToolParserManager

        ToolParserManager.import_tool_parser(args.tool_parser_plugin)
    if args.reasoning_parser_plugin:
        from vllm.reasoning import ReasoningParserManager

        ReasoningParserManager.import_reasoning_parser(args.reasoning_parser_plugin)


def cmd_sim(args: argparse.Namespace) -> int:
    from . import sim

    if not args.model:
        args.model = str(assets.fetch("qwen3", quiet=True))
    return sim.main(args)


def cmd_up(args: argparse.Namespace) -> int:
    from .up import run

    return run(args)


def cmd_fetch(args: argparse.Namespace) -> int:
    return assets.main(args.names)


def cmd_quota(args: argparse.Namespace) -> int:
    """``derender quota show KEY``: what remains of a key's budgets (KEY: the secret or its name)."""
    import asyncio
    import json

    from .ops import quota

    if not args.quota_config:
        raise SystemExit("derender: quota show needs --quota-config FILE (or $DERENDER_QUOTA_CONFIG)")
    try:
        config = quota.load(args.quota_config, args.responses_store)
        shown = asyncio.run(quota.show(config, args.key))
    except quota.QuotaConfigError as exc:
        raise SystemExit(f"derender: {exc}") from None
    except quota.STORE_ERRORS as exc:
        raise SystemExit(f"derender: the quota store {config.redis} did not answer: {exc}") from None
    print(json.dumps(shown, indent=2))
    return 0


def cmd_queue(args: argparse.Namespace) -> int:
    """``derender queue show``: flow control's state, from the filter's metrics port (every worker)."""
    from .ops.flowshow import show

    try:
        print(show(args.metrics))
    except OSError as exc:
        raise SystemExit(f"derender: {args.metrics} could not be read: {exc}") from None
    return 0


def copied_sources() -> dict[str, str]:
    """The source of each of the filter's copies of a vLLM function, by the seam that pins it."""
    import inspect

    from .endpoints.responses.lean import lean_serving_class
    from .endpoints.responses.session import lend_loop
    from .translate import chat_loop

    lean_responses: Any = lean_serving_class(lend_loop)
    return {
        "chat stream generator": inspect.getsource(chat_loop.chat_stream),
        "responses simple loop": inspect.getsource(lean_responses.simple_loop()),
    }


def cmd_seams(args: argparse.Namespace) -> int:
    """``derender seams``: one line per vLLM seam, whether it holds on the installed vLLM; for a copied
    function that moved, the diff between the kept original and the installed source. Exit 1 if any
    seam moved or a copy is not its kept original with its kept edits."""
    from .translate import (
        model,  # noqa: F401  (vLLM's environment defaults, before vLLM is imported)
        vllm_copies,
    )

    sources = copied_sources()
    if args.write_edits:
        for name, copy in vllm_copies.COPIES.items():
            (vllm_copies.ORIGINALS / copy.edits).write_text(vllm_copies.edits(copy, sources[name]))
            print(f"wrote {vllm_copies.ORIGINALS / copy.edits}")
        return 0
    lines, holds = vllm_copies.report(sources)
    print("\n".join(lines))
    return 0 if holds else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="derender", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("DERENDER_LOG_LEVEL", "info"))
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=os.environ.get("DERENDER_LOG_FORMAT", "text"),
        help="text (key=value fields) or one JSON object per line",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the ext_proc gRPC server")
    options.add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    from . import sim

    sim_parser = sub.add_parser("sim", help="run the producer simulator")
    sim.add_arguments(sim_parser)
    sim_parser.set_defaults(func=cmd_sim)

    up = sub.add_parser("up", help="run Envoy + filter (+ simulator) on this machine")
    options.add_up_arguments(up)
    up.set_defaults(func=cmd_up)

    quota_parser = sub.add_parser("quota", help="token budgets: `quota show KEY` prints what remains of a key's")
    quota_parser.add_argument("action", choices=("show",))
    quota_parser.add_argument("key", metavar="KEY", help="the API key, or its name in the quota file")
    quota_parser.add_argument("--quota-config", default=os.environ.get("DERENDER_QUOTA_CONFIG") or None, metavar="FILE")
    quota_parser.add_argument(
        "--responses-store",
        default=os.environ.get("DERENDER_RESPONSES_STORE") or None,
        metavar="URL",
        help="the Redis when the file names none (as derender serve)",
    )
    quota_parser.set_defaults(func=cmd_quota)

    queue = sub.add_parser("queue", help="flow control: `queue show` prints what waits, by band and key")
    queue.add_argument("action", choices=("show",))
    queue.add_argument(
        "--metrics",
        default=os.environ.get("DERENDER_METRICS_URL") or "http://127.0.0.1:9464/metrics",
        metavar="URL",
        help="the filter's metrics (derender serve --metrics-port; default $DERENDER_METRICS_URL, "
        "else http://127.0.0.1:9464/metrics)",
    )
    queue.set_defaults(func=cmd_queue)

    seams = sub.add_parser("seams", help="whether each vLLM seam holds on the installed vLLM (make seams)")
    seams.add_argument(
        "--write-edits", action="store_true", help="write each copy's diff from its kept original (after porting)"
    )
    seams.set_defaults(func=cmd_seams)

    fetch = sub.add_parser("fetch", help="fetch the pinned tokenizers into the cache")
    fetch.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(assets.ASSETS)} (default: all)")
    fetch.set_defaults(func=cmd_fetch)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options.check_config_flags(parser, args)
    if args.command == "serve":
        listen.check_arguments(parser, args)
    _logging(args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
