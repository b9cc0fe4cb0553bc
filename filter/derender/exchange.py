"""The contract between the ext_proc server, the stages around a request and the object that serves
one HTTP stream (``Exchange``): what an exchange asks of the Envoy protocol (rewrite the request,
change the response's start, or answer at once: Envoy's immediate response), what it tells the stages
(``Report``: what the client asked, the producer's answer, the timings, usage as the client saw it),
what a key's budget may ask of it (``limit``, ``held``, ``resume``, ``cut``), and what one API path is
(``Endpoint``, listed in ``endpoints.registry``).

The bottom of the package: everything else may import it; it imports only ``translate``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from .translate.errors import AnthropicHTTPError, HTTPError
from .translate.model import Model


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


# Headers a client may send that the producer must not see: a rewrite drops them.
STRIP_REQUEST_HEADERS = ("authorization", "cookie", "proxy-authorization", "x-api-key")


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


@dataclass
class Asked:
    """What the client asked, in the terms the stages read (budgets, traces, the request log)."""

    model: str | None = None  # as the body names it (a refused body's, as far as it is JSON)
    stream: bool = False
    n: int = 1
    max_tokens: int | None = None  # the engine's cap on each choice
    named_max: bool = False  # the client set that cap itself (max_tokens and its aliases)
    sampling: dict[str, float] = field(default_factory=dict)  # OpenTelemetry's gen_ai.request.* attributes
    images: int = 0


@dataclass(eq=False)
class Report:
    """What an exchange tells the stages of its request, kept as it goes; final once it is closed.

    The exchange writes it; the stages read it (a refusing budget sets ``client_status``)."""

    name: str = ""  # the request log's message (chat, messages, ...); "": an exchange that logs nothing
    operation: str = ""  # gen_ai.operation.name (OpenTelemetry GenAI conventions), the metrics' label
    logger: str = "derender"  # the logger of its log line
    asked: Asked = field(default_factory=Asked)
    model: str | None = None  # the model served, as logs, metrics and traces name it
    request_id: str | None = None  # the client's response id (chatcmpl-..., msg_..., resp_...)
    x_request_id: str | None = None
    prompt_tokens: int | None = None  # None: never reached a producer
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # the prompt tokens the producer says it had cached
    status: int = 0  # the producer's
    client_status: int = 0  # what the client got
    error: str | None = None  # the first failure (``endpoints.lifecycle.FAILURES``)
    complete: bool = False  # the client got the whole answer
    upstream: str | None = None  # the producer replica Envoy reached
    aborted: bool = False  # the producer was told to stop this request
    finish_reasons: list[str] = field(default_factory=list)  # as the client read them where its API has them
    keep_finish_reasons: bool = False  # a stage wants the client's finish reasons (sampled traces)
    # time.monotonic() when the request's headers came, and seconds from then to each step
    started: float = field(default_factory=time.monotonic)
    body_at: float | None = None
    render_time: float | None = None
    headers_at: float | None = None  # the producer's response headers
    first_token: float | None = None  # an instant, like ``started``
    fields: dict[str, object] = field(default_factory=dict)  # the exchange's own log fields

    @property
    def outcome(self) -> str | None:
        """The error the request ended with, as logs, metrics and traces name it (None: success)."""
        error = self.error or (None if self.complete else "cancelled")
        if error is None and self.client_status >= 400:
            error = str(self.client_status)
        return error


class Aborts(Protocol):
    """What an exchange asks of the producers it sends to (``routing.producer``)."""

    stall_timeout: float

    def abort_soon(self, request_id: str, why: str, upstream: str | None = None) -> None: ...


class Exchange(Protocol):
    """One HTTP stream's request and response, as the ext_proc server drives them, in this order:
    ``request_body`` once; then ``response_headers``; then, if ``streaming``, ``response_chunk``
    for every body chunk Envoy sends (one reply each), else ``response_body`` once with the whole
    body; ``close`` always, last (``complete``: the client got the whole answer)."""

    report: Report

    @property
    def streaming(self) -> bool:
        """Set by ``response_headers`` when the producer's answer is streamed to the client."""
        ...

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

    def close(self, complete: bool) -> None:
        """The exchange is over: ``report`` is final."""
        ...

    # -- what a key's token budget may ask (``stages.budget``) -----------------
    def limit(self, tokens: int, rewrite: Rewrite, outrun: bool) -> bool:
        """Hold the answer's events past ``tokens`` completion tokens (``held``) for the budget to
        decide; ``outrun``: the request may generate more than that, so an answer not streamed is
        streamed from the producer (``rewrite``'s body). False: this exchange cannot hold its answer."""
        ...

    @property
    def held(self) -> bool:
        """Events wait at the token limit."""
        ...

    @property
    def generated(self) -> int:
        """Completion tokens received so far."""
        ...

    async def resume(self, tokens: int) -> bytes:
        """The held events, now that the limit is ``tokens``."""
        ...

    async def cut(self) -> bytes:
        """End the answer at the tokens generated so far, as the engine ends one at ``max_tokens``."""
        ...


