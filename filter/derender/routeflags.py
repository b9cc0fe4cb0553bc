"""The command line's routing and flow-control flags (``serve`` and ``up`` take them), and the
``RoutingSpec`` they make."""

from __future__ import annotations

import argparse
from typing import Any

ROUTING_HELP = (
    "how requests pick a producer replica: least-request (Envoy's own), prefix (consistent hash on the prompt's "
    "prefix key: a conversation's turns stick to a replica), precise (the replica known to hold the longest "
    "cached prefix, else as prefix), kv-events (the replica whose own KV cache events say it holds the longest "
    "run of the prompt's blocks, else as prefix; --kv-events). Envoy's producer cluster must balance to match "
    "(derender up writes it)"
)


ROUTINGS = ("least-request", "prefix", "precise", "kv-events")  # routing.balance.MODES


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--routing", choices=ROUTINGS, default="least-request", help=ROUTING_HELP)
    for flag, what in (
        ("--kv-events", "PUB socket (vllm serve --kv-events-config's endpoint)"),
        ("--kv-events-replay", "replay socket (replay_endpoint; without it a gap is not filled)"),
    ):
        parser.add_argument(
            flag,
            default="",
            metavar="ENDPOINT[,...]",
            help=f"kv-events routing: each producer's KV events {what}, in --producer's order: tcp://HOST:PORT, "
            "or :PORT on its own host",
        )
    parser.add_argument("--kv-events-topic", default="", help="the producers' KV events topic (default '')")
    parser.add_argument(
        "--prefix-block-size",
        type=int,
        default=16,
        help="tokens per prefix-cache block, as the producers run (vLLM's --block-size; default 16)",
    )
    parser.add_argument(
        "--prefix-key-blocks",
        type=int,
        default=256,
        help="the routing key covers a prompt's first turn, at most this many blocks (default 256)",
    )
    parser.add_argument(
        "--prefix-caching-hash-algo",
        default="sha256",
        choices=("sha256", "sha256_cbor"),
        help="the producers' --prefix-caching-hash-algo, for the prefix key (default sha256; "
        "vLLM's xxhash ones seed every process at random: no key would be the same twice)",
    )
    add_flow_arguments(parser)
    add_handoff_arguments(parser)


def add_flow_arguments(parser: argparse.ArgumentParser) -> None:
    """Flow control (``routing.flow``): off unless --replica-capacity is given."""
    parser.add_argument(
        "--replica-capacity",
        type=int,
        default=0,
        metavar="N",
        help="flow control: a producer replica is full at N requests in flight (or when its /metrics shows "
        "requests waiting); while every replica is full, requests wait in the filter, by priority band and "
        "fairly across API keys (the token-budget file's priority and weight) (default 0: off)",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=30.0,
        help="flow control: seconds a request may wait for room, then 429 with Retry-After (503 with no "
        "replica up) (default 30)",
    )
    parser.add_argument(
        "--queue-size", type=int, default=1024, help="flow control: requests waiting per worker (default 1024)"
    )
    parser.add_argument(
        "--queue-bytes",
        type=int,
        default=256 << 20,
        help="flow control: the waiting requests' rendered bodies, bytes per worker (default 256 MiB)",
    )
    parser.add_argument(
        "--key-reserve",
        type=float,
        default=0.125,
        help="flow control: the share of the capacity one key cannot fill: kept for keys with nothing in "
        "flight, so that another key's request starts at once while one key floods (default 0.125)",
    )
    parser.add_argument(
        "--saturation-interval",
        type=float,
        default=0.25,
        help="flow control: seconds between reads of each producer's vLLM /metrics (its requests running and "
        "waiting: the load every worker and filter process shares); 0: each worker counts its own (default 0.25)",
    )


def add_handoff_arguments(parser: argparse.ArgumentParser) -> None:
    """Disaggregated prefill (``routing.handoff``): off unless --prefill is given."""
    parser.add_argument(
        "--prefill",
        default="",
        metavar="URL[,URL...]",
        help="prefill producers: a long prompt is prefilled on one of them first, and its KV handed to the "
        "decode producer (--producer) through vLLM's kv_transfer_params (default: none)",
    )
    parser.add_argument("--prefill-timeout", type=float, default=30.0, help="seconds for one prefill call (default 30)")
    parser.add_argument(
        "--pd-min-prompt-tokens",
        type=int,
        default=256,
        help="prompts shorter than this go to the decode producer alone (default 256)",
    )


def flow_flags(args: argparse.Namespace) -> list[str]:
    """The flow-control flags as ``derender serve`` takes them (for ``derender up``)."""
    if not getattr(args, "replica_capacity", 0):
        return []
    return [
        "--replica-capacity",
        str(args.replica_capacity),
        "--queue-timeout",
        str(args.queue_timeout),
        "--queue-size",
        str(args.queue_size),
        "--queue-bytes",
        str(args.queue_bytes),
        "--saturation-interval",
        str(args.saturation_interval),
        "--key-reserve",
        str(args.key_reserve),
    ]


def handoff_flags(args: argparse.Namespace) -> list[str]:
    """The prefill/decode flags as ``derender serve`` takes them (for ``derender up``)."""
    if not getattr(args, "prefill", ""):
        return []
    return [
        "--prefill",
        args.prefill,
        "--prefill-timeout",
        str(args.prefill_timeout),
        "--pd-min-prompt-tokens",
        str(args.pd_min_prompt_tokens),
    ]


def routing_spec(args: argparse.Namespace) -> Any:
    """The ``routing.balance.RoutingSpec`` of ``derender serve``'s flags."""
    from .routing.balance import RoutingSpec
    from .routing.flow import FlowSpec
    from .routing.handoff import HandoffSpec

    if (
        args.replica_capacity < 0
        or args.queue_timeout <= 0
        or args.queue_size < 1
        or args.saturation_interval < 0
        or not 0 <= args.key_reserve < 1
    ):
        raise SystemExit(
            "derender: --replica-capacity >= 0, --queue-timeout > 0, --queue-size >= 1, --saturation-interval >= 0, "
            "0 <= --key-reserve < 1"
        )
    return RoutingSpec(
        args.routing,
        args.prefix_block_size,
        args.prefix_caching_hash_algo,
        key_blocks=args.prefix_key_blocks,
        kv_events=tuple(e for e in args.kv_events.split(",") if e),
        kv_events_replay=tuple(e for e in args.kv_events_replay.split(",") if e),
        kv_events_topic=args.kv_events_topic,
        handoff=HandoffSpec(
            tuple(u for u in args.prefill.split(",") if u), args.prefill_timeout, args.pd_min_prompt_tokens
        ),
        flow=FlowSpec(
            args.replica_capacity,
            args.queue_timeout,
            args.queue_size,
            args.queue_bytes,
            args.saturation_interval,
            args.key_reserve,
        ),
    )
