"""One rendered request's producer leg (``Leg``): its producer request, and the answer translated as it
is read, for Envoy.

The rendered request goes to the producer on a connection of its own (``connection: close``) as soon
as ext_proc hands it over, with the headers Envoy would send (``wire.producer_request``); the answer is
not read until Envoy's connection is here (``attach``). The answer's headers go through
``response_headers`` and go to Envoy's stream (``front.StreamFront``), the body as DATA. Each body
chunk is translated from the callback that read it: ``response_chunk`` is stepped by hand. A request
a stage hooks on every chunk (a key's budget, which asks Redis) has its translations run as tasks, as
does one that waits after all; meanwhile the producer's reading pauses and later chunks queue behind.
A buffered answer (an error, a non-streaming one) is collected and answered whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import httptools

from ...endpoints.router import ModelExchange
from ...exchange import Rewrite
from ...routing.balance import KEY_HEADER
from .wire import HOP, Replicas, Target, finish_later, producer_request

log = logging.getLogger("derender.leg")

CONNECT_TIMEOUT = 5.0  # seconds to reach the producer (Envoy's producer cluster: 2 s, then a retry)
MAX_BUFFERED = 16 << 20  # a buffered answer's bytes (Envoy's per-connection buffer in the shipped configs)
MAX_ANSWER_HEAD = 64 << 10  # the producer's response headers


class Front(Protocol):
    """What a leg needs of Envoy's stream (``front.StreamFront``)."""

    def head(self, status: int, headers: list[tuple[bytes, bytes]], length: int | None) -> None: ...  # None: streamed

    def body(self, data: bytes) -> None: ...

    def end(self, data: bytes) -> None: ...  # the body's last bytes: the answer is whole

    def finish(self) -> None:
        """The answer is whole: the connection takes Envoy's next request."""
        ...

    def abort(self) -> None:
        """Break the connection off (Envoy resets the client's stream)."""
        ...


