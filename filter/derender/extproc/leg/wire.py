"""The response leg's producer side: the producer request as Envoy would send it (HTTP/1.1), where
producer requests go (``Target``), and a coroutine's rest for a task."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import random
import socket
import ssl
import time
import types
from collections.abc import Awaitable, Callable, Container, Coroutine
from typing import Any
from urllib.parse import urlsplit

from ...exchange import STRIP_REQUEST_HEADERS, Rewrite
from ...ops.envoy_config import BALANCE_FACTOR
from ...routing.clusters import STEERING_PREFIX
from ..listen import hostport
from . import LEG_HEADER, WORKER_HEADER

log = logging.getLogger("derender.leg")

HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer", b"upgrade",
        b"host", b"content-length", b"expect", LEG_HEADER.encode(), WORKER_HEADER.encode(),
    }
)  # fmt: skip
SENT = HOP | {b"content-type"}  # the rendered request is the filter's JSON, whatever the client's body was


class Target:
    """One of ``--producer``'s URLs, or one address its host name resolved to (``address``)."""

    def __init__(self, url: str, address: str | None = None) -> None:
        parts = urlsplit(url if "://" in url else "http://" + url)
        self.url = url
        self.authority = parts.netloc  # the Host header of a request to it
        self.name = parts.hostname or "127.0.0.1"  # what a TLS producer's certificate names
        self.host = address or self.name  # what is connected to
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.key = url if address is None else f"{url} {address}"  # its place in a prefix key's order
        self.where = hostport(self.host, self.port)  # HOST:PORT as Envoy names an upstream (IPv6 in brackets)
        self._ssl = ssl.create_default_context() if self.tls else None

    def address(self) -> tuple[str, int, ssl.SSLContext | None, str]:
        """(host, port, TLS, Host header)."""
        return self.host, self.port, self._ssl, self.authority


BALANCE = BALANCE_FACTOR / 100  # no replica past 1.25x the mean of requests in flight (Envoy's bound)
DNS_REFRESH = 5.0  # seconds between lookups of a producer's name (envoy/compose.yaml's dns_refresh_rate)
Lookup = Callable[[str, int], Awaitable[list[str]]]


def _rank(key: str, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key} {name}".encode(), digest_size=8).digest(), "big")


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def lookup(host: str, port: int) -> list[str]:
    """``host``'s IPv4 addresses, else its IPv6 ones (Envoy's ``V4_PREFERRED``), through the system's resolver."""
    loop = asyncio.get_running_loop()
    for family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(socket.gaierror):
            found = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)
            if found:
                return sorted({str(info[4][0]) for info in found})
    raise OSError(f"{host}: no address")


