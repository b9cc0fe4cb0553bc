"""gRPC over HTTP/2 on the event loop's own thread: the ext_proc stream and the health check.

Why not grpc.aio: at production pacing every token is one ext_proc message and one reply, and
grpc.aio hands each of them between three threads (gRPC's I/O thread, its completion-queue poller,
the event loop, woken through a socket pair): a fifth of a worker's CPU went to context switches. An
echo ext_proc at 64 streams paced one token per 20 ms cost 145 us of server CPU per token on grpc.aio
and 44 us here (``bench/echo_extproc.py --transport``). Here one ``asyncio.Protocol`` per connection
parses the frames where they arrive and a stream's coroutine gets its messages through a future.
What a connection writes in one loop turn leaves in one send at the turn's end: with several streams
per connection (``envoy/local.yaml``), a GPU's batch of events arrives in a few reads and its replies
leave in a few sends.

What it speaks is what Envoy's gRPC client (and gRPC's health-check clients) send over HTTP/2,
cleartext (h2c, prior knowledge) or TLS with ALPN h2 (``server.tls_context``, optionally with client
certificates): the whole of RFC 9113's framing, flow control and stream states, HPACK by the
``hpack`` package, gRPC's length-prefixed messages. Unknown methods get UNIMPLEMENTED, a handler's
exception UNKNOWN, as gRPC's servers answer. No compression (a compressed message gets
UNIMPLEMENTED), no server push. Every bound a peer meets is a field of ``Limits``.

The rooms: ``wire`` (numbers, frames, errors, limits), ``headers`` (HPACK, a request's fields),
``connection`` (frames in, checked; timers), ``streams`` (messages in and out, trailers, resets),
``server`` (the socket, the sweep of timers, the defences' count, TLS).
``derender serve --transport grpcio`` keeps grpc.aio.
"""

from grpc.aio import EOF

from .connection import Connection
from .handlers import METADATA, Handler, Methods
from .server import Server, tls_context
from .streams import Stream
from .wire import *  # noqa: F403 - the protocol's numbers, ``frame``, ``Limits``, ``Status``

__all__ = ["EOF", "METADATA", "Connection", "Handler", "Methods", "Server", "Stream", "tls_context"]
