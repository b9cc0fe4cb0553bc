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
MODES = ("envoy", "worker")


def add_arguments(serve: argparse.ArgumentParser) -> None:
    """``derender serve``'s flags for the response leg."""
    serve.add_argument(
        "--response-leg",
        choices=MODES,
        default=os.environ.get("DERENDER_RESPONSE_LEG") or "envoy",
        help="who reaches the producer: 'envoy' (default) hands the filter every event over ext_proc; 'worker' "
        "(experimental; not with --routing kv-events, --prefill, --config or --render-url): the worker that rendered the request "
        "reaches the producer itself, with no ext_proc message per event; Envoy needs `derender up "
        "--response-leg worker`'s config (default: $DERENDER_RESPONSE_LEG, else envoy)",
    )
    serve.add_argument(
        "--leg-host",
        default="127.0.0.1",
        help="--response-leg worker: the address of each worker's leg listener, on a port the system picks; "
        "Envoy must reach it (default 127.0.0.1)",
    )
