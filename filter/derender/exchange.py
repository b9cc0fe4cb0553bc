"""The contract between the ext_proc server and the object that serves one HTTP stream
(``Exchange``), what an exchange asks of the Envoy protocol (rewrite the request, change the
response's start, or answer at once: Envoy's immediate response), and what one API path is
(``Endpoint``, listed in ``endpoints.registry``).

The bottom of the package: everything else may import it; it imports only ``translate.errors``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .translate.errors import AnthropicHTTPError, HTTPError


@dataclass
class Reply:
    """An immediate response."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)  # more response headers (e.g. Retry-After)

    @classmethod
    def error(cls, exc: HTTPError, headers: dict[str, str] | None = None) -> Reply:
        return cls(exc.status, exc.body(), headers=headers or {})


@dataclass
class Rewrite:
    """What the request becomes on its way to the producer."""

    body: bytes
    path: str
    set_headers: dict[str, str] = field(default_factory=dict)
    # The prompt as token ids (and its cache_salt): what producer routing keys on.
    prompt_ids: list[int] | None = None
    cache_salt: str | None = None
    lora: tuple[str, str] | None = None  # the LoRA adapter's (name, path): vLLM's block hashes include it
    media: tuple[tuple[str, int, int], ...] = ()  # the images (hash, offset, length): so do they
    # The producer replica routing chose ("IP:PORT"), handed to Envoy as dynamic metadata.
    destination: str | None = None
    # Work for the time the producer takes to answer, once the request has gone on.
    then: Callable[[], None] | None = None


@dataclass
class ResponseStart:
    """How the response headers change; ``buffer`` asks for the whole body at once."""

    set_headers: dict[str, str]
    remove_headers: list[str]
    buffer: bool


class Exchange(Protocol):
    """One HTTP stream's request and response, as the ext_proc server drives them, in this order:
    ``request_body`` once; then ``response_headers``; then, if ``stream`` is set, ``response_chunk``
    for every body chunk Envoy sends (one reply each), else ``response_body`` once with the whole
    body; ``close`` always, last (``complete``: the client got the whole answer)."""

    @property
    def stream(self) -> Any:
        """Set by ``response_headers`` when the producer's answer is streamed to the client."""

    routed: Any  # what producer routing decided (``routing.balance.Decision``), for the log line

    async def request_body(self, body: bytes) -> Rewrite | Reply: ...

    def response_headers(self, status: int, upstream: str | None = None) -> ResponseStart: ...

    async def response_chunk(self, chunk: bytes, end: bool) -> bytes:
        """Client bytes for one producer body chunk.

        Always a coroutine (render-tier mode awaits its /derender calls): awaiting one costs
        0.22-0.36 us per chunk here, less than a plain call followed by ``inspect.isawaitable``
        (0.44-0.58 us), the previous contract.
        """
        ...

    async def response_body(self, body: bytes) -> tuple[bytes, int | None]:
        """The whole producer body -> the client's body and a new status, if any."""
        ...

    def close(self, complete: bool) -> None: ...


class Answered:
    """The base of an exchange that answers at once (its ``request_body`` returns a ``Reply`` or
    raises ``HTTPError``): no producer is reached, so the response steps of ``Exchange`` never come."""

    stream: Any = None
    routed: Any = None

    async def request_body(self, body: bytes) -> Rewrite | Reply:
        raise NotImplementedError

    def response_headers(self, status: int, upstream: str | None = None) -> ResponseStart:
        raise RuntimeError(f"{type(self).__name__} answers at once: no producer response comes")

    async def response_chunk(self, chunk: bytes, end: bool) -> bytes:
        raise RuntimeError(f"{type(self).__name__} answers at once: no producer response comes")

    async def response_body(self, body: bytes) -> tuple[bytes, int | None]:
        raise RuntimeError(f"{type(self).__name__} answers at once: no producer response comes")

    def close(self, complete: bool) -> None:
        pass


@dataclass(frozen=True)
class Endpoint:
    """One API path the filter serves: what ``endpoints.registry`` lists, one line each."""

    path: str
    # (Model, producer, x-request-id) -> the Exchange of one request, for a model served here
    exchange: Callable[[Any, Any, str | None], Exchange]
    anthropic: bool = False  # its clients read errors in Anthropic's shape
    # Render-tier mode (``--render-url``): (render tier, producer, x-request-id) -> the exchange of one
    # request (``endpoints.rendertier``); None: a 501 saying ``not_in_tier``.
    tier: Callable[[Any, Any, str | None], Exchange] | None = None
    not_in_tier: str = ""
    # The paths below it (``path/...``, e.g. a stored response): (the default backend's model, None in
    # render-tier mode; the method; the rest of the path) -> the answer, or HTTPError.
    under: Callable[[Any, str, str], Awaitable[Reply]] | None = None

    def error(self, exc: HTTPError) -> HTTPError:
        """``exc`` in the shape this endpoint's clients read."""
        return AnthropicHTTPError.of(exc) if self.anthropic else exc
