"""Header blocks: HEADERS and CONTINUATION frames gathered within their bounds, HPACK (the ``hpack``
package), and RFC 9113's rules for a request's fields.

A block is always decoded whole, so that both ends' HPACK tables stay the same; only then is it
judged. A broken encoding is a connection error (COMPRESSION_ERROR); a malformed request (RFC 9113
section 8.1.1: uppercase or invalid names, NUL / CR / LF in a value, pseudo-header fields missing,
repeated, unknown or after the others, connection-specific fields) breaks its stream only. A field
value that is not UTF-8 is no error, as in grpc-core: the fields are kept as bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import cast

from hpack import Decoder, Encoder
from hpack.exceptions import HPACKError, OversizedHeaderListError

from .state import ConnectionState
from .wire import (
    COMPRESSION_ERROR,
    CONTINUATION,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FRAME_SIZE_ERROR,
    HEADERS,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    RESOURCE_EXHAUSTED,
    STREAM_CLOSED,
    UNIMPLEMENTED,
    ConnectionError_,
    StreamError,
    frame,
)

# RFC 9113 section 8.2.1: no controls, space, uppercase, DEL, non-ASCII or colon in a name; no NUL,
# CR or LF in a value, nor whitespace at either end.
BAD_NAME = re.compile(rb"[\x00-\x20A-Z\x7f-\xff:]")
BAD_VALUE = re.compile(rb"[\x00\r\n]|\A[ \t]|[ \t]\Z")
CONNECTION_SPECIFIC = frozenset((b"connection", b"proxy-connection", b"keep-alive", b"transfer-encoding", b"upgrade"))
REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))
# The decoded block is never allowed past this many times the advertised list size: an HPACK
# bomb (a few bytes naming a large table entry, over and over) is stopped here.
DECODE_FACTOR = 16


class Malformed(Exception):
    """A request or trailers RFC 9113 calls malformed: a stream error (PROTOCOL_ERROR)."""


class TooLarge(Exception):
    """Decoded fields past SETTINGS_MAX_HEADER_LIST_SIZE: the stream is refused (RESOURCE_EXHAUSTED)."""


@dataclass(slots=True)
class Request:
    path: str
    encoding: bytes | None  # grpc-encoding
    content_length: int | None
    metadata: dict[str, str]  # the request's other fields (gRPC's custom metadata), for the handler


class Codec:
    """One connection's HPACK state, both ways."""

    def __init__(self, max_header_list: int) -> None:
        self.max_header_list = max_header_list
        self.decoder = Decoder()
        self.decoder.max_header_list_size = max_header_list * DECODE_FACTOR
        self.encoder = Encoder()

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        try:
            fields = cast("list[tuple[bytes, bytes]]", self.decoder.decode(block, raw=True))
        except OversizedHeaderListError:
            raise ConnectionError_(
                ENHANCE_YOUR_CALM, "header block decodes past its bound", "continuation_flood"
            ) from None
        except HPACKError as exc:
            raise ConnectionError_(COMPRESSION_ERROR, f"HPACK: {exc}") from None
        if sum(len(n) + len(v) + 32 for n, v in fields) > self.max_header_list:
            raise TooLarge(f"header list larger than {self.max_header_list} bytes")
        return fields

    def peer_table_size(self, size: int) -> None:
        """The peer's SETTINGS_HEADER_TABLE_SIZE: what the encoder may use (never past 4096 here)."""
        self.encoder.header_table_size = min(size, 4096)

    def frames(self, stream_id: int, fields: list[tuple[str, str]], flags: int, max_frame: int) -> bytes:
        """HEADERS (with ``flags``) and, past the peer's frame size, CONTINUATION frames: one block, in one piece."""
        block = self.encoder.encode(fields)
        if len(block) <= max_frame:
            return frame(HEADERS, flags | END_HEADERS, stream_id, block)
        out = [frame(HEADERS, flags, stream_id, block[:max_frame])]
        for at in range(max_frame, len(block), max_frame):
            last = at + max_frame >= len(block)
            out.append(frame(CONTINUATION, END_HEADERS if last else 0, stream_id, block[at : at + max_frame]))
        return b"".join(out)


def _check_field(name: bytes, value: bytes) -> None:
    if not name or BAD_NAME.search(name, 1 if name[:1] == b":" else 0):
        raise Malformed(f"invalid field name {name[:64]!r}")
    if BAD_VALUE.search(value):
        raise Malformed(f"invalid value of field {name[:64]!r}")


