"""``derender``: ``serve`` (the ext_proc filter), ``sim`` (a producer simulator), ``up`` (the local stack)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from . import assets


def add_model_arguments(parser: argparse.ArgumentParser, default_model: bool = False) -> None:
    """Model flags, named as ``vllm serve`` names them."""
    parser.add_argument(
        "--model",
        default=None,
        help="folder with config.json, tokenizer.json and tokenizer_config.json"
        + (" (default: the Qwen3 tokenizer fetched at set-up)" if default_model else ""),
    )
    parser.add_argument("--served-model-name", nargs="+", default=None, help="name(s) clients use (default: --model)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--chat-template", default=None, help="a chat template file or string")
    parser.add_argument("--reasoning-parser", default=None, help="vLLM reasoning parser name, e.g. qwen3, deepseek_r1")
    parser.add_argument("--tool-call-parser", default=None, help="vLLM tool parser name, e.g. hermes")
    parser.add_argument("--enable-auto-tool-choice", action="store_true", help="allow tool_choice=auto")
    parser.add_argument("--default-chat-template-kwargs", default=None, help='JSON, e.g. \'{"enable_thinking": false}\'')


def model_spec(args: argparse.Namespace):
    from .model import ModelSpec

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
    )


def _logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from .extproc import serve
    from .model import Model

    model = Model(model_spec(args))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(model, args.producer, args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="derender", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("DERENDER_LOG_LEVEL", "info"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the ext_proc gRPC server")
    add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=9002, help="gRPC port Envoy connects to")
    serve.add_argument("--producer", default="http://127.0.0.1:8100", help="producer base URL (for aborts)")
    serve.set_defaults(func=cmd_serve)

    from . import sim

    sim_parser = sub.add_parser("sim", help="run the producer simulator")
    sim.add_arguments(sim_parser)
    sim_parser.set_defaults(func=cmd_sim)

    up = sub.add_parser("up", help="run Envoy + filter (+ simulator) on this machine")
    add_model_arguments(up, default_model=True)
    up.add_argument("--port", type=int, default=8080, help="OpenAI endpoint port on 127.0.0.1")
    up.add_argument("--producer", default=None, help="producer base URL; without it the simulator runs")
    up.add_argument("--filter-port", type=int, default=0, help="ext_proc port (default: a free one)")
    up.add_argument("--sim-arg", action="append", default=[], help="extra flag for the simulator (repeatable)")
    up.set_defaults(func=cmd_up)

    fetch = sub.add_parser("fetch", help="fetch the pinned tokenizers into the cache")
    fetch.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(assets.ASSETS)} (default: all)")
    fetch.set_defaults(func=cmd_fetch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _logging(args.log_level)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
