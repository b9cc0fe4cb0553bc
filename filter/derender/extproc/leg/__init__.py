"""The response leg in the worker (``derender serve --response-leg worker``): the filter as Envoy's upstream.

With the default response leg (``envoy``) Envoy reaches the producer and hands every response body
chunk to the filter over ext_proc, and takes its translation back: two gRPC messages per producer
event, and Envoy's ext_proc client on both. With ``worker``, ext_proc does what happens once per
request as before (the render, routing, budgets, flow control, errors in the client's shape), then
hands the exchange to the worker's leg (``front.LegServer.hand``), which sends the rendered request to
the producer at once, parks it under a one-time token (``parked``) and ends the ext_proc stream. Envoy
routes the rewritten request (no body) to that worker: an ``ORIGINAL_DST`` cluster addressed by a
header only the filter sets (``WORKER_HEADER``), the token in ``LEG_HEADER``. The worker's listener
(``front``, HTTP/2: many streams a connection) takes the leg by its token, and from then on the
producer's answer is read and each event's translation written to Envoy's stream from the callback that
read it (``producer``), what a loop turn wrote leaving in one send per connection: no ext_proc message
(docs/performance.md, "The response leg in the worker", "The response leg on HTTP/2").

What Envoy does on the producer leg in the default mode this mode does itself: the balancing over
``--producer``'s URLs (least request, or the prefix key's replica within a load bound; precise
routing's chosen replica first), another replica on a connect failure (``wire.Replicas``), the
connection, its timeout, aborting the producer request when the client goes (the exchange's own abort,
and the connection closed), the stall watch (the exchange's), and errors in the client's shape when
the producer cannot be reached or breaks off. Not yet: ``--routing kv-events``, the prefill/decode
handoff, several models (``--config``), the render tier: ``cli`` refuses those with this mode.
"""

import argparse
import os

LEG_HEADER = "x-derender-leg"  # the parked exchange's one-time token (a request header only the filter sets)
WORKER_HEADER = "x-derender-worker"  # IP:PORT of the worker's leg listener, read by Envoy's ORIGINAL_DST cluster
# Envoy's ext_proc streams carry this gRPC metadata (``initial_metadata``) when its config has the leg's
# cluster and route (``envoy_config.response_leg``): only then does a worker with a leg take a request.
CAPABLE = ("x-derender-response-leg", "1")
MODES = ("envoy", "worker", "auto")


def unsupported(config: object, render_url: object, routing: str, prefill: object) -> str:
    """What the leg cannot do yet among these flags, or ""."""
    if config:
        return "--config (several models)"
    if render_url:
        return "--render-url"
    if routing == "kv-events":
        return f"--routing {routing}"
    if prefill:
        return "--prefill"
    return ""


def resolve(chosen: str, lacking: str) -> str:
    """``--response-leg`` as it runs, given what the other flags leave it lacking (``unsupported``): auto
    is worker where nothing lacks, else envoy; worker with something lacking is refused (ValueError)."""
    if chosen == "worker" and lacking:
        raise ValueError(f"--response-leg worker does not yet work with {lacking}")
    if chosen == "auto":
        return "envoy" if lacking else "worker"
    return chosen


def mode(args: argparse.Namespace) -> str | None:
    """``--response-leg``, with auto made worker where these flags allow it, else envoy (``resolve``)."""
    chosen = getattr(args, "response_leg", None)
    if chosen is None:
        return None
    lacking = unsupported(getattr(args, "config", None), getattr(args, "render_url", None),
                          getattr(args, "routing", "least-request"), getattr(args, "prefill", None))  # fmt: skip
    return resolve(chosen, lacking)


def add_arguments(serve: argparse.ArgumentParser) -> None:
    """``derender serve``'s flags for the response leg."""
    serve.add_argument(
        "--response-leg",
        choices=MODES,
        default=os.environ.get("DERENDER_RESPONSE_LEG") or "auto",
        help="who reaches the producer: 'envoy' hands the filter every event over ext_proc; 'worker' (not with "
        "--routing kv-events, --prefill, --config or --render-url): the worker that rendered the request reaches "
        "the producer itself, with no ext_proc message per event, for the requests of an Envoy whose config has "
        "the leg (`derender up` writes it; others go through ext_proc as with 'envoy'); 'auto': 'worker' where "
        "these flags allow it, else 'envoy' (default: $DERENDER_RESPONSE_LEG, else auto)",
    )
    serve.add_argument(
        "--leg-host",
        default="127.0.0.1",
        help="--response-leg worker: the address of each worker's leg listener, on a port the system picks; "
        "Envoy must reach it; a network (e.g. 172.30.90.0/24) stands for this machine's first address in it, as "
        "with --host (default 127.0.0.1)",
    )
