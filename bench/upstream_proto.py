"""A measuring prototype of derender in Envoy's upstream position, for ``bench/floors.py``: not a product.

Envoy proxies the client's request to this process as its producer cluster (HTTP/1.1, no ext_proc
filter), and this process does what the filter does, with the filter's own objects: the ``Router``
and its ``ModelExchange`` that the ext_proc servicer drives, built as ``derender serve`` builds them
(the same flags, parsers, lean path, prefix memo and warm-up). Per request it renders the body
(``request_body``), posts the rendered request to the producer on a new connection, and writes each
producer body chunk's translation (``response_chunk``) back to Envoy as an HTTP/1.1 chunk, from the
callback that read the chunk (no task woken per event). So a producer event costs one read and one
write here, as in ``bench/byte_relay.py``, plus the translation, with no ext_proc message either way
and no gRPC framing. A translation that would wait (a key's budget) is not handled.

What it leaves out, which a product in this position would have to take over from Envoy: balancing
over producer replicas, retries, health checks, TLS to the producer, the producer leg's spans,
limits on the listener, and errors in the client's API shape for its own faults (a fault here just
closes the connection). One event loop, one process.

    python bench/upstream_proto.py --port 9030 -- --model <dir> --served-model-name qwen3 ... --producer http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
from typing import Any
from urllib.parse import urlsplit

import httptools
import uvloop

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Internal Server Error"}


def _head(status: int, headers: dict[str, str], chunked: bool, length: int = 0) -> bytes:
    lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Status"))]
    lines += [
        f"{k}: {v}".encode("latin-1")
        for k, v in headers.items()
        if k.lower() not in ("content-length", "transfer-encoding", "connection")
    ]
    lines.append(b"transfer-encoding: chunked" if chunked else b"content-length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _reply(reply: Any) -> bytes:
    """An immediate answer (``derender.exchange.Reply``) as HTTP/1.1."""
    return (
        _head(reply.status, {"content-type": reply.content_type, **reply.headers}, False, len(reply.body)) + reply.body
    )


class Front(asyncio.Protocol):
    """A connection from Envoy: one request at a time (Envoy does not pipeline)."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.headers: dict[str, str] = {}
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        headers = {
            ":method": self.parser.get_method().decode(),
            ":path": self.url.decode("latin-1"),
            ":authority": self.headers.get("host", ""),
            **self.headers,
        }
        body = b"".join(self.body)
        self.headers, self.url, self.body = {}, b"", []
        task = asyncio.get_running_loop().create_task(self.app.handle(self.transport, headers, body))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or self.transport.close())


def _now(coro: Any) -> Any:
    """The value of a coroutine that finishes without waiting (the exchange's translation of a chunk
    with no budget hook); a chunk whose translation would wait is not the prototype's case."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the translation waited: not handled by the prototype")


class Back(asyncio.Protocol):
    """The producer's answer to one rendered request: its events through the exchange as they are
    read, each translation written to Envoy from the same callback (no task woken per event)."""

    def __init__(self, exchange: Any, front: Any, request: bytes, upstream: str) -> None:
        self.exchange, self.front, self.request, self.upstream = exchange, front, request, upstream
        self.parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.complete = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # a bad answer, or the translation failed in a callback
            self.transport.close()

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        start = self.exchange.response_headers(status, self.upstream)
        headers = {"content-type": "text/event-stream", **start.set_headers}
        for name in start.remove_headers:
            headers.pop(name, None)
        self.front.write(_head(status, headers, True))

    def on_body(self, body: bytes) -> None:
        out = _now(self.exchange.response_chunk(body, False))
        if out:
            self.front.write(b"%x\r\n%s\r\n" % (len(out), out))

    def on_message_complete(self) -> None:
        out = _now(self.exchange.response_chunk(b"", True))
        self.front.write((b"%x\r\n%s\r\n" % (len(out), out) if out else b"") + b"0\r\n\r\n")
        self.complete = True
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.exchange.close(self.complete)
        if not self.complete:
            self.front.close()


class App:
    def __init__(self, router: Any, producer: str) -> None:
        self.router = router
        where = urlsplit(producer)
        self.host, self.port = where.hostname or "127.0.0.1", where.port or 80

    async def handle(self, front: Any, headers: dict[str, str], body: bytes) -> None:
        from derender.exchange import Reply
        from derender.translate.errors import HTTPError

        routed = await self.router.route(headers, not body)
        if isinstance(routed, Reply):
            front.write(_reply(routed))
            return
        exchange = routed
        try:
            rewrite = await exchange.request_body(body)
            if isinstance(rewrite, Reply):
                exchange.close(True)
                front.write(_reply(rewrite))
                return
            sent = {
                "host": f"{self.host}:{self.port}",
                "content-type": "application/json",
                **{k.lower(): v for k, v in rewrite.set_headers.items() if not k.startswith(":")},
                "content-length": str(len(rewrite.body)),
            }
            request = (
                f"POST {rewrite.path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in sent.items()) + "\r\n"
            ).encode() + rewrite.body
            back = Back(exchange, front, request, f"{self.host}:{self.port}")
            await asyncio.get_running_loop().create_connection(lambda: back, self.host, self.port)
        except HTTPError as exc:  # the client's fault, as the filter answers it
            exchange.close(True)
            front.write(_reply(Reply.error(exc)))
            return
        except BaseException:
            exchange.close(False)
            raise
        # the producer's connection has the exchange from here on (``Back``)
        if rewrite.then is not None:
            rewrite.then()


def load(argv: list[str]) -> tuple[Any, Any, Any]:
    """The flags of ``derender serve``, its settings and its model, loaded as it loads it (before any
    event loop: vLLM's setup runs a loop of its own)."""
    from derender import cli, options

    args = cli.build_parser().parse_args(["serve", *argv])
    process = options.settings(args)
    gc.disable()  # as ``derender serve`` loads the model
    return args, process, cli.served(args, process)


async def serve(port: int, args: Any, process: Any, model: Any) -> None:
    from derender import routeflags
    from derender.extproc.server import ready_router
    from derender.routing.clusters import producers

    producer = producers(args.producer.split(","), process.stall_timeout)
    router = await ready_router(model, producer, routeflags.routing_spec(args), process)
    gc.freeze()
    gc.enable()
    app = App(router, args.producer.split(",")[0])
    server = await asyncio.get_running_loop().create_server(lambda: Front(app), "127.0.0.1", port)
    print(f"upstream prototype on 127.0.0.1:{port}", file=sys.stderr, flush=True)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="where Envoy connects (loopback)")
    parser.add_argument("serve", nargs=argparse.REMAINDER, help="after --: the flags of `derender serve`")
    args = parser.parse_args()
    argv = args.serve[1:] if args.serve[:1] == ["--"] else args.serve
    serve_args, process, model = load(argv)
    uvloop.run(serve(args.port, serve_args, process, model))


if __name__ == "__main__":
    main()
