"""What an exchange asks of the Envoy protocol: rewrite the request, change the response's start,
or answer at once (Envoy's immediate response)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..translate.errors import HTTPError


@dataclass
class Reply:
    """An immediate response."""

    status: int
    body: bytes
    content_type: str = "application/json"

    @classmethod
    def error(cls, exc: HTTPError) -> Reply:
        return cls(exc.status, exc.body())


@dataclass
class Rewrite:
    """What the request becomes on its way to the producer."""

    body: bytes
    path: str
    set_headers: dict[str, str] = field(default_factory=dict)
    # The prompt as token ids (and its cache_salt): what producer routing keys on.
    prompt_ids: list[int] | None = None
    cache_salt: str | None = None
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