class Unmetered:
    """What a key's budget finds in an exchange that cannot hold its answer (``Exchange.limit``):
    the base of those exchanges, and of ``endpoints.lifecycle.ProducerExchange``, whose chat-based
    exchanges can."""

    def limit(self, tokens: int, rewrite: Rewrite, outrun: bool) -> bool:
        return False

    @property
    def held(self) -> bool:
        return False

    @property
    def generated(self) -> int:
        return 0

    async def resume(self, tokens: int) -> bytes:
        return b""

    async def cut(self) -> bytes:
        return b""


class Answered(Unmetered):
    """The base of an exchange that answers at once (its ``request_body`` returns a ``Reply`` or
    raises ``HTTPError``): no producer is reached, so the response steps of ``Exchange`` never come."""

    streaming = False

    def __init__(self) -> None:
        self.report = Report()

    async def request_body(self, body: bytes) -> Rewrite | Reply:
        raise NotImplementedError

    def response_headers(self, status: int, upstream: str | None = None) -> ResponseStart:
        raise RuntimeError(f"{type(self).__name__} answers at once: no producer response comes")

    async def response_chunk(self, chunk: bytes, end: bool) -> bytes:
        raise RuntimeError(f"{type(self).__name__} answers at once: no producer response comes")

    async def response_body(self, body: bytes) -> tuple[bytes, int | None]:
        raise RuntimeError(f"{type(self).__name__} answers at once: no producer response comes")

    def close(self, complete: bool) -> None:
        self.report.complete = complete


class RenderTierClient(Protocol):
    """What render-tier mode's exchanges are built with (``endpoints.tier_client.RenderTier``)."""

    url: str


@dataclass(frozen=True)
class Endpoint:
    """One API path the filter serves: what ``endpoints.registry`` lists, one line each."""

    path: str
    # (Model, producers, x-request-id) -> the Exchange of one request, for a model served here
    exchange: Callable[[Model, Aborts, str | None], Exchange]
    anthropic: bool = False  # its clients read errors in Anthropic's shape
    # Render-tier mode (``--render-url``): (render tier, producers, x-request-id) -> the exchange of one
    # request (``endpoints.rendertier``); None: a 501 saying ``not_in_tier``.
    tier: Callable[[RenderTierClient, Aborts, str | None], Exchange] | None = None
    not_in_tier: str = ""
    # The paths below it (``path/...``, e.g. a stored response): (the default backend's model, None in
    # render-tier mode; the method; the rest of the path) -> the answer, or HTTPError.
    under: Callable[[Model | None, str, str], Awaitable[Reply]] | None = None

    def error(self, exc: HTTPError) -> HTTPError:
        """``exc`` in the shape this endpoint's clients read."""
        return AnthropicHTTPError.of(exc) if self.anthropic else exc
