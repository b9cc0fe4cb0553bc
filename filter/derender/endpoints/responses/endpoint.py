"""``POST /v1/responses`` (OpenAI Responses) by vLLM's own ``OpenAIServingResponses``.

vLLM's Responses server is its own path, not a layer over chat: it renders the
request (instructions, input items, tools, ``previous_response_id``), keeps a
``ConversationContext`` (Harmony for gpt-oss), parses output with its
``ParserManager`` parser and writes the event sequence (``response.created`` ...
``response.completed`` / ``response.incomplete``). The filter runs that code
unchanged, with one stand-in: the engine. Each request gets a ``Session``; vLLM's
``create_responses`` runs as a task, and when it asks the engine to generate, the
stand-in hands back the session's outputs and tells the filter what vLLM would have
sent the engine (prompt ids, sampling params, reasoning settings). That becomes
the producer's ``GenerateRequest``: the request is validated and rendered exactly
once, by vLLM, as the coupled server does. The producer's token events then go
through the filter's live ``ChoiceOutputs`` (detokenizer, stop strings, logprobs),
and vLLM's task turns them into events; each response chunk waits until the task
waits for the next output, so an event goes out in the reply to the chunk that
carried its tokens.

Stored responses behave as vLLM 0.33 by default (``VLLM_ENABLE_RESPONSES_API_STORE``
off): ``store`` is ignored, ``previous_response_id``, ``GET /v1/responses/{id}`` and
``.../cancel`` answer vLLM's 404. Built-in tools that need several generations in
one request (vLLM's ``_generate_with_builtin_tools`` loop) are not served.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from ...exchange import Endpoint, Reply, Rewrite
from ...ops import logs
from ...translate import vllm_seams
from ...translate.decode import ProducerDecoder
from ...translate.errors import HTTPError, dumps, from_exception, parse_body
from ...translate.lean import one_choice_event
from ...translate.model import Model
from ...translate.render import Rendered, media_of, producer_body
from ...translate.stream import ChatStream, choice_outputs
from ..chat import ChatExchange
from . import store
from .lean import cache_type_adapters, lean_serving_class
from .session import _STAND_IN_SESSIONS, Session, _ProducerEngine, lend_loop

RESPONSES_PATH = "/v1/responses"

log = logging.getLogger("derender.responses")


@functools.cache
def serving_responses(model: Model) -> Any:
    """vLLM's ``OpenAIServingResponses`` for ``model``, built as ``vllm serve`` builds it (on the lean
    path, with the filter's copy of its simple streaming loop: ``lean.lean_serving_class``)."""
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    cls = lean_serving_class(lend_loop) if model.lean else OpenAIServingResponses
    if model.lean:
        cache_type_adapters()
    serving = model.vllm_serving(cls, _ProducerEngine(model.vllm_config, model.renderer))
    if (shared := store.of(model.settings)) is not None:
        shared.install(serving)
    return serving


@dataclass
class RenderedResponse(Rendered):
    """A Responses request as vLLM rendered it, and its running session."""

    session: Any = None


