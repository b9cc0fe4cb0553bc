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


# A request the worker's leg answers (``extproc.leg``): its body as before, nothing of its response.
_M = processing_mode_pb2.ProcessingMode
LEG_MODE = _M(request_header_mode=_M.SEND, request_body_mode=_M.BUFFERED, request_trailer_mode=_M.SKIP,
              response_header_mode=_M.SKIP, response_body_mode=_M.NONE, response_trailer_mode=_M.SKIP)  # fmt: skip
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


def body_reply(body: bytes) -> pb.ProcessingResponse:
    """A streamed response chunk's reply: its body replaced by ``body`` (cleared if empty)."""
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=_body_mutation(body)))
    )


class Encoded(bytes):
    """A reply already in its wire form, for a transport that sends ``SerializeToString()`` (the
    filter's own HTTP/2; grpc.aio serializes with the message class and takes only messages)."""

    __slots__ = ()

    def SerializeToString(self) -> bytes:  # protobuf's name
        return self


# ``body_reply``'s wire form around the body: ProcessingResponse.response_body (field 4) >
# BodyResponse.response (1) > CommonResponse.body_mutation (3) > BodyMutation.body (1), each a
# length-delimited field; an empty body is BodyMutation.clear_body (2) = true.
_CLEARED = Encoded(b'"\x06\n\x04\x1a\x02\x10\x01')


_ONE_BYTE = tuple(bytes((n,)) for n in range(0x80))


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _ONE_BYTE[n]
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encoded_body_reply(body: bytes) -> Encoded:
    """``body_reply(body)`` as protobuf writes it (``tests/test_transport.py`` holds them
    equal), built by hand: the four nested messages cost 3-5 us of upb per token, this about 1."""
    if not body:
        return _CLEARED
    n = len(body)
    mutation = _varint(n)
    m = 1 + len(mutation) + n  # BodyMutation
    common = _varint(m)
    c = 1 + len(common) + m  # CommonResponse
    response = _varint(c)
    r = 1 + len(response) + c  # BodyResponse
    return Encoded(b"".join((b'"', _varint(r), b"\n", response, b"\x1a", common, b"\n", mutation, body)))


async def _extend(write: Callable[[pb.ProcessingResponse], Awaitable[None]], seconds: float) -> None:
    """Ask Envoy to wait ``seconds`` more for the answer it waits for (the filter holds it: flow control)."""
    await write(pb.ProcessingResponse(override_message_timeout=Duration(seconds=math.ceil(seconds))))
