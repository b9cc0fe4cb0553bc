"""A stream's handler and how it runs: ``Handler`` and ``Methods`` (what a ``Server`` serves) and
``serve_handler`` (a handler run to its gRPC status). Shared by ``connection.Connection`` and the
benchmark's h2 frame layer (``bench/h2lib``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from .wire import CANCELLED, OK, UNKNOWN, Status

# handler(read, write): read() -> the next request message, or EOF once the peer is done sending;
# write(message) sends one reply. It returns (or raises) to end the stream.
Handler = Callable[[Callable[[], Awaitable[object]], Callable[[object], Awaitable[None]]], Awaitable[None]]
# path -> (the request type's ``FromString``, the handler)
Methods = dict[str, tuple[Callable[[bytes], object], Handler]]
# The stream's request metadata (its fields but the pseudo-headers, content-length and te; gRPC's
# custom metadata), as its handler sees it: set in the handler's task before the handler runs.
METADATA: ContextVar[dict[str, str]] = ContextVar("http2_metadata", default={})  # noqa: B039 - never mutated


async def serve_handler(handler: Handler, read, write, stream, finish: Callable[[Any, int, str], None]) -> None:
    """Run a stream's handler: however it ends (it returns, raises ``Status`` or anything else, or is
    cancelled other than by a reset), ``finish(stream, status, message)`` gives the stream its gRPC
    status, as gRPC's servers do; a stream already ended (reset) gets nothing more."""
    status, why = OK, ""
    try:
        await handler(read, write)
    except asyncio.CancelledError:
        if stream.ended:  # reset: nothing more to send
            return
        status, why = CANCELLED, "cancelled"
        raise
    except Status as exc:
        status, why = exc.code, str(exc)
    except Exception as exc:  # noqa: BLE001 - the handler's failure is the stream's status
        status, why = UNKNOWN, f"{type(exc).__name__}: {exc}"
    finally:
        if not stream.ended:
            finish(stream, status, why)
