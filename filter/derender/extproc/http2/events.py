"""What a connection's ``Machine`` tells the code that runs it: one small type per event, taken
from ``Machine.events`` after each call into it (the messages handed to waiting handlers from
``Machine.handed``, bytes to send from ``Machine.data_to_send``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Opened:
    """A request stream to serve: its handler starts."""

    stream_id: int
    path: str
    metadata: dict[str, str]  # its fields but the pseudo-headers, content-length and te (gRPC's custom metadata)
    method: str = "POST"


@dataclass(slots=True)
class Message:
    """The next message of a stream whose handler waits to read (``Machine.read`` found none): its
    bytes, or ``EOF`` once the peer is done sending. A handler that no longer waits gives it back
    (``Machine.unread``). The machine hands these as plain ``(stream_id, item)`` pairs in
    ``Machine.handed`` (one per token: no object each), before the other events of the same call."""

    stream_id: int
    item: object


@dataclass(slots=True)
class Ended:
    """The stream ended before its handler finished (a reset by either side, a refused message, the
    connection gone): the handler is cancelled, and nothing more is sent for it."""

    stream_id: int


@dataclass(slots=True)
class Drained:
    """The reply a stream's handler waits on has left (the peer's windows opened)."""

    stream_id: int


@dataclass(slots=True)
class Defended:
    """A defence acted (its name for the metrics; ``why`` for the log, "" to count it only)."""

    name: str
    why: str = ""


@dataclass(slots=True)
class Close:
    """Close the socket once what is written has left (the last bytes are in ``data_to_send``)."""


Event = Opened | Message | Ended | Drained | Defended | Close
