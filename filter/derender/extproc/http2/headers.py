"""Header blocks: HPACK (the ``hpack`` package) and RFC 9113's rules for a request's fields.

A block is always decoded whole, so that both ends' HPACK tables stay the same; only then is it
judged. A broken encoding is a connection error (COMPRESSION_ERROR); a malformed request (RFC 9113
section 8.1.1: uppercase or invalid names, NUL / CR / LF in a value, pseudo-header fields missing,
repeated, unknown or after the others, connection-specific fields) breaks its stream only. A field
value that is not UTF-8 is no error, as in grpc-core: the fields are kept as bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hpack import Decoder, Encoder
from hpack.exceptions import HPACKError, OversizedHeaderListError

from .wire import CONTINUATION, END_HEADERS, ENHANCE_YOUR_CALM, COMPRESSION_ERROR, HEADERS, ConnectionError_, frame

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


class Codec:
    """One connection's HPACK state, both ways."""

    def __init__(self, max_header_list: int) -> None:
        self.max_header_list = max_header_list
        self.decoder = Decoder()
        self.decoder.max_header_list_size = max_header_list * DECODE_FACTOR
        self.encoder = Encoder()

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        try:
            fields = self.decoder.decode(block, raw=True)
        except OversizedHeaderListError:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "header block decodes past its bound", "continuation_flood") from None
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
            out.append(frame(CONTINUATION, END_HEADERS if last else 0, stream_id, block[at:at + max_frame]))
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
    for name in (b":method", b":scheme", b":path"):
        if name not in pseudo:
            raise Malformed(f"{name.decode()} missing")
    if not pseudo[b":path"]:
        raise Malformed(":path empty")
    return Request(pseudo[b":path"].decode("latin-1"), encoding, length)


def trailers(fields: list[tuple[bytes, bytes]]) -> None:
    """A request's trailers: regular fields only."""
    for name, value in fields:
        _check_field(name, value)
        if name[:1] == b":":
            raise Malformed("pseudo-header field in trailers")
        if name in CONNECTION_SPECIFIC:
            raise Malformed(f"connection-specific field {name.decode()}")
