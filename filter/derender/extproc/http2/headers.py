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

from .wire import (
    COMPRESSION_ERROR,
    CONTINUATION,
    END_HEADERS,
    ENHANCE_YOUR_CALM,
    HEADERS,
    PROTOCOL_ERROR,
    ConnectionError_,
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
    method: str
    encoding: bytes | None  # grpc-encoding
    content_length: int | None
    metadata: dict[str, str]  # the request's other fields (gRPC's custom metadata), for the handler


class FieldDecoder:
    """The peer's HPACK state: a block decoded whole, then measured against SETTINGS_MAX_HEADER_LIST_SIZE."""

    def __init__(self, max_header_list: int) -> None:
        self.max_header_list = max_header_list
        self.decoder = Decoder()
        self.decoder.max_header_list_size = max_header_list * DECODE_FACTOR

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


class FieldEncoder:
    """The server's HPACK state: header blocks out, split at the peer's frame size."""

    def __init__(self) -> None:
        self.encoder = Encoder()

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
    return Request(pseudo[b":path"].decode("latin-1"), pseudo[b":method"].decode("latin-1"), encoding, length, metadata)


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


class Gatherer:
    """One header block at a time: its HEADERS and CONTINUATION frames gathered within the bounds
    (bytes, frames), then decoded whole so that both ends' tables stay the same."""

    def __init__(self, max_header_list: int, max_header_block: int, max_continuations: int) -> None:
        self.fields = FieldDecoder(max_header_list)
        self.max_header_block = max_header_block
        self.max_continuations = max_continuations
        self.block: HeaderBlock | None = None  # until its END_HEADERS

    def start(self, stream_id: int, flags: int, body: bytes, dependency: int | None) -> bool:
        """A HEADERS frame's block fragment; True when the block is whole."""
        if len(body) > self.max_header_block:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "header block too large", "continuation_flood")
        self.block = HeaderBlock(stream_id, flags, body, dependency)
        return bool(flags & END_HEADERS)

    def more(self, stream_id: int, payload: bytes) -> None:
        """A CONTINUATION frame's fragment (``bound`` then judges the block's size)."""
        block = self.block
        if block is None or block.stream_id != stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        block.frames += 1
        block.data += payload

    def bound(self) -> None:
        block = self.block
        assert block is not None
        if block.frames > self.max_continuations + 1 or len(block.data) > self.max_header_block:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "header block too large", "continuation_flood")

    def done(self) -> tuple[HeaderBlock, list[tuple[bytes, bytes]], str]:
        """The whole block, its fields, and why it is too large ("" if it is not)."""
        block, self.block = self.block, None
        assert block is not None
        try:
            return block, self.fields.decode(bytes(block.data)), ""
        except TooLarge as exc:
            return block, [], str(exc)
