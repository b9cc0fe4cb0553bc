"""What every exchange that sends a request to a producer lives through, in one place.

``ProducerExchange`` is the base of the local exchanges (``chat.ChatExchange`` and the
endpoints built on it) and of render-tier mode's (``rendertier.TierExchange``): the
producer's status, Envoy giving up, the stall watch, aborting the producer request, a
failure counted once under its metric, and ``close`` -> one count and one log line
(``record``). Subclasses say what was sent (``sent``, ``request_id``, ``streamed``,
``prompt_tokens``) and add their own fields to the log line (``log_head``, ``log_tail``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..ops import metrics
from ..translate.errors import HTTPError
from ..translate.stall import StallWatch

# Envoy's own answers when it stops waiting for a producer that has not answered (its route
# timeout, its stream idle timeout): the producer may still be generating, so it is told to stop.
ENVOY_GAVE_UP = frozenset({408, 504})

# A failure's name (the request log's ``error``) -> its counter and label: what the producer did
# wrong (derender_producer_errors_total), output the filter or the render tier could not turn into
# an answer (derender_parser_errors_total).
FAILURES = {
    "producer_status": (metrics.producer_error, "status"),
    "producer_error": (metrics.producer_error, "error"),
    "producer_incomplete": (metrics.producer_error, "incomplete"),
    "producer_stall": (metrics.producer_error, "stall"),
    "parser_stream": (metrics.parser_error, "stream"),
    "parser_response": (metrics.parser_error, "response"),
    "parser_render_tier": (metrics.parser_error, "render_tier"),
}


class ProducerExchange:
    """The lifecycle of one exchange whose request goes on to a producer."""

    endpoint = ""  # the log line's message
    operation = ""  # gen_ai.operation.name (OpenTelemetry GenAI conventions), the metrics' label
    routed: Any = None  # the producer routing's Decision (routing.balance), for the log line
    trace: Any = None  # the request's ``ops.tracing.RequestTrace`` when traces are exported
    finish_reasons: tuple[str, ...] = ()  # a buffered answer's, per choice (the engine's)

    def __init__(self, producer: Any, x_request_id: str | None, log: logging.Logger) -> None:
        self.producer = producer  # a routing Producer or ClusterProducers: where aborts go
        self.x_request_id = x_request_id
        self.log = log
        self.stream: Any = None  # set once a streamed answer starts; has finished, whole, close()
        self.status = 0  # the producer's
        self.client_status = 0  # what the client got
        self.error: str | None = None  # the first failure (a FAILURES name)
        self._started = time.monotonic()
        self._first_token: float | None = None
        self._aborted = False
        self._answered = False  # a buffered (non-streaming) answer reached the filter whole
        self._upstream: str | None = None  # the producer replica Envoy reached (UPSTREAM_HEADER)
        self._watch: StallWatch | None = None  # streaming
        self._completion_tokens: int | None = None  # non-streaming: tokens in the producer's body
        self._asked_model: str | None = None  # a refused request's "model", for its log line
        self._asked_stream = False  # and whether it asked to stream

    @property
    def upstream(self) -> str | None:
        """The producer replica Envoy reached, once its response started."""
        return self._upstream

    @property
    def aborted(self) -> bool:
        """The producer was told to stop this request."""
        return self._aborted

    # -- what the subclass says ------------------------------------------------
    @property
    def sent(self) -> bool:
        """The request was rendered for a producer."""
        raise NotImplementedError

    @property
    def request_id(self) -> str:
        raise NotImplementedError

    @property
    def streamed(self) -> bool:
        """The client asked for a stream (read once ``sent``)."""
        raise NotImplementedError

    @property
    def prompt_tokens(self) -> int:
        raise NotImplementedError

    def log_head(self) -> dict[str, Any]:
        """The fields that name the request, first on its log line."""
        return {"request_id": self.request_id or None if self.sent else None, "x_request_id": self.x_request_id}

    def log_tail(self) -> dict[str, Any]:
        """The fields after the outcome."""
        return self.routed.fields() if self.routed is not None else {}

    def refused(self, body: bytes) -> None:
        """The request was refused before it went on: remember what it asked for the log line."""
        self._asked_model, self._asked_stream = asked(body)

    # -- the shared lifecycle --------------------------------------------------
    def response_started(self, status: int, upstream: str | None) -> None:
        """The producer's status; ``upstream``: the replica Envoy reached, where aborts go."""
        self._upstream = upstream
        self.status = self.client_status = status
        if status != 200:
            self._failed("producer_status")
        if status in ENVOY_GAVE_UP:
            self._abort("no answer")

    def watch_stalls(self) -> None:
        self._watch = StallWatch(self.request_id, self._stalled, self.producer.stall_timeout)
        self._watch.start()

    @property
    def completion_tokens(self) -> int | None:
        """The completion tokens received from the producer: the stream's, else the buffered answer's."""
        return self.stream.completion_tokens if self.stream is not None else self._completion_tokens

    def _failed(self, error: str) -> None:
        """Count the exchange's first failure (a ``FAILURES`` name)."""
        if self.error is None:
            self.error = error
            count, kind = FAILURES[error]
            count(kind)

    def _stalled(self) -> None:
        """The producer went quiet: abort its request; its last words end the client's stream."""
        if self.stream is None or self.stream.finished:
            return
        self._failed("producer_stall")
        self._abort("stalled")

    def _abort(self, why: str) -> None:
        if self._aborted or not self.sent:
            return
        self._aborted = True
        request_id = (self.stream and self.stream.producer_request_id) or producer_request_id(
            self.x_request_id, self.request_id
        )
        self.producer.abort_soon(request_id, why, self._upstream)

    def closing(self) -> None:
        """Subclass work at ``close``, before the producer request is settled."""

    def close(self, complete: bool) -> None:
        """The exchange is over; ``complete`` is False if the client or Envoy cut it.

        A client that leaves once the stream's last event is out (chat's ``[DONE]``, Messages'
        ``message_stop``, Responses' ``response.completed``), before the producer's body has
        ended, got everything: that exchange is complete, and its producer request is done.
        """
        stream = self.stream
        complete = complete or (stream is not None and stream.whole and self.error is None)
        if self._watch is not None:
            self._watch.stop()
        self.closing()
        if stream is not None and not stream.finished:
            if not complete:
                self._abort("client gone")
            stream.close()
        elif stream is None and self.sent and not self._answered and not complete:
            # Sent to the producer, never answered: the client left, or Envoy gave up waiting
            # (its idle timeout before the producer's headers). The coupled server aborts too.
            self._abort("no answer")
        sent = self.sent
        head = self.log_head()
        trace = self.trace
        ids = trace.ids if trace is not None else None
        if ids is not None:
            head["trace_id"], head["span_id"] = ids
        fields = record(
            self.log,
            self.endpoint,
            self.operation,
            head,
            self.log_tail(),
            started=self._started,
            first_token=self._first_token,
            error=self.error,
            complete=complete,
            client_status=self.client_status,
            stream=self.streamed if sent else self._asked_stream,
            prompt_tokens=self.prompt_tokens if sent else None,
            completion_tokens=self.completion_tokens,
        )
        if trace is not None:
            trace.end(self, fields, self._started, self._first_token)


