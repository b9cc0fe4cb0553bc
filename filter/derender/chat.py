"""``POST /v1/chat/completions``: one request/response exchange through the filter.

Request: the OpenAI body is rendered into the producer's ``GenerateRequest``
and the path becomes ``/inference/v1/generate``. Response: token events become
``chat.completion.chunk`` frames (streaming) or one ``chat.completion`` object;
producer errors become OpenAI errors with the producer's status.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from .derender import ChatStream, chat_completion
from .errors import HTTPError, error_body
from .model import Model
from .producer import GENERATE_PATH, Producer
from .render import Rendered, render_chat
from .sse import SSEDecoder

log = logging.getLogger("derender.chat")


@dataclass
class Rewrite:
    """What the request becomes on its way to the producer."""

    body: bytes
    path: str
    set_headers: dict[str, str] = field(default_factory=dict)


@dataclass
class ResponseStart:
    """How the response headers change; ``buffer`` asks for the whole body at once."""

    set_headers: dict[str, str]
    remove_headers: list[str]
    buffer: bool


class ChatExchange:
    def __init__(self, model: Model, producer: Producer, x_request_id: str | None) -> None:
        self.model = model
        self.producer = producer
        self.x_request_id = x_request_id
        self.rendered: Rendered | None = None
        self.stream: ChatStream | None = None
        self.status = 0
        self._sse = SSEDecoder()
        self._started = time.monotonic()
        self._first_token: float | None = None
        self._aborted = False

    # -- request ---------------------------------------------------------------
    async def request_body(self, body: bytes) -> Rewrite:
        self.rendered = await render_chat(self.model, body, self.x_request_id)
        return Rewrite(
            body=self.rendered.body,
            path=GENERATE_PATH,
            set_headers={"content-type": "application/json"},
        )

    # -- response --------------------------------------------------------------
    def response_headers(self, status: int) -> ResponseStart:
        assert self.rendered is not None
        self.status = status
        if status == 200 and self.rendered.stream:
            self.stream = ChatStream(self.model, self.rendered)
            return ResponseStart(
                {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"},
                ["content-length"],
                buffer=False,
            )
        return ResponseStart({"content-type": "application/json"}, ["content-length"], buffer=True)

    def response_chunk(self, chunk: bytes, end: bool) -> bytes:
        """Streaming: one body chunk of SSE from the producer -> client bytes."""
        stream = self.stream
        assert stream is not None
        out: list[bytes] = []
        try:
            payloads = self._sse.feed(chunk)
            if end:
                payloads += self._sse.close()
        except ValueError as exc:
            payloads = []
            out.append(stream.fail(502, f"invalid producer stream: {exc}"))
        for payload in payloads:
            data, abort = stream.feed(payload)
            out.append(data)
            if abort:
                self._abort("stop string")
        if end:
            out.append(stream.end())
        if self._first_token is None and stream.completion_tokens:
            self._first_token = time.monotonic()
        return b"".join(out)

    async def response_body(self, body: bytes) -> tuple[bytes, int | None]:
        """Buffered: the producer's whole body -> (client body, new status or None)."""
        assert self.rendered is not None
        if self.status != 200:
            return producer_error(self.status, body), None
        try:
            return await chat_completion(self.model, self.rendered, body), None
        except HTTPError as exc:
            return exc.body(), exc.status

    def close(self, complete: bool) -> None:
        """The exchange is over; ``complete`` is False if the client or Envoy cut it."""
        if self.stream is not None and not self.stream.finished and not complete:
            self._abort("client gone")
        elapsed = time.monotonic() - self._started
        log.info(
            "chat request_id=%s status=%s stream=%s tokens=%s complete=%s duration_ms=%.1f",
            self.rendered.request_id if self.rendered else None,
            self.status,
            bool(self.rendered and self.rendered.stream),
            self.stream.completion_tokens if self.stream else None,
            complete,
            elapsed * 1000,
        )

    def _abort(self, why: str) -> None:
        if self._aborted or self.rendered is None:
            return
        self._aborted = True
        request_id = (self.stream and self.stream.producer_request_id) or producer_request_id(
            self.x_request_id, self.rendered.request_id
        )
        self.producer.abort_soon(request_id, why)


def producer_request_id(x_request_id: str | None, request_id: str) -> str:
    """The id the producer gives its engine request (``generate-tokens-...``)."""
    return f"generate-tokens-{x_request_id or request_id}"


def producer_error(status: int, body: bytes) -> bytes:
    """A producer (or upstream) error body -> an OpenAI error with the same status."""
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and "message" in error:
            return error_body(status, str(error["message"]), error.get("type"), error.get("param"))
    except (ValueError, AttributeError):
        pass
    text = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status}"
    return error_body(status, f"producer error: {text}")
