"""An answer the filter gives by itself, as Envoy's immediate response."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import HTTPError


@dataclass
class Reply:
    """An immediate response."""

    status: int
    body: bytes
    content_type: str = "application/json"

    @classmethod
    def error(cls, exc: HTTPError) -> Reply:
        return cls(exc.status, exc.body())