class Leg:
    """The producer leg of one request, from the rendered exchange to the last byte Envoy gets.

    It starts when ext_proc parks the exchange (``start``): the producer request goes out while Envoy
    brings the client's request to this worker, and the producer's answer is not read until Envoy's
    connection is here (``attach``)."""

    def __init__(self, exchange: ModelExchange, rewrite: Rewrite, headers: dict[str, str], replicas: Replicas,
                 on_done: Callable[[Leg], None]) -> None:  # fmt: skip
        self.exchange = exchange
        self.rewrite = rewrite
        self.front: Front | None = None
        self.replicas = replicas
        self.headers = headers
        self.target: Target | None = None  # the replica reached (counted in ``replicas`` until the leg is over)
        self.on_done = on_done
        self.upstream = ""  # HOST:PORT of the replica tried last
        self.request = b""
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer_headers: list[tuple[bytes, bytes]] = []
        self.answer_bytes = 0
        self.status = 0
        self.started = False  # the response head went to Envoy
        self.buffered: list[bytes] | None = None  # a buffered answer's body so far
        self._start_set: dict[str, str] = {}  # a buffered answer's header changes (``ResponseStart``)
        self._start_removed: list[str] = []
        self.answered = False  # the producer's answer was read to its end
        self.over = False  # closed: the exchange is closed and the front told
        self._unreached: tuple[int, str] | None = None  # the producer failed before Envoy came: the answer
        self._early: list[bytes] = []  # what the producer sent before Envoy came (its reading paused then)
        self._lost_early = False  # and its connection closed
        self._connecting: asyncio.Task | None = None
        self._waiting: asyncio.Task | None = None  # a translation that waits
        self._queue: list[tuple[bytes, bool]] = []  # chunks read while it waits
        self._holds: set[str] = {"front"}  # why the producer's reading is paused: Envoy is not here yet
        # A stage's hook on every chunk may wait (a key's budget asks Redis), and what it calls may ask for
        # a task of its own (asyncio.timeout, redis-py's connect): its translations run as tasks.
        self.in_task = bool(exchange.ctx.on_chunk)

    def attach(self, front: Front) -> None:
        """Envoy's connection is here: the answer goes to it from now on."""
        self.front = front
        if self._unreached is not None:
            self._answer_failure(*self._unreached)
            return
        early, self._early = b"".join(self._early), []
        if early:
            self.read(early)
        if self._lost_early:
            self.lost()
            return
        self.release("front")

    # -- the producer connection ----------------------------------------------------------------
    def start(self) -> None:
        self._connecting = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        """A connection to a replica (``Replicas``: least request, another one on a connect failure)."""
        loop = asyncio.get_running_loop()
        await self.replicas.refresh()  # a producer's name: its addresses
        tried: list[Target] = []
        why = "no producer"
        key = self.rewrite.set_headers.get(KEY_HEADER)
        destination = self.rewrite.destination  # the replica routing chose (precise), first
        named = self.replicas.named(destination)
        while len(tried) <= Replicas.RETRIES:
            target = named if named is not None and not tried else self.replicas.pick(tried, key)
            if target is None:
                break
            tried.append(target)
            host, port, tls, authority = target.address()
            self.upstream = target.where
            self.request = producer_request(self.rewrite, self.headers, authority)
            try:
                await asyncio.wait_for(
                    loop.create_connection(lambda: _Conn(self), host, port, ssl=tls,
                                           server_hostname=target.name if tls else None),
                    CONNECT_TIMEOUT,
                )  # fmt: skip
            except (OSError, asyncio.TimeoutError, ssl.SSLError) as exc:
                why = "connection timeout" if isinstance(exc, asyncio.TimeoutError) else f"connection failure: {exc}"
                log.warning("producer %s unreachable: %s", self.upstream, why)
                self.replicas.failed(target)
                if self.over:
                    return
                continue
            if self.over:  # ``connected`` closed it
                return
            self.target = target
            self.replicas.started(target)
            return
        if not self.over:
            message = f"upstream connect error or disconnect/reset before headers. reset reason: {why}"
            self._answer_failure(503, message)

    def connected(self, transport: asyncio.Transport) -> None:
        if self.over:
            transport.close()
            return
        self.transport = transport
        transport.write(self.request)
        if self._holds:
            transport.pause_reading()
        then = self.rewrite.then
        if then is not None:  # sent: the producer is at work
            then()

    def read(self, data: bytes) -> None:
        if self.front is None:  # kept for Envoy's connection (an event loop may read once before the pause)
            self._early.append(data)
            if self.transport is not None:
                self.transport.pause_reading()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # raised in a callback below
            cause = exc.__context__
            if isinstance(cause, httptools.HttpParserError):  # a limit of ours
                self._broke(str(cause))
            else:
                log.error("the producer's answer could not be handed on", exc_info=cause)
                self._break_off()
        except httptools.HttpParserError as exc:
            self._broke(f"a malformed producer response ({exc})")

    def lost(self) -> None:
        """The producer's connection closed."""
        self.transport = None
        if self.front is None:
            self._lost_early = True
            return
        if not self.over and not self.answered:
            self._broke("the producer closed the connection")

    # -- httptools' callbacks ----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.answer_bytes += len(name) + len(value)
        if self.answer_bytes > MAX_ANSWER_HEAD:
            raise httptools.HttpParserError("response headers too large")
        self.answer_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        start = self.exchange.response_headers(self.status, self.upstream)
        if start.buffer:
            self.buffered = []
            self.answer_bytes = 0
            self._start_set, self._start_removed = start.set_headers, start.remove_headers
            return
        assert self.front is not None  # nothing is read before Envoy's connection is here
        self.front.head(self.status, self._merged(start.set_headers, start.remove_headers), None)
        self.started = True

    def on_body(self, body: bytes) -> None:
        if self.buffered is not None:
            self.answer_bytes += len(body)
            if self.answer_bytes > MAX_BUFFERED:
                raise httptools.HttpParserError(f"a buffered answer over {MAX_BUFFERED} bytes")
            self.buffered.append(body)
        else:
            self._translate(body, False)

    def on_message_complete(self) -> None:
        self.answered = True
        if self.buffered is not None:
            body, self.buffered = b"".join(self.buffered), None
            self._whole(body)
        else:
            self._translate(b"", True)

    # -- the answer ----------------------------------------------------------------------------
    def _merged(self, set_headers: dict[str, str], removed: list[str]) -> list[tuple[bytes, bytes]]:
        drop = {n.lower().encode() for n in (*removed, *set_headers)}
        kept = [(k, v) for k, v in self.answer_headers if k.lower() not in HOP and k.lower() not in drop]
        return kept + [(k.encode("latin-1"), v.encode("latin-1")) for k, v in set_headers.items()]

    def _translate(self, data: bytes, end: bool) -> None:
        if self._waiting is not None:
            self._queue.append((data, end))
            return
        coro = self.exchange.response_chunk(data, end)
        if self.in_task:
            self._in_task(coro, end)
            return
        try:
            yielded = coro.send(None)
        except StopIteration as done:
            self._emit(done.value, end)
            return
        except Exception:
            log.exception("a response chunk's translation failed")
            self._break_off()
            return
        self._in_task(finish_later(coro, yielded), end)  # it waits after all: its rest in a task

    def _in_task(self, coro: Coroutine[Any, Any, bytes], end: bool) -> None:
        self.hold("translation")
        self._waiting = asyncio.get_running_loop().create_task(coro)
        self._waiting.add_done_callback(lambda task: self._waited(task, end))

    def _waited(self, task: asyncio.Task, end: bool) -> None:
        self._waiting = None
        if self.over or task.cancelled():
            return
        try:
            out = task.result()
        except Exception:
            log.exception("a response chunk's translation failed")
            self._break_off()
            return
        self._emit(out, end)
        while self._queue and self._waiting is None and not self.over:
            data, end = self._queue.pop(0)
            self._translate(data, end)
        if self._waiting is None:
            self.release("translation")

    def _emit(self, out: bytes, end: bool) -> None:
        if self.over:
            return
        assert self.front is not None  # nothing is read before Envoy's connection is here
        if not end:
            if out:
                self.front.body(out)
            return
        self.front.end(out)
        self._done(True)

    def _whole(self, body: bytes) -> None:
        """A buffered answer: the exchange's body for it, answered with its length."""

        async def answer() -> None:
            out, status = await self.exchange.response_body(body)
            if self.over:
                return
            headers = self._merged(self._start_set, self._start_removed)
            assert self.front is not None  # nothing is read before Envoy's connection is here
            self.front.head(status or self.status, headers, len(out))
            self.front.end(out)
            self._done(True)

        self.hold("translation")
        task = asyncio.get_running_loop().create_task(answer())
        self._waiting = task

        def answered(t: asyncio.Task) -> None:
            self._waiting = None
            if not t.cancelled() and t.exception() is not None:
                log.error("a buffered answer's translation failed", exc_info=t.exception())
                self._break_off()

        task.add_done_callback(answered)

    def _answer_failure(self, status: int, message: str) -> None:
        """No answer from the producer: Envoy's own words for it, as the exchange answers a producer's error
        (once Envoy's connection is here)."""
        if self.front is None:
            self._unreached = (status, message)
            return
        self.answer_headers = [(b"content-type", b"application/json")]
        self.status = status
        start = self.exchange.response_headers(status, None)
        self._start_set, self._start_removed = start.set_headers, start.remove_headers
        body = json.dumps({"error": {"message": message, "type": "ServiceUnavailableError", "code": status}}).encode()
        if start.buffer:
            self._whole(body)
            return
        assert self.front is not None  # answered once Envoy's connection is here
        self.front.head(status, self._merged(start.set_headers, start.remove_headers), None)
        self.started = True
        self._translate(body, False)
        self._translate(b"", True)

    def _broke(self, why: str) -> None:
        """The producer's answer broke off: before its head, the client gets a 503 in its API's shape, as
        Envoy answers an upstream reset before headers; after it, the stream is cut, as Envoy cuts a
        client's stream when its upstream resets."""
        if self.over:
            return
        log.warning("producer %s: %s", self.upstream, why)
        if self.status == 0 and self.buffered is None:
            if self.transport is not None:
                self.transport.close()
            self._answer_failure(503, f"upstream connect error or disconnect/reset before headers. reset reason: {why}")
            return
        self._break_off()

    def _break_off(self) -> None:
        if self.over:
            return
        if self.front is not None:
            self.front.abort()
        self._done(False)

    # -- flow ------------------------------------------------------------------------------------
    def hold(self, why: str) -> None:
        """Read no more from the producer until ``release(why)`` (Envoy's stream or connection is full)."""
        if not self._holds and self.transport is not None:
            self.transport.pause_reading()
        self._holds.add(why)

    def release(self, why: str) -> None:
        self._holds.discard(why)
        if not self._holds and self.transport is not None and not self.over:
            self.transport.resume_reading()

    def client_gone(self) -> None:
        """Envoy's connection closed before the answer was whole (the client left, or Envoy gave up), or
        Envoy never brought the request (``parked.Parked``'s time ran out)."""
        self._done(False)

    def _done(self, complete: bool) -> None:
        if self.over:
            return
        self.over = True
        for task in (self._connecting, self._waiting):
            if task is not None and not task.done():
                task.cancel()
        if self.transport is not None:
            self.transport.close()
        if self.target is not None:
            self.replicas.finished(self.target)
        try:
            self.exchange.close(complete)
        finally:
            if complete and self.front is not None:
                self.front.finish()
            self.on_done(self)


class _Conn(asyncio.Protocol):
    """The producer's connection, for its leg."""

    def __init__(self, leg: Leg) -> None:
        self.leg = leg

    def connection_made(self, transport: Any) -> None:
        self.leg.connected(transport)

    def data_received(self, data: bytes) -> None:
        self.leg.read(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.leg.lost()
