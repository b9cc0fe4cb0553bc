"""What every exchange that sends a request to a producer lives through, in one place.

``ProducerExchange`` is the base of the local exchanges (``chat.ChatExchange`` and the
endpoints built on it) and of render-tier mode's (``rendertier.TierExchange``): the
producer's status, Envoy giving up, the stall watch, aborting the producer request, a
failure counted once under its metric, and ``close`` -> its ``Report`` made final, which the
stages (``stages``: metrics, the request log, traces) read. Subclasses say what was sent
(``sent``, ``request_id``, ``streamed``, ``prompt_tokens``) and add their own fields to the log
line (``log_fields``).
"""

from __future__ import annotations

import json
import logging
from typing import Protocol

from ..exchange import Aborts, Report, Unmetered
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


class ProducerExchange(Unmetered):
    """The lifecycle of one exchange whose request goes on to a producer."""

    endpoint = ""  # the log line's message
    operation = ""  # gen_ai.operation.name (OpenTelemetry GenAI conventions), the metrics' label
    finish_reasons: tuple[str, ...] = ()  # a buffered answer's, per choice (the engine's)

    def __init__(self, producer: Aborts, x_request_id: str | None, log: logging.Logger) -> None:
        self.producer = producer  # a routing Producer or ClusterProducers: where aborts go
        self.x_request_id = x_request_id
        self.report = Report(name=self.endpoint, operation=self.operation, x_request_id=x_request_id, logger=log.name)
        self.stream: LiveStream | None = None  # set once a streamed answer starts
        self._answered = False  # a buffered (non-streaming) answer reached the filter whole
        self._watch: StallWatch | None = None  # streaming
        self._completion_tokens: int | None = None  # non-streaming: tokens in the producer's body

    @property
    def streaming(self) -> bool:
        return self.stream is not None

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

    def log_fields(self) -> dict[str, object]:
        """The subclass's own fields on the request's log line."""
        return {}

    def engine_reasons(self) -> list[str]:
        """Each finished choice's reason as the engine gave it."""
        return list(self.finish_reasons)

    def refused(self, body: bytes, status: int) -> None:
        """The request was refused before it went on: remember what it asked for the log line."""
        report = self.report
        report.client_status = status
        report.asked.model, report.asked.stream = asked(body)
        report.model = report.asked.model

    @property
    def generated(self) -> int:
        """Completion tokens so far (what a key's budget reads while the answer is held)."""
        return self.completion_tokens or 0

    # -- the shared lifecycle --------------------------------------------------
    def response_started(self, status: int, upstream: str | None) -> None:
        """The producer's status; ``upstream``: the replica Envoy reached, where aborts go."""
        report = self.report
        report.upstream = upstream
        report.status = report.client_status = status
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
        if self.report.error is None:
            self.report.error = error
            count, kind = FAILURES[error]
            count(kind)

    def _stalled(self) -> None:
        """The producer went quiet: abort its request; its last words end the client's stream."""
        if self.stream is None or self.stream.finished:
            return
        self._failed("producer_stall")
        self._abort("stalled")

    def _abort(self, why: str) -> None:
        if self.report.aborted or not self.sent:
            return
        self.report.aborted = True
        request_id = (self.stream and self.stream.producer_request_id) or producer_request_id(
            self.x_request_id, self.request_id
        )
        self.producer.abort_soon(request_id, why, self.report.upstream)

    def closing(self) -> None:
        """Subclass work at ``close``, before the producer request is settled."""

    def close(self, complete: bool) -> None:
        """The exchange is over; ``complete`` is False if the client or Envoy cut it. The report is
        final: the stages (``stages``) count it, log it and end its trace.

        A client that leaves once the stream's last event is out (chat's ``[DONE]``, Messages'
        ``message_stop``, Responses' ``response.completed``), before the producer's body has
        ended, got everything: that exchange is complete, and its producer request is done.
        """
        stream, report = self.stream, self.report
        complete = complete or (stream is not None and stream.whole and report.error is None)
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
        report.complete = complete
        report.completion_tokens = self.completion_tokens
        if self.sent:
            report.request_id = self.request_id or None
            report.asked.stream = self.streamed
            report.prompt_tokens = self.prompt_tokens
        if not report.finish_reasons:
            report.finish_reasons = self.engine_reasons()
        report.fields.update(self.log_fields())


def asked(body: bytes) -> tuple[str | None, bool]:
    """The ``model`` a request body names and whether it asks to stream, as far as it is a JSON
    object saying so (for the log line of a request that was refused)."""
    try:
        parsed = json.loads(body)
        model, stream = parsed.get("model"), parsed.get("stream")
    except (ValueError, AttributeError, RecursionError):
        return None, False
    return (model[:200] if isinstance(model, str) else None), stream is True


class LiveStream(Protocol):
    """What the lifecycle reads of a streamed answer's state (``translate.stream.ChatStream``,
    ``translate.collect.Collected``, render-tier mode's ``TierStream``)."""

    finished: bool

    @property
    def producer_request_id(self) -> str | None: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def whole(self) -> bool: ...

    def close(self) -> None: ...


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
