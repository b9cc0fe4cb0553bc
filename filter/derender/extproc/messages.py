"""ext_proc's messages as the filter builds them: header maps and mutations, immediate answers, body
mutations, the mode overrides for a response's rest, and the ask to wait longer for an answer."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf.duration_pb2 import Duration

from ..translate.errors import HTTPError


def _response_body_only(mode: int) -> processing_mode_pb2.ProcessingMode:
    """A ``mode_override`` for the rest of a response: its body in ``mode``, nothing else.

    Every field is set: an override that leaves a body mode out turns that body off.
    """
    M = processing_mode_pb2.ProcessingMode
    return M(
        request_header_mode=M.SKIP,
        response_header_mode=M.SKIP,
        request_body_mode=M.NONE,
        response_body_mode=mode,
        request_trailer_mode=M.SKIP,
        response_trailer_mode=M.SKIP,
    )


# Non-streaming and error responses: the whole body at once.
_BUFFERED_RESPONSE = _response_body_only(processing_mode_pb2.ProcessingMode.BUFFERED)
# Envoy's own reply to a request the filter never saw the body of (e.g. 413): let it through.
_PASS_RESPONSE = _response_body_only(processing_mode_pb2.ProcessingMode.NONE)


def _header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    out = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def _mutation(set_headers: dict[str, str] | None = None, remove: list[str] | tuple[str, ...] = ()) -> pb.HeaderMutation:
    m = pb.HeaderMutation(remove_headers=list(remove))
    for key, value in (set_headers or {}).items():
        m.set_headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
        )
    return m


def immediate(
    status: int, body: bytes, content_type: str = "application/json", headers: dict[str, str] | None = None
) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=_mutation({"content-type": content_type, **(headers or {})}),
            body=body,
            details="derender",
        )
    )


def _error(exc: HTTPError) -> pb.ProcessingResponse:
    return immediate(exc.status, exc.body())


def _body_mutation(body: bytes) -> pb.BodyMutation:
    return pb.BodyMutation(body=body) if body else pb.BodyMutation(clear_body=True)


async def _extend(write: Callable[[pb.ProcessingResponse], Awaitable[None]], seconds: float) -> None:
    """Ask Envoy to wait ``seconds`` more for the answer it waits for (the filter holds it: flow control)."""
    await write(pb.ProcessingResponse(override_message_timeout=Duration(seconds=math.ceil(seconds))))