def request(fields: list[tuple[bytes, bytes]]) -> Request:
    """A request's fields judged by RFC 9113 section 8.3.1; what the server needs of them."""
    pseudo: dict[bytes, bytes] = {}
    regular = False
    encoding = length = None
    metadata: dict[str, str] = {}
    for name, value in fields:
        _check_field(name, value)
        if name[:1] == b":":
            if regular:
                raise Malformed("pseudo-header field after a regular field")
            if name not in REQUEST_PSEUDO:
                raise Malformed(f"pseudo-header field {name[:64]!r} in a request")
            if name in pseudo:
                raise Malformed(f"{name.decode()} repeated")
            pseudo[name] = value
            continue
        regular = True
        if name in CONNECTION_SPECIFIC:
            raise Malformed(f"connection-specific field {name.decode()}")
        if name == b"te" and value != b"trailers":
            raise Malformed("te other than trailers")
        if name == b"grpc-encoding":
            encoding = value
        elif name == b"content-length":
            if not value.isdigit() or (length is not None and int(value) != length):
                raise Malformed("invalid content-length")
            length = int(value)
        elif name != b"te":
            metadata[name.decode("latin-1")] = value.decode("latin-1")
    for name in (b":method", b":scheme", b":path"):
        if name not in pseudo:
            raise Malformed(f"{name.decode()} missing")
    if not pseudo[b":path"]:
        raise Malformed(":path empty")
    return Request(pseudo[b":path"].decode("latin-1"), encoding, length, metadata)


def trailers(fields: list[tuple[bytes, bytes]]) -> None:
    """A request's trailers: regular fields only."""
    for name, value in fields:
        _check_field(name, value)
        if name[:1] == b":":
            raise Malformed("pseudo-header field in trailers")
        if name in CONNECTION_SPECIFIC:
            raise Malformed(f"connection-specific field {name.decode()}")


class HeaderBlock:
    __slots__ = ("data", "dependency", "flags", "frames", "stream_id")

    def __init__(self, stream_id: int, flags: int, data: bytes, dependency: int | None) -> None:
        self.stream_id = stream_id
        self.flags = flags
        self.data = bytearray(data)
        self.frames = 1
        self.dependency = dependency


class HeaderSide(ConnectionState):
    """HEADERS and CONTINUATION frames of a ``Connection``: a block gathered within its bounds, decoded,
    then judged: trailers end a stream, a new stream is opened, refused or answered at once."""

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0 or stream_id % 2 == 0:
            raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        body = self._unpad(flags, payload)
        dependency = None
        if flags & PRIORITY_FLAG:
            if len(body) < 5:
                raise ConnectionError_(FRAME_SIZE_ERROR, "short HEADERS priority", "frame_size")
            dependency = int.from_bytes(body[:4], "big") & 0x7FFFFFFF
            body = body[5:]
        if body:
            self.empty_run = 0
        elif not flags & END_STREAM:
            self._empty()
        if len(body) > self.limits.max_header_block:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "header block too large", "continuation_flood")
        self.header_block = HeaderBlock(stream_id, flags, body, dependency)
        if flags & END_HEADERS:
            self._header_block_done()

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        block = self.header_block
        if block is None or block.stream_id != stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        block.frames += 1
        block.data += payload
        if payload:
            self.empty_run = 0
        elif not flags & END_HEADERS:
            self._empty()
        if block.frames > self.limits.max_continuations + 1 or len(block.data) > self.limits.max_header_block:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "header block too large", "continuation_flood")
        if flags & END_HEADERS:
            self._header_block_done()

    def _header_block_done(self) -> None:
        block, self.header_block = self.header_block, None
        assert block is not None
        stream_id, flags = block.stream_id, block.flags
        try:
            decoded = self.codec.decode(bytes(block.data))
        except TooLarge as exc:
            too_large = str(exc)
            decoded = []
        else:
            too_large = ""
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers
            if stream.remote_closed:
                raise StreamError(stream_id, STREAM_CLOSED, "HEADERS after the end of the stream")
            if not flags & END_STREAM:
                raise StreamError(stream_id, PROTOCOL_ERROR, "HEADERS without END_STREAM on an open stream")
            if too_large:
                raise StreamError(stream_id, PROTOCOL_ERROR, too_large)
            try:
                trailers(decoded)
            except Malformed as exc:
                raise StreamError(stream_id, PROTOCOL_ERROR, str(exc)) from None
            self._end_of_input(stream)
            return
        if stream_id <= self.last_stream:
            self._closed_stream(stream_id, HEADERS)
            return
        self.last_stream = stream_id
        self.streams_opened += 1
        if block.dependency == stream_id:
            raise StreamError(stream_id, PROTOCOL_ERROR, "a stream that depends on itself")
        if too_large:
            self.server.defended("header_list_size")
            self._take_reset()
            self._trailers_only(stream_id, RESOURCE_EXHAUSTED, too_large, flags & END_STREAM)
            return
        try:
            asked = request(decoded)
        except Malformed as exc:
            raise StreamError(stream_id, PROTOCOL_ERROR, str(exc)) from None
        if self.server.draining or self.goaway_phase == 2:  # after the last stream id was sent
            self._refuse(stream_id)
            return
        limit = self.limits.max_concurrent_streams
        if len(self.streams) >= limit or self.running >= limit:
            self.server.defended("max_streams")
            self._take_reset()
            self._refuse(stream_id)
            return
        method = self.server.methods.get(asked.path)
        if method is None or asked.encoding not in (None, b"identity"):
            why = f"unknown method {asked.path[:200]}" if method is None else "compressed"
            self._trailers_only(stream_id, UNIMPLEMENTED, why, flags & END_STREAM)
            return
        self._open(stream_id, method, asked.content_length, flags & END_STREAM, asked.metadata)
