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
from copy import copy
from typing import Any

from ..ops import logs, metrics
from ..translate.collect import Collected
from ..translate.stream import ChatStream, cached_tokens, chat_completion, choice_outputs, final_output
from ..translate.errors import INCOMPLETE, HTTPError, from_exception
from ..translate.model import Model
from ..routing.producer import GENERATE_PATH, Producer
from ..translate.render import Rendered, render_chat
from ..extproc.actions import ResponseStart, Rewrite
from ..translate.sse import SSEDecoder, SSEError
from ..translate.stall import StallWatch, message as stall_message

log = logging.getLogger("derender.chat")


# Envoy's own answers when it stops waiting for a producer that has not answered (its route
# timeout, its stream idle timeout): the producer may still be generating, so it is told to stop.
ENVOY_GAVE_UP = frozenset({408, 504})


class ChatExchange:
    # What differs per endpoint (``completions.CompletionExchange`` swaps them).
    render = staticmethod(render_chat)
    stream_class = ChatStream
    full_response = staticmethod(chat_completion)  # the final output -> the one JSON answer
    endpoint = "chat"
    routed: Any = None  # the producer routing's Decision (routing.balance), for the log line
    producer_cached_tokens: int | None = None  # non-streaming: what the producer's usage says

    def __init__(self, model: Model, producer: Producer, x_request_id: str | None) -> None:
        self.model = model
        self.producer = producer
        self.x_request_id = x_request_id
        self.rendered: Rendered | None = None
        self.stream: ChatStream | Collected | None = None
        self._ready: ChatStream | None = None  # built while the producer is reached (``prepare``)
        self.status = 0
        self._sse = SSEDecoder()
        self._started = time.monotonic()
        self._first_token: float | None = None
        self._aborted = False
        self._answered = False  # a buffered (non-streaming) answer reached the filter whole
        self._upstream: str | None = None  # the producer replica Envoy reached (UPSTREAM_HEADER)
        self.client_status = 0  # what the client got (self.status is the producer's)
        self.error: str | None = None  # the first failure, as metrics and the request log name it
        self._completion_tokens: int | None = None  # non-streaming: tokens in the producer's body
        self._sent: list[bytes] | None = [] if logs.LOG_PROMPTS else None  # client bytes, for --log-prompts
        self._watch: StallWatch | None = None  # streaming
        self._body_at: float | None = None  # seconds from the request's headers to its body
        self._render_time: float | None = None
        self._headers_at: float | None = None  # seconds from the request's headers to the producer's
        self._asked_model: str | None = None  # a refused request's "model", for its log line
        self._asked_stream = False  # and whether it asked to stream

    @staticmethod
    def completion_texts(sent: bytes, stream: bool) -> list[str]:
        """The text of each choice in what the client got (``--log-prompts``)."""
        return logs.completion_texts_from_sse(sent) if stream else logs.completion_texts_from_json(sent)

    @staticmethod
    def answer_error(exc: HTTPError) -> bytes:
        """An error answer in the shape this endpoint's clients read (OpenAI's)."""
        return exc.body()

    # -- request ---------------------------------------------------------------
    async def request_body(self, body: bytes) -> Rewrite:
        started = time.monotonic()
        self._body_at = started - self._started
        try:
            self.rendered = await self.render(self.model, body, self.x_request_id)
            verify_params(self.model, self.rendered)
            self._render_time = time.monotonic() - started
        except HTTPError as exc:
            self.client_status = exc.status
            self._asked_model, self._asked_stream = asked(body)
            raise
        except Exception as exc:  # vLLM raises some validation errors (e.g. tool_choice) past pydantic
            error = from_exception(exc)
            self.client_status = error.status
            self._asked_model, self._asked_stream = asked(body)
            raise error from None
        return Rewrite(
            body=self.rendered.body,
            path=GENERATE_PATH,
            set_headers={"content-type": "application/json"},
            then=self.prepare if self.rendered.stream else None,
            prompt_ids=self.rendered.prompt_token_ids,
            cache_salt=getattr(self.rendered.request, "cache_salt", None),
        )

    def prepare(self) -> None:
        """Build the stream's state (detokenizers, vLLM's parsers) before the producer answers.

        A few milliseconds that would otherwise come between the producer's
        first token and the client's.
        """
        if self.rendered is None or self._ready is not None or self.stream is not None:
            return
        try:
            ready = self.stream_class(self.model, self.rendered)
            ready.start()
        except Exception:  # built again at the response headers, failing where it always did
            log.debug("stream state not built ahead", exc_info=True)
            return
        self._ready = ready

    # -- response --------------------------------------------------------------
    def response_headers(self, status: int, upstream: str | None = None) -> ResponseStart:
        """The producer's status; ``upstream``: the replica Envoy reached, where aborts go."""
        self._upstream = upstream
        assert self.rendered is not None
        self._headers_at = time.monotonic() - self._started
        self.status = self.client_status = status
        if status != 200:
            self._failed(metrics.producer_error, "status")
        if status in ENVOY_GAVE_UP:
            self._abort("no answer")
        ready, self._ready = self._ready, None
        if status == 200 and self.rendered.stream:
            self.stream = ready or self.stream_class(self.model, self.rendered)
            self._watch = StallWatch(self.rendered.request_id, self._stalled)
            self._watch.start()
            return ResponseStart(
                {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"},
                ["content-length"],
                buffer=False,
            )
        if ready is not None:  # the producer refused: its error goes out buffered
            ready.close()
        if status == 200 and self.rendered.collect:  # streamed from the producer, one JSON to the client
            self.stream = Collected(self.model, self.rendered)
            return ResponseStart({"content-type": "application/json"}, ["content-length"], buffer=False)
        return ResponseStart({"content-type": "application/json"}, ["content-length"], buffer=True)

    def response_chunk(self, chunk: bytes, end: bool) -> Any:
        """Streaming: one body chunk of SSE from the producer -> client bytes (awaitable if collected)."""
        stream = self.stream
        assert stream is not None
        if isinstance(stream, Collected):
            return self._collect(stream, chunk, end)
        if self._watch is not None and self._watch.chunk():  # whatever comes after the stall's abort
            return stream.fail(504, stall_message())
        try:
            return self._translate(stream, chunk, end)
        except Exception:  # a bug must end this stream cleanly, never the gRPC stream
            log.exception("stream %s failed", self.rendered.request_id if self.rendered else None)
            self._failed(metrics.parser_error, "stream")
            self._abort("filter error")
            return stream.fail(500, "internal error in the filter while translating the stream")

    def _translate(self, stream: ChatStream, chunk: bytes, end: bool) -> bytes:
        out: list[bytes] = []
        payloads: list[bytes] = []
        bad: SSEError | None = None
        try:
            payloads += self._sse.feed(chunk)
            if end:
                payloads += self._sse.close()
        except SSEError as exc:  # the events before the fault still count
            payloads += exc.payloads
            bad = exc
        for payload in payloads:
            data, abort = stream.feed(payload)
            out.append(data)
            if stream.finished and not stream.outputs.done:
                self._stream_failed(payload)
                self._abort("stream failed")
            if abort:
                self._abort("stop string")
        if bad is not None and not stream.finished:
            self._failed(metrics.parser_error, "stream")
            out.append(stream.fail(502, f"invalid producer stream: {bad}"))
            self._abort("invalid producer stream")
        if end:
            if not stream.finished and not stream.outputs.done:
                self._failed(metrics.producer_error, "incomplete")
            out.append(stream.end())
        if self._first_token is None and stream.completion_tokens:
            self._first_token = time.monotonic()
        data = b"".join(out)
        if self._sent is not None:
            self._sent.append(data)
        return data

    async def _collect(self, collected: Collected, chunk: bytes, end: bool) -> bytes:
        """Non-streaming with stop strings: nothing until the generation is over, then the one JSON answer."""
        assert self.rendered is not None
        if collected.finished:
            return b""
        try:
            if collected.feed(chunk, end):
                self._abort("stop string")
            if collected.final is not None:
                out = await self.full_response(self.model, self.rendered, collected.final)
                collected.whole = True
            elif not end:
                return b""
            else:
                self._failed(metrics.producer_error, "incomplete")
                out = self.answer_error(HTTPError(502, INCOMPLETE))
        except HTTPError as exc:
            out = self.answer_error(self._answer_failed(exc))
            if not end:
                self._abort("stream failed")
        except Exception as exc:
            out = self.answer_error(self._answer_failed(exc))
            self._abort("filter error")
        collected.finished = True
        if self._sent is not None:
            self._sent.append(out)
        return out

    def _answer_failed(self, exc: Exception) -> HTTPError:
        """A non-streaming answer could not be made: count why; the error the client gets.

        Call it while handling ``exc``. 502: the producer's output was not usable;
        another ``HTTPError``: the producer reported it; anything else is a bug,
        which must end the exchange with an error, never the gRPC stream.
        """
        if isinstance(exc, HTTPError):
            if exc.status == 502:
                self._failed(metrics.parser_error, "response")
            else:
                self._failed(metrics.producer_error, "error")
            return exc
        log.exception("response %s failed", self.rendered.request_id if self.rendered else None)
        self._failed(metrics.parser_error, "response")
        return HTTPError(500, "internal error in the filter while translating the response")

    def _stalled(self) -> None:
        """The producer went quiet: abort its request; its last words end the client's stream."""
        if self.stream is None or self.stream.finished:
            return
        self._failed(metrics.producer_error, "stall")
        self._abort("stalled")

    def _stream_failed(self, payload: bytes) -> None:
        """The stream ended in an error at this producer event: whose fault was it?"""
        if payload == b"[DONE]":
            self._failed(metrics.producer_error, "incomplete")
            return
        try:
            event = json.loads(payload)
        except ValueError:
            event = None
        if isinstance(event, dict) and "error" in event:
            self._failed(metrics.producer_error, "error")
        else:  # the filter could not use the event (or vLLM's output parsers failed on it)
            self._failed(metrics.parser_error, "stream")

    def _failed(self, count, kind: str) -> None:
        """Count the exchange's first failure (``count`` is a ``metrics`` function)."""
        if self.error is None:
            self.error = f"{count.__name__.removesuffix('_error')}_{kind}"  # e.g. producer_status
            count(kind)

    async def response_body(self, body: bytes) -> tuple[bytes, int | None]:
        """Buffered: the producer's whole body -> (client body, new status or None)."""
        assert self.rendered is not None
        self._answered = True
        if self.status != 200:
            return self.answer_error(producer_failure(self.status, body)), None
        try:
            final = final_output(choice_outputs(self.model, self.rendered, stream=False), body)
            out = await self.full_response(self.model, self.rendered, final)
        except Exception as exc:
            error = self._answer_failed(exc)
            self.client_status = error.status
            return self.answer_error(error), error.status
        self._completion_tokens = _token_count(body)
        try:
            self.producer_cached_tokens = cached_tokens(json.loads(body))
        except ValueError:
            pass
        if self._sent is not None:
            self._sent.append(out)
        return out, None

    def close(self, complete: bool) -> None:
        """The exchange is over; ``complete`` is False if the client or Envoy cut it.

        A client that leaves once the stream's last event is out (chat's ``[DONE]``, Messages'
        ``message_stop``, Responses' ``response.completed``), before the producer's body has
        ended, got everything: that exchange is complete, and its producer request is done.
        """
        complete = complete or (self.stream is not None and self.stream.whole)
        if self._watch is not None:
            self._watch.stop()
        if self._ready is not None:  # no producer answer came
            self._ready.close()
            self._ready = None
        if self.stream is not None and not self.stream.finished:
            if not complete:
                self._abort("client gone")
            self.stream.close()
        elif self.stream is None and self.rendered is not None and not self._answered and not complete:
            # Sent to the producer, never answered: the client left, or Envoy gave up waiting
            # (its idle timeout before the producer's headers). The coupled server aborts too.
            self._abort("no answer")
        rendered = self.rendered
        tail = {
            "body_ms": _ms(self._body_at),
            "render_ms": _ms(self._render_time),
            "producer_headers_ms": _ms(self._headers_at),
            **(self.routed.fields() if self.routed is not None else {}),
        }
        if self._sent is not None and rendered is not None:
            request = rendered.request
            tail["prompt"] = getattr(request, "messages", None) or getattr(request, "prompt", None)
            sent = b"".join(self._sent)
            tail["completion"] = self.completion_texts(sent, rendered.stream)
        record(
            log,
            self.endpoint,
            {
                "request_id": rendered.request_id if rendered else None,
                "x_request_id": self.x_request_id,
                "model": (rendered.request.model or self.model.name) if rendered else self._asked_model,
            },
            tail,
            started=self._started,
            first_token=self._first_token,
            error=self.error,
            complete=complete,
            client_status=self.client_status,
            stream=bool(rendered.stream) if rendered else self._asked_stream,
            prompt_tokens=len(rendered.prompt_token_ids) if rendered else None,
            completion_tokens=self.stream.completion_tokens if self.stream is not None else self._completion_tokens,
        )

    def _abort(self, why: str) -> None:
        if self._aborted or self.rendered is None:
            return
        self._aborted = True
        request_id = (self.stream and self.stream.producer_request_id) or producer_request_id(
            self.x_request_id, self.rendered.request_id
        )
        self.producer.abort_soon(request_id, why, self._upstream)


def asked(body: bytes) -> tuple[str | None, bool]:
    """The ``model`` a request body names and whether it asks to stream, as far as it is a JSON
    object saying so (for the log line of a request that was refused)."""
    try:
        parsed = json.loads(body)
        model, stream = parsed.get("model"), parsed.get("stream")
    except (ValueError, AttributeError, RecursionError):
        return None, False
    return (model[:200] if isinstance(model, str) else None), stream is True


def _ms(seconds: float | None) -> float | None:
    return round(seconds * 1000, 1) if seconds is not None else None


def record(
    logger: logging.Logger,
    endpoint: str,
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
) -> None:
    """Count one finished exchange and write its one log line (``head``, the outcome, ``tail``).

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
            OPERATIONS.get(endpoint, endpoint),
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
        "duration_ms": _ms(elapsed),
        "ttft_ms": _ms(ttft),
        **tail,
    }
    logger.info(endpoint, extra={"fields": fields})


# gen_ai.operation.name for each endpoint (OpenTelemetry GenAI conventions).
OPERATIONS = {"chat": "chat", "completion": "text_completion", "messages": "messages"}


def _token_count(body: bytes) -> int | None:
    """Tokens in a non-streaming producer response (all choices)."""
    try:
        return sum(len(c.get("token_ids") or ()) for c in json.loads(body).get("choices") or ())
    except (ValueError, AttributeError, TypeError):
        return None


def verify_params(model: Model, rendered: object) -> None:
    """The engine's checks on sampling params (logprobs, logit_bias, stop and allowed token ids).

    A coupled vLLM makes them in its input processor before generating, so a bad request gets a
    400 rather than a 200 stream that ends in an error. Structured outputs and speculative decoding
    stay with the producer: it knows its backends.
    """
    params = getattr(rendered, "params", None)
    if params is not None:
        copy(params).verify(model.model_config, None, None, model.tokenizer)


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
