"""Running the simulator: its aiohttp app, its command-line flags and ``main``."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from aiohttp import web

from .simulator import Simulator


def build_app(model_dir: str, **options: Any) -> web.Application:
    """The simulator's aiohttp app; ``options`` as ``Simulator`` takes them (mode, script, delay, ...)."""
    return Simulator(model_dir, **options).app()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, metavar="DIR", help="folder with tokenizer.json, tokenizer_config.json, config.json"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--mode", choices=("echo", "script"), default="echo")
    parser.add_argument("--script", help="JSONL file of choices (script mode)")
    parser.add_argument("--tokens-per-event", default="1", help="int or random:SEED")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds per event")
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="--delay is one step of a clock all requests share, as one GPU decodes a batch "
        "(every request's event at the same moment), not a timer of each request's own",
    )
    parser.add_argument(
        "--finish-only-tail", action="store_true", help="send finish_reason in a separate event with no tokens"
    )
    parser.add_argument("--error-after", type=int, help="mid-stream error after N events")
    parser.add_argument("--http-error", type=int, help="answer every generate with this status")
    parser.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=0,
        help="model vLLM's prefix cache: an LRU of this many blocks of --block-size tokens (0: none)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per prefix-cache block (vLLM's flag)")
    parser.add_argument(
        "--kv-events-config",
        metavar="JSON",
        help="publish the prefix cache's stores and evictions as vLLM's KV cache events: vllm serve's own flag "
        'and JSON, e.g. {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}; the block hashes are vLLM\'s',
    )
    parser.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="adapters (vLLM's flag): a request naming one is cached apart, with vLLM's LoRA extra keys",
    )
    parser.add_argument(
        "--prefix-caching-hash-algo",
        default="sha256",
        choices=("sha256", "sha256_cbor"),
        help="the block hash of the published events (vLLM's flag; default sha256)",
    )
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=0.0,
        help="before the first token, wait this long per prompt token not found in the cache "
        "(one prompt at a time, as one GPU prefills)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="prefill in chunks inside the decode steps, as vLLM's chunked prefill (vLLM's flag: the tokens one "
        "step computes, one per decoding sequence and the rest prompt chunks): a step lasts --delay plus its "
        "prompt tokens times --prefill-us-per-token, so prefills slow the streams decoding beside them "
        "(0: prefill beside the steps, never slowing them)",
    )
    parser.add_argument(
        "--kv-transfer-us-per-token",
        type=float,
        default=0.0,
        help="--kv-role decode: a request whose KV it pulled from a prefill producer waits this long per prompt "
        "token for the transfer (no step slowed)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=0,
        help="at most this many sequences run at once; the rest wait in arrival order, as in vLLM's "
        "scheduler (vLLM's flag; 0: no limit); /metrics serves vllm:num_requests_running and _waiting",
    )
    parser.add_argument(
        "--kv-role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="disaggregated prefill: a prefill producer answers do_remote_decode with where its KV blocks wait "
        "(vLLM's NIXL connector's kv_transfer_params); a decode producer given do_remote_prefill takes them from "
        "that simulator and skips its own prefill (default both)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens, as vllm serve with this flag",
    )


async def _announce(args: argparse.Namespace) -> None:
    cache = f", prefix cache of {args.prefix_cache_blocks} blocks" if args.prefix_cache_blocks else ""
    if args.kv_events_config:
        cache += ", publishing KV cache events"
    logging.getLogger("derender.sim").info(
        "simulator (%s mode%s) on http://%s:%d", args.mode, cache, args.host, args.port
    )


def main(args: argparse.Namespace) -> int:
    tpe = str(args.tokens_per_event)
    app = build_app(
        args.model,
        mode=args.mode,
        script=args.script,
        tokens_per_event=int(tpe) if tpe.isdigit() else tpe,
        delay=args.delay,
        finish_only_tail=args.finish_only_tail,
        error_after=args.error_after,
        http_error=args.http_error,
        prefix_cache_blocks=args.prefix_cache_blocks,
        prefill_us_per_token=args.prefill_us_per_token,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        lockstep=args.lockstep,
        kv_events_config=args.kv_events_config,
        block_size=args.block_size,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        lora_modules=args.lora_modules,
        max_num_seqs=args.max_num_seqs,
        kv_role=args.kv_role,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_transfer_us_per_token=args.kv_transfer_us_per_token,
        address=(args.host, args.port),
    )
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    # One line in the log's own format, in place of aiohttp's banner ("Running on ... Press CTRL+C").
    app.on_startup.append(lambda _: _announce(args))
    web.run_app(
        app, host=args.host, port=args.port, access_log=None, loop=loop, backlog=4096, shutdown_timeout=1.0, print=None
    )
    return 0