async def render_responses(model: Model, raw: bytes, x_request_id: str | None) -> RenderedResponse:
    """Validate and render a ``/v1/responses`` body by vLLM's ``create_responses``; raises ``HTTPError``."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
    from vllm.renderers.inputs.preprocess import extract_prompt_components

    request = parse_body(lambda body: ResponsesRequest.model_validate(body, from_attributes=True), raw)
    refuse_builtin_tools(request)
    serving = serving_responses(model)
    shared = store.of(model.settings)
    if shared is not None:
        if request.background:
            raise HTTPError(400, NO_BACKGROUND, param="background")
        if request.store or request.previous_response_id:
            try:  # before anything is generated: the answer could not be stored, or the history read
                shared.check()
            except Exception as exc:
                raise from_exception(exc) from None
    session = Session(request, model.lean)
    _STAND_IN_SESSIONS[request.request_id] = session
    session.start(serving)
    await session.until_called()
    if not session.called.is_set():  # vLLM answered without generating: an error
        session.cancel()
        raise _failure_of(session)
    kwargs = session.engine_kwargs
    features = vllm_seams.extract_mm_features(model.serving_render, session.engine_input, mm_payload="tensors")
    prompt_ids = list(extract_prompt_components(model.model_config, session.engine_input).token_ids or ())
    body = producer_body(
        GenerateRequest(
            request_id=request.request_id,
            token_ids=prompt_ids,
            features=features,
            sampling_params=session.params,
            model=request.model,
            stream=bool(request.stream),
            reasoning_parser_kwargs=kwargs.get("reasoning_parser_kwargs"),
            reasoning_ended=kwargs.get("reasoning_ended"),
            cache_salt=request.cache_salt,
            priority=request.priority,
        ),
        usage=model.prompt_tokens_details,
        stream_interval=model.stream_interval,
    )
    return RenderedResponse(
        request=request,
        request_id=request.request_id,
        prompt_token_ids=prompt_ids,
        params=session.params,
        body=body,
        chat_template_kwargs={},
        conversation=[],
        session=session,
        media=media_of(features),
    )


NO_BACKGROUND = (
    "background responses are not served here: the filter answers on the request's own connection. "
    "Send the request without background (streaming it if it is long)."
)

# Tools a coupled vLLM runs itself (``--tool-server``), generating again with their output inside
# the one request. The filter has no tool server, and one request is one producer request.
BUILTIN_TOOLS = ("mcp", "code_interpreter", "container")
NO_BUILTIN_TOOLS = (
    "tools[{index}] is a built-in tool ({kind!r}), which runs inside the request between generations: "
    "not served here (one request is one producer request). Send it as a function tool and run it in the client."
)


def refuse_builtin_tools(request: Any) -> None:
    """A 400 naming the first built-in tool of the request. Hosted tools with no such loop in vLLM
    (``web_search``, ``image_generation``, ...) are left to vLLM, which ignores them without a tool server."""
    for index, tool in enumerate(request.tools or ()):
        kind = getattr(tool, "type", None)
        if kind in BUILTIN_TOOLS:
            raise HTTPError(400, NO_BUILTIN_TOOLS.format(index=index, kind=kind), param="tools")


def _failure_of(session: Session) -> HTTPError:
    """The error a session ended with, as the client gets it."""
    if session.error is not None:
        if isinstance(session.error, HTTPError):
            return session.error
        return from_exception(session.error)  # type: ignore[arg-type]
    result = session.result
    if hasattr(result, "error"):
        return HTTPError.from_vllm(result)
    return HTTPError(500, "internal error in the filter: vLLM's Responses server gave no answer")


class ResponsesStream(ChatStream):
    """A streaming Responses answer: ``ChatStream``'s producer side, its outputs handed to the
    session; the events vLLM's task writes come out of ``flush``."""

    def __init__(self, model: Model, rendered: RenderedResponse) -> None:
        self.session = rendered.session
        self.decoder = ProducerDecoder(choice_outputs(model, rendered, stream=True))
        self.outputs = self.decoder.outputs
        self.finished = False
        self._ended = False

    def start(self) -> None:
        pass

    def feed(self, payload: bytes) -> tuple[bytes, bool]:
        if self.outputs.direct_state is not None and not self.finished and self.session.takes_direct():
            event = one_choice_event(payload)
            res = self.outputs.direct_output(event["choices"][0]) if event is not None else None
            if res is not None:
                # A middle event straight into the session's lean loop body, with one output
                # object for the stream (``ChoiceOutputs.direct_output``); anything else (a finish,
                # an error, usage, a bad token id) takes the full path below, nothing changed.
                self.decoder.took(event, len(res.outputs[0].token_ids))  # type: ignore[arg-type]
                self.session.direct(res)
                return b"", False
        return super().feed(payload)

    def _accept(self, outputs: list[Any]) -> None:
        self.session.push(outputs)

    def _pump(self) -> bytes:
        """Nothing to run here: the session's task runs vLLM's generator (``flush``)."""
        if self._ended and not self.finished:
            self.session.end()
            self.finished = True
        return b""

    def _take_early(self) -> bytes:
        return b""

    @property
    def whole(self) -> bool:  # type: ignore[override]
        """vLLM's task wrote its last event (``response.completed``, ...) and it went out."""
        session = self.session
        return self.finished and session.done and session.error is None and not session.frames

    def fail(self, status: int, message: str, err_type: str | None = None) -> bytes:
        """The engine's failure, as vLLM's generator meets it: its error event ends the stream."""
        if self.finished and self.session.done:
            return b""
        from vllm.exceptions import GenerationError

        failure = GenerationError(message)
        failure.status_code = HTTPStatus(status)
        self.session.fail(failure)
        self.finished = True
        return b""

    async def flush(self) -> bytes:
        """The events vLLM wrote for the outputs so far."""
        session = self.session
        if session.task is not None and session.task.done() and session.takes_direct():
            # vLLM's generator waits for the next output and nothing is queued for it (the outputs
            # went through the lean loop body, ``feed``): ``settle`` would run nothing.
            return session.take_frames()
        await session.settle()
        return session.take_frames()

    def close(self) -> None:
        self.finished = True
        self.session.cancel()