class Replicas:
    """Where a worker's producer requests go: ``--producer``'s URLs, as Envoy's producer cluster balances
    them (``envoy_config.producer_cluster``, least request): the replica with the fewest of this worker's
    requests in flight, ties broken at random; a replica that refused a connection is passed over for
    ``DOWN`` seconds while another is up (Envoy's health check takes it out after two failed checks 2 s
    apart), and a request it refused goes to another, at most ``RETRIES`` more times (Envoy's
    ``retry_on: connect-failure``, ``num_retries: 2``, never a replica tried before): nothing reached a
    producer, so nothing runs twice. A URL's host name stands for every address it resolves to, each a
    replica (Envoy's ``STRICT_DNS``: ``docker compose --scale producer=4`` behind one name), looked up
    again every ``DNS_REFRESH`` seconds; a failed lookup keeps the addresses it had."""

    DOWN = 4.0
    RETRIES = 2

    def __init__(self, urls: list[str], clock: Callable[[], float] = time.monotonic, resolve: Lookup = lookup) -> None:
        self.given = [Target(url) for url in urls]
        self.targets = list(self.given)
        self.clock = clock
        self.resolve = resolve
        self.active = dict.fromkeys(self.targets, 0)
        self.down_until = dict.fromkeys(self.targets, 0.0)
        self._names = any(not _literal(t.name) for t in self.given)
        self._looked: float | None = None  # when the names were last looked up
        self._lookup: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        """The names looked up again when ``DNS_REFRESH`` has passed: waited for only the first time (no
        address yet), else in the background while requests go to the addresses already known."""
        if not self._names or (self._looked is not None and self.clock() - self._looked < DNS_REFRESH):
            return
        if self._lookup is None:
            self._lookup = asyncio.get_running_loop().create_task(self._look_up())
        if self._looked is None:
            await asyncio.shield(self._lookup)

    async def _look_up(self) -> None:
        found: list[Target] = []
        known = {t.key: t for t in self.active}
        try:
            for given in self.given:
                if _literal(given.name):
                    found.append(given)
                    continue
                try:
                    addresses = await self.resolve(given.name, given.port)
                    if not addresses:
                        raise OSError("no address")
                except (OSError, UnicodeError) as exc:  # no answer, or a name no resolver takes
                    log.warning("producer %s: lookup failed (%s); its addresses stay as they were", given.url, exc)
                    found += [t for t in self.targets if t.url == given.url]
                    continue
                found += [known.get(f"{given.url} {a}") or Target(given.url, a) for a in addresses]
            self.targets = found or self.targets
            keep = set(self.targets) | {t for t, n in self.active.items() if n > 0}
            self.active = {t: self.active.get(t, 0) for t in keep}
            self.down_until = {t: self.down_until.get(t, 0.0) for t in keep}
        finally:
            self._looked = self.clock()
            self._lookup = None

    def pick(self, tried: Container[Target] = (), key: str | None = None) -> Target | None:
        """The next replica for a request that has tried ``tried``; None once none is left. With ``key``
        (``--routing prefix|precise``: the prefix key, ``routing.balance.KEY_HEADER``), by consistent
        hashing with bounded load, as Envoy's ring with ``hash_balance_factor``: the replicas in the
        key's own order (rendezvous hashing: the same in every worker and filter replica), the first
        with fewer of this worker's requests in flight than ``BALANCE`` times the mean, counting this one."""
        left = [t for t in self.targets if t not in tried]
        if len(left) <= 1:
            return left[0] if left else None
        now = self.clock()
        up = [t for t in left if self.down_until.get(t, 0.0) <= now] or left
        if key is not None:
            order = sorted(up, key=lambda t: _rank(key, t.key), reverse=True)
            bound = BALANCE * (sum(self.active.get(t, 0) for t in self.targets) + 1) / len(self.targets)
            return next((t for t in order if self.active.get(t, 0) + 1 <= bound), order[0])
        fewest = min(self.active.get(t, 0) for t in up)
        return random.choice([t for t in up if self.active.get(t, 0) == fewest])

    def named(self, address: str | None) -> Target | None:
        """The replica routing named (``IP:PORT``), if it is one of these."""
        if address:
            for target in self.targets:
                if target.where == address:
                    return target
        return None

    def started(self, target: Target) -> None:
        self.active[target] = self.active.get(target, 0) + 1
        self.down_until[target] = 0.0

    def finished(self, target: Target) -> None:
        self.active[target] -= 1

    def failed(self, target: Target) -> None:
        self.down_until[target] = self.clock() + self.DOWN


@types.coroutine
def _rest(coro: Coroutine[Any, Any, Any], yielded: Any):
    """The rest of ``coro``, started by hand, which yielded ``yielded``: a task runs it on from there."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coro.close()
            raise
        except asyncio.CancelledError as exc:  # the only exception a task throws in
            try:
                yielded = coro.throw(exc)
            except StopIteration as done:
                return done.value
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as done:
                return done.value


async def finish_later(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    return await _rest(coro, yielded)


def producer_request(rewrite: Rewrite, client: dict[str, str], authority: str) -> bytes:
    """The producer request, as Envoy would send it after ext_proc's rewrite: the client's headers less
    pseudo-headers, hop-by-hop ones, the credentials ext_proc strips and any ``x-derender-*`` a client
    sent, plus the rewrite's own; the rendered body."""
    headers = {k: v for k, v in client.items() if not k.startswith(":") and k.encode() not in SENT and k not in STRIP_REQUEST_HEADERS
               and not k.startswith(STEERING_PREFIX)}  # fmt: skip
    headers.update(
        {
            k.lower(): v
            for k, v in rewrite.set_headers.items()
            if not k.startswith(":") and k.lower().encode() not in SENT
        }
    )
    body = rewrite.body
    lines = [f"POST {rewrite.path} HTTP/1.1", f"host: {authority}", *(f"{k}: {v}" for k, v in headers.items())]
    head = "\r\n".join(lines).encode("latin-1")
    return (
        head
        + b"\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        + body
    )
