"""gRPC over HTTP/2 on the event loop's own thread: the ext_proc stream and the health check.

Why not grpc.aio: at production pacing every token is one ext_proc message and one reply, and
grpc.aio hands each of them between three threads (gRPC's I/O thread, its completion-queue poller,
the event loop, woken through a socket pair): a fifth of a worker's CPU went to context switches. An
echo ext_proc at 64 streams paced one token per 20 ms cost 145 us of server CPU per token on grpc.aio
and 44 us here (``bench/echo_extproc.py --transport``). Here a connection's protocol is a state
machine without I/O (bytes in; events and bytes out), run by one ``asyncio.Protocol`` per connection
that feeds it where the frames arrive; a stream's coroutine gets its messages through a future.
What a connection writes in one loop turn leaves in one send at the turn's end: with several streams
per connection (``envoy/local.yaml``), a GPU's batch of events arrives in a few reads and its replies
leave in a few sends.

What it speaks is what Envoy's gRPC client (and gRPC's health-check clients) send over HTTP/2,
cleartext (h2c, prior knowledge) or TLS with ALPN h2 (``server.tls_context``, optionally with client
certificates): the whole of RFC 9113's framing, flow control and stream states, HPACK by the
``hpack`` package, gRPC's length-prefixed messages. Unknown methods get UNIMPLEMENTED, a handler's
exception UNKNOWN, as gRPC's servers answer. No compression (a compressed message gets
UNIMPLEMENTED), no server push. Every bound a peer meets is a field of ``Limits``. In plain HTTP mode
(``Machine.plain``, a ``Server`` subclass with ``plain = True``: the response leg's listener,
``extproc.leg.front``) the same frames carry plain requests without a body and their answers as their
handler writes them.

The rooms, bottom up: ``wire`` (numbers, frames, errors, limits), ``headers`` (HPACK, a header block
gathered, a request's fields), ``control`` (SETTINGS and WINDOW_UPDATE as values, closed streams),
``stream`` (one stream's state), ``outbound`` (frames out, the peer's windows), ``inbound`` (messages
in, budgets, the windows granted), ``events``, ``machine`` (the protocol: frames in, checked; streams,
resets, timers), ``handlers``, ``connection`` (the machine on a socket, a task per stream), ``server``
(the socket, the sweep of timers, the defences' count, TLS).
``derender serve --transport grpcio`` keeps grpc.aio.
"""

from grpc.aio import EOF

from . import events
from .connection import Connection
from .handlers import METADATA, Handler, Methods
from .inbound import Budget
from .machine import Machine
from .server import Server, tls_context
from .wire import *  # noqa: F403 - the protocol's numbers, ``frame``, ``Limits``, ``Status``

__all__ = [
    "EOF",
    "METADATA",
    "Budget",
    "Connection",
    "Handler",
    "Machine",
    "Methods",
    "Server",
    "events",
    "tls_context",
]