async def response_object(model: Model, rendered: RenderedResponse, final: Any) -> bytes:
    """Non-streaming: the final ``RequestOutput`` into the session; vLLM's response JSON."""
    session = rendered.session
    session.push([final])
    session.end()
    assert session.task is not None
    await asyncio.shield(session.task)
    result = session.result
    if session.error is not None or result is None or hasattr(result, "error"):
        raise _failure_of(session)
    return dumps(result.model_dump(mode="json", by_alias=True))


class ResponsesExchange(ChatExchange):
    """One ``/v1/responses`` exchange: ``ChatExchange`` around a vLLM Responses session."""

    rendered: RenderedResponse | None
    render = staticmethod(render_responses)
    stream_class = ResponsesStream
    lean_class = None
    full_response = staticmethod(response_object)
    endpoint = "responses"
    operation = "responses"
    client_finish = None  # no finish reason in the Responses API (a status): the trace has the engine's

    async def request_body(self, body: bytes) -> Rewrite:
        rewrite = await super().request_body(body)
        rewrite.then = None  # the stream's state is the session, already running
        return rewrite

    async def response_chunk(self, chunk: bytes, end: bool) -> bytes:
        return await super().response_chunk(chunk, end) + await self._flush()

    async def resume(self, tokens: int) -> bytes:
        return await super().resume(tokens) + await self._flush()

    async def cut(self) -> bytes:
        return await super().cut() + await self._flush()

    async def _flush(self) -> bytes:
        """What vLLM's task wrote for the outputs the stream took (``ResponsesStream.flush``)."""
        return await self.stream.flush() if isinstance(self.stream, ResponsesStream) else b""

    def response_headers(self, status: int, upstream: str | None = None):
        start = super().response_headers(status, upstream)
        if status != 200 and self.rendered is not None:
            self.rendered.session.cancel()  # the producer refused: nothing will feed it
        return start

    def close(self, complete: bool) -> None:
        super().close(complete)
        if self.rendered is not None and not (self.rendered.stream and complete):
            session = self.rendered.session
            if not session.done:
                session.cancel()

    @staticmethod
    def completion_texts(sent: bytes, stream: bool) -> list[str]:
        if not stream:
            try:
                output = json.loads(sent).get("output") or ()
            except (ValueError, AttributeError):
                return []
            parts = []
            for item in output:
                for content in item.get("content") or ():
                    parts.append(content.get("text") or "")
                parts.append(item.get("arguments") or "")
            return ["".join(parts)]
        parts = [
            event.get("delta") or "" for event in logs.sse_json(sent) if str(event.get("type", "")).endswith(".delta")
        ]
        return ["".join(parts)]


class StoredResponseExchange:
    """``GET /v1/responses/{id}`` and ``POST .../cancel``: vLLM's answers from its store (off: 404)."""

    stream = None

    def __init__(self, model: Model, response_id: str, cancel: bool) -> None:
        self.model = model
        self.response_id = response_id
        self.cancel = cancel

    async def answer(self) -> Reply:
        serving = serving_responses(self.model)
        try:
            if self.cancel:
                result = await serving.cancel_responses(self.response_id)
            else:
                result = await serving.retrieve_responses(self.response_id, starting_after=None, stream=False)
        except Exception as exc:  # the store unreachable: 503
            return Reply.error(from_exception(exc))
        if hasattr(result, "error"):
            error = HTTPError.from_vllm(result)
            return Reply(error.status, error.body())
        return Reply(200, dumps(result.model_dump(mode="json", by_alias=True)))


async def stored_response(model: Model | None, method: str, rest: str) -> Reply:
    """``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``: vLLM's answers (405 otherwise);
    ``model``: the default backend's (None in render-tier mode)."""
    cancel = rest.endswith("/cancel")
    response_id = rest.removesuffix("/cancel")
    if "/" in response_id or not response_id:
        raise HTTPError(404, f"Route {method} {RESPONSES_PATH}/{rest} is not served here", "NotFoundError")
    if method != ("POST" if cancel else "GET"):
        raise HTTPError(405, "Method Not Allowed", "Method Not Allowed")
    if model is None:
        raise HTTPError(501, NOT_IN_TIER, "NotImplementedError")
    return await StoredResponseExchange(model, response_id, cancel).answer()


NOT_IN_TIER = (
    "/v1/responses is not served in render-tier mode: vLLM's render tier renders Responses requests but "
    "its derender tier turns token ids into chat and completion streams only. Serve the model with "
    "--model (the filter renders and derenders Responses itself), or use /v1/chat/completions."
)
ENDPOINT = Endpoint(RESPONSES_PATH, ResponsesExchange, not_in_tier=NOT_IN_TIER, under=stored_response)