def asked(body: bytes) -> tuple[str | None, bool]:
    """The ``model`` a request body names and whether it asks to stream, as far as it is a JSON
    object saying so (for the log line of a request that was refused)."""
    try:
        parsed = json.loads(body)
        model, stream = parsed.get("model"), parsed.get("stream")
    except (ValueError, AttributeError, RecursionError):
        return None, False
    return (model[:200] if isinstance(model, str) else None), stream is True


def ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 1) if seconds is not None else None


def record(
    logger: logging.Logger,
    endpoint: str,
    operation: str,
    head: dict[str, Any],
    tail: dict[str, Any],
    *,
    started: float,
    first_token: float | None,
    error: str | None,
    complete: bool,
    client_status: int,
    stream: bool,
    prompt_tokens: int | None,
    completion_tokens: int | None,
) -> dict[str, Any]:
    """Count one finished exchange and write its one log line (``head``, the outcome, ``tail``);
    the line's fields.

    ``head`` names the request (``request_id``, ``x_request_id``, ``model``, ...); ``prompt_tokens``
    None means it never reached a producer: logged, not counted.
    """
    elapsed = time.monotonic() - started
    ttft = first_token - started if first_token is not None else None
    error = error or (None if complete else "cancelled")
    if error is None and client_status >= 400:
        error = str(client_status)
    if prompt_tokens is not None:
        metrics.chat_done(
            operation,
            head.get("model") or "",
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            duration=elapsed,
            time_to_first_token=ttft,
            error_type=error or "",
        )
    fields = {
        **head,
        "status": client_status,
        "stream": stream,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "complete": complete,
        "error": error,
        "duration_ms": ms(elapsed),
        "ttft_ms": ms(ttft),
        **tail,
    }
    logger.info(endpoint, extra={"fields": fields})
    return fields


def producer_request_id(x_request_id: str | None, request_id: str) -> str:
    """The id the producer gives its engine request (``generate-tokens-...``)."""
    return f"generate-tokens-{x_request_id or request_id}"


def producer_error(status: int, body: bytes) -> bytes:
    """A producer (or upstream) error body -> an OpenAI error with the same status."""
    return producer_failure(status, body).body()


def producer_failure(status: int, body: bytes) -> HTTPError:
    """A producer (or upstream) error body -> the error the client gets, with the same status."""
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and "message" in error:
            return HTTPError(status, str(error["message"]), error.get("type"), error.get("param"))
    except (ValueError, AttributeError):
        pass
    text = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status}"
    return HTTPError(status, f"producer error: {text}")
