"""``POST /v1/chat/completions``: one request/response exchange through the filter.

Request: the OpenAI body is rendered into the producer's ``GenerateRequest``
and the path becomes ``/inference/v1/generate``. Response: token events become
``chat.completion.chunk`` frames (streaming) or one ``chat.completion`` object;
producer errors become OpenAI errors with the producer's status.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..exchange import Aborts, Endpoint, ResponseStart, Rewrite
from ..ops import logs
from ..routing.producer import GENERATE_PATH
from ..translate import lean
from ..translate.collect import Collected
from ..translate.errors import INCOMPLETE, HTTPError, from_exception
from ..translate.events import answer_tokens, cached_tokens, has_tokens
from ..translate.model import Model
from ..translate.render import Rendered, render_chat
from ..translate.sse import SSEDecoder, SSEError
from ..translate.stream import ChatStream, chat_completion, choice_outputs, final_output
from . import rendertier
from .asked import asked_of, check_size, verify_params
from .lifecycle import ProducerExchange, producer_failure

log = logging.getLogger("derender.chat")


class ChatExchange(ProducerExchange):
    # What differs per endpoint (``completions.CompletionExchange`` swaps them).
    render = staticmethod(render_chat)
    stream_class: Callable[..., Any] = ChatStream  # (model, rendered, ...) -> the stream's state
    lean_class: type[lean.LeanChatStream] | None = lean.LeanChatStream  # None: vLLM's path for every event
    full_response: Callable[..., Awaitable[bytes]] = staticmethod(chat_completion)  # final output -> the JSON answer
    endpoint = "chat"
    operation = "chat"
    # A choice's finish reason as this API writes it to the client (a sampled trace records those;
    # None: the engine's). A JSON string in the answer escapes its quotes: only the field matches.
    client_finish: re.Pattern[bytes] | None = re.compile(rb'"finish_reason":"([a-z_]+)"')

    def __init__(self, model: Model, producer: Aborts, x_request_id: str | None) -> None:
        super().__init__(producer, x_request_id, log)
        self.model = model
        self.rendered: Rendered | None = None
        self.stream: ChatStream | Collected | None = None
        self._ready: ChatStream | None = None  # built while the producer is reached (``prepare``)
        self._sse = SSEDecoder()
        self._sent: list[bytes] | None = [] if logs.LOG_PROMPTS else None  # client bytes, for --log-prompts
        # A key's budget (``stages.budget``): the completion tokens the stream may reach before the
        # events after them are held for the budget to decide (None: no limit), and those events.
        self._token_limit: int | None = None
        self._held: tuple[list[bytes], SSEError | None, bool] | None = None

    # -- what the lifecycle needs to know (``ProducerExchange``) ---------------
    @property
    def sent(self) -> bool:
        return self.rendered is not None

    @property
    def request_id(self) -> str:
        return self.rendered.request_id if self.rendered is not None else ""

    @property
    def streamed(self) -> bool:
        return bool(self.rendered.stream) if self.rendered is not None else False

    @property
    def prompt_tokens(self) -> int:
        return len(self.rendered.prompt_token_ids) if self.rendered is not None else 0

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
        report = self.report
        report.body_at = started - report.started
        try:
            self.rendered = await self.render(self.model, body, self.x_request_id)
            verify_params(self.model, self.rendered)
            check_size(self.model, self.rendered.body)
            report.render_time = time.monotonic() - started
        except HTTPError as exc:
            self.refused(body, exc.status)
            raise
        except Exception as exc:  # vLLM raises some validation errors (e.g. tool_choice) past pydantic
            error = from_exception(exc)
            self.refused(body, error.status)
            raise error from None
        report.asked = asked_of(self.rendered)
        report.model = self.rendered.request.model or self.model.name
        return Rewrite(
            body=self.rendered.body,
            path=GENERATE_PATH,
            set_headers={"content-type": "application/json"},
            then=self.prepare if self.rendered.stream else None,
            prompt_ids=self.rendered.prompt_token_ids,
            cache_salt=getattr(self.rendered.request, "cache_salt", None),
            lora=self.model.lora(self.rendered.request.model),
            media=self.rendered.media,
        )

    def prepare(self) -> None:
        """Build the stream's state (detokenizers, vLLM's parsers) before the producer answers.

        A few milliseconds that would otherwise come between the producer's
        first token and the client's.
        """
        if self.rendered is None or self._ready is not None or self.stream is not None:
            return
        try:
            ready = self.new_stream()
            ready.start()
        except Exception:  # built again at the response headers, failing where it always did
            log.debug("stream state not built ahead", exc_info=True)
            return
        self._ready = ready

    def new_stream(self) -> ChatStream:
        """This request's stream state: chat's lean path where it serves the request (``lean``)."""
        assert self.rendered is not None
        lean_class = self.lean_class
        if lean_class is not None and lean.eligible(
            self.model, self.rendered, continuous_usage=lean_class.continuous_usage
        ):
            return lean_class(self.model, self.rendered)
        return self.stream_class(self.model, self.rendered)

    # -- response --------------------------------------------------------------
    def response_headers(self, status: int, upstream: str | None = None) -> ResponseStart:
        """The producer's status; ``upstream``: the replica Envoy reached, where aborts go."""
        assert self.rendered is not None
        self.report.headers_at = time.monotonic() - self.report.started
        self.response_started(status, upstream)
        ready, self._ready = self._ready, None
        if status == 200 and self.rendered.stream:
            self.stream = ready or self.new_stream()
            self.watch_stalls()
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

    async def response_chunk(self, chunk: bytes, end: bool) -> bytes:
        """Streaming: one body chunk of SSE from the producer -> client bytes."""
        stream = self.stream
        assert stream is not None
        if isinstance(stream, Collected):
            return await self._collect(stream, chunk, end)
        if self._watch is not None and self._watch.chunk():  # whatever comes after the stall's abort
            return stream.fail(504, self._watch.message())
        try:
            return self._translate(stream, chunk, end)
        except Exception:  # a bug must end this stream cleanly, never the gRPC stream
            log.exception("stream %s failed", self.rendered.request_id if self.rendered else None)
            self._failed("parser_stream")
            self._abort("filter error")
            return stream.fail(500, "internal error in the filter while translating the stream")

    def _translate(self, stream: ChatStream, chunk: bytes, end: bool) -> bytes:
        payloads: list[bytes] = []
        bad: SSEError | None = None
        try:
            payloads += self._sse.feed(chunk)
            if end:
                payloads += self._sse.close()
        except SSEError as exc:  # the events before the fault still count
            payloads += exc.payloads
            bad = exc
        return self._events(stream, payloads, bad, end)

    def _events(self, stream: ChatStream, payloads: list[bytes], bad: SSEError | None, end: bool) -> bytes:
        """The producer's events ``payloads`` through the stream -> client bytes; at the token limit
        the rest are ``held`` (the key's budget decides: ``resume`` or ``cut``)."""
        out: list[bytes] = []
        limit = self._token_limit
        for k, payload in enumerate(payloads):
            if limit is not None and stream.completion_tokens >= limit and has_tokens(payload) and not stream.finished:
                self._held = (payloads[k:], bad, end)
                return self._out(stream, out)
            data, abort = stream.feed(payload)
            out.append(data)
            if stream.finished and not stream.outputs.done:
                self._stream_failed(payload)
                self._abort("stream failed")
            if abort:
                self._abort("stop string")
        if bad is not None and not stream.finished:
            self._failed("parser_stream")
            out.append(stream.fail(502, f"invalid producer stream: {bad}"))
            self._abort("invalid producer stream")
        if end:
            if not stream.finished and not stream.outputs.done:
                self._failed("producer_incomplete")
            out.append(stream.end())
        return self._out(stream, out)

    def _out(self, stream: ChatStream, out: list[bytes]) -> bytes:
        report = self.report
        if report.first_token is None and stream.completion_tokens:
            report.first_token = time.monotonic()
        data = b"".join(out)
        if report.keep_finish_reasons and self.client_finish is not None and any(stream.outputs.reasons):
            self._note_finish(data)  # a choice has finished: its reason is in these bytes or later ones
        if self._sent is not None:
            self._sent.append(data)
        return data

    def _note_finish(self, data: bytes) -> None:
        """Keep the finish reasons the client reads in ``data`` (``client_finish``), for the trace."""
        assert self.client_finish is not None
        self.report.finish_reasons += [m.decode() for m in self.client_finish.findall(data)]

    async def _collect(self, collected: Collected, chunk: bytes, end: bool) -> bytes:
        """Non-streaming with stop strings (or a key's budget): nothing until the generation is over,
        then the one JSON answer."""
        return await self._collected(collected, lambda: collected.payloads(chunk, end), end)

    async def _collected(self, collected: Collected, payloads: Callable[[], list[bytes]], end: bool) -> bytes:
        """``_collect``'s events (``payloads()``); at the token limit the rest are ``held`` (the key's
        budget decides: ``resume`` or ``cut``)."""
        assert self.rendered is not None
        if collected.finished:
            return b""
        try:
            abort, rest = collected.events(payloads(), self._token_limit)
            if abort:
                self._abort("stop string")
            if rest is not None:
                self._held = (rest, None, end)
                return b""
            if collected.final is not None:
                out = await self.full_response(self.model, self.rendered, collected.final)
                collected.whole = True
                if self.report.keep_finish_reasons and self.client_finish is not None:
                    self._note_finish(out)
            elif not end:
                return b""
            else:
                self._failed("producer_incomplete")
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
                self._failed("parser_response")
            else:
                self._failed("producer_error")
            return exc
        log.exception("response %s failed", self.rendered.request_id if self.rendered else None)
        self._failed("parser_response")
        return HTTPError(500, "internal error in the filter while translating the response")

    def _stream_failed(self, payload: bytes) -> None:
        """The stream ended in an error at this producer event: whose fault was it?"""
        if payload == b"[DONE]":
            self._failed("producer_incomplete")
            return
        try:
            event = json.loads(payload)
        except ValueError:
            event = None
        if isinstance(event, dict) and "error" in event:
            self._failed("producer_error")
        else:  # the filter could not use the event (or vLLM's output parsers failed on it)
            self._failed("parser_stream")

    async def response_body(self, body: bytes) -> tuple[bytes, int | None]:
        """Buffered: the producer's whole body -> (client body, new status or None)."""
        assert self.rendered is not None
        self._answered = True
        report = self.report
        if report.status != 200:
            return self.answer_error(producer_failure(report.status, body)), None
        try:
            final = final_output(choice_outputs(self.model, self.rendered, stream=False), body)
            out = await self.full_response(self.model, self.rendered, final)
        except Exception as exc:
            error = self._answer_failed(exc)
            report.client_status = error.status
            return self.answer_error(error), error.status
        self._completion_tokens, self.finish_reasons = answer_tokens(body)
        if report.keep_finish_reasons and self.client_finish is not None:
            self._note_finish(out)
        try:
            report.cached_tokens = cached_tokens(json.loads(body))
        except ValueError:
            pass
        if self._sent is not None:
            self._sent.append(out)
        return out, None

    def closing(self) -> None:
        if self._ready is not None:  # no producer answer came
            self._ready.close()
            self._ready = None
        if isinstance(self.stream, ChatStream) and self.stream.producer_cached_tokens is not None:
            self.report.cached_tokens = self.stream.producer_cached_tokens  # as the stream's usage said

    def engine_reasons(self) -> list[str]:
        stream = self.stream
        if stream is not None and any(stream.outputs.reasons):
            return [r for r in stream.outputs.reasons if r]
        return list(self.finish_reasons)

    def log_fields(self) -> dict[str, object]:
        rendered = self.rendered
        if self._sent is None or rendered is None:
            return {}
        request = rendered.request
        return {
            "prompt": getattr(request, "messages", None) or getattr(request, "prompt", None),
            "completion": self.completion_texts(b"".join(self._sent), rendered.stream),
        }

    # -- a key's budget (``stages.budget``) ------------------------------------
    def limit(self, tokens: int, rewrite: Rewrite, outrun: bool) -> bool:
        rendered = self.rendered
        assert rendered is not None
        self._token_limit = tokens  # past it, the stream waits for the budget
        if outrun and not rendered.collect and not rendered.stream:
            # One JSON answer that may outrun what is reserved: the producer streams it to the
            # filter, which can end it at the budget.
            rewrite.body = rendered.as_stream(self.model)
        return True

    @property
    def held(self) -> bool:
        return self._held is not None

    async def resume(self, tokens: int) -> bytes:
        """The events held at the token limit, now that it is ``tokens``."""
        self._token_limit = tokens
        stream, held = self.stream, self._held
        self._held = None
        if held is None:
            return b""
        if isinstance(stream, Collected):
            return await self._collected(stream, lambda: held[0], held[2])
        if not isinstance(stream, ChatStream):
            return b""
        return self._events(stream, *held)

    async def cut(self) -> bytes:
        """End the answer at the tokens generated so far (``ChatStream.cut``; a non-streaming answer:
        the one JSON answer of those tokens); the producer's request is aborted."""
        stream = self.stream
        if isinstance(stream, Collected) and not stream.finished:
            held, self._held = self._held, None
            stream.cut()
            self._abort("quota")
            return await self._collected(stream, list, True if held is None else held[2])
        if not isinstance(stream, ChatStream) or stream.finished:
            return b""
        self._held = None  # what the producer sent past the budget is dropped
        out = [stream.cut()]
        self._abort("quota")
        return self._out(stream, out)


ENDPOINT = Endpoint("/v1/chat/completions", ChatExchange, tier=rendertier.chat_exchange)
