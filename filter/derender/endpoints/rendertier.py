"""Stateless render-tier mode (``--render-url``): vLLM's render server renders and derenders.

This is the client loop of RFC vllm#47161, run inside the filter. Per request:

1. the client's body goes to ``POST /v1/chat/completions/render`` (or
   ``/v1/completions/render``) of ``vllm launch render``; the ``GenerateRequest``
   it returns goes to the producer as is (stop strings aside, see below);
2. every ``data:`` event of the producer's stream goes to the streaming
   ``/derender`` endpoint with the ``stream_state`` the previous call returned for
   that choice index (``null`` first), echoed back unchanged, one state per
   index, with the client's request (``chat_request`` / ``completion_request``)
   and the full ``prompt_token_ids`` on every call. The usage-only event is sent
   too (no choice, so no state); the producer's ``[DONE]`` is not: the filter
   writes it. A non-streaming response goes to ``/derender`` once.

The chunk vLLM returns is forwarded as it is, with two exceptions: ``id`` and
``created``. vLLM sets ``id`` from the producer's engine id
(``generate-tokens-...``) and ``created`` per call; the client gets the id the
render step gave (``chatcmpl-...`` / ``cmpl-...``, as the coupled server names
it) and one ``created`` for the whole stream.

Limits, all vLLM's: streaming derender refuses stop strings (text already sent
cannot be cut), so a streaming request with ``stop`` gets vLLM's 400 here before
anything runs; non-streaming stop strings are cut by ``/derender`` (the
producer is not told them: a ``--tokens-only`` producer refuses them). The
derender endpoints do not echo, so completions ``echo`` gets a 400 (echoing a
prompt needs the model's tokenizer). Chat ``echo`` only repeats the last message's
text, which the filter has: it writes it as vLLM's coupled server does (a role
chunk and an echo chunk per choice before that choice's first derendered chunk,
or in front of each non-streaming message's content).
The filter loads no model in this mode.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from ..exchange import Aborts, Answered, Exchange, RenderTierClient, Reply, ResponseStart, Rewrite
from ..routing.producer import GENERATE_PATH
from ..translate import vllm_seams
from ..translate.errors import INCOMPLETE, ONE_PROMPT, HTTPError, dumps, error_body, error_event
from ..translate.sse import SSEDecoder
from .lifecycle import ProducerExchange, producer_error
from .tier_client import CHAT, COMPLETION, RenderTier, TierPaths, chat_echo, tier_error

log = logging.getLogger("derender.rendertier")

DONE = b"data: [DONE]\n\n"

NO_ECHO = "echo is not available in render-tier mode: vLLM's derender endpoints do not echo the prompt."


def _stream_stop_strings_error() -> str:
    return vllm_seams.stream_stop_strings_error()


def _default_max_tokens() -> int:
    from vllm.sampling_params import SamplingParams

    max_tokens = SamplingParams().max_tokens
    assert max_tokens is not None
    return max_tokens


class TierStream:
    """What one streaming exchange carries between derender calls."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.states: dict[int, Any] = {}  # choice index -> stream_state, exactly as vLLM returned it
        self.done: set[int] = set()  # choice indexes the producer finished
        self.started: set[int] = set()  # choice indexes whose first chunk went out
        self.echo = ""  # chat echo: the last message's text, sent first per choice
        self.created: int | None = None
        self.producer_request_id: str | None = None
        self.completion_tokens = 0
        self.finished = False  # [DONE] was written

    def close(self) -> None:
        pass  # nothing held between derender calls but the states

    @property
    def whole(self) -> bool:
        """``[DONE]`` went out after every choice finished (``ChatStream.whole``'s counterpart)."""
        return self.finished and len(self.done) >= self.n


class TierExchange(ProducerExchange):
    """One chat or completions exchange whose rendering and derendering the render tier does."""

    def __init__(self, tier: RenderTier, paths: TierPaths, producer: Aborts, x_request_id: str | None) -> None:
        super().__init__(producer, x_request_id, log)
        self.tier = tier
        self.paths = paths
        self.report.name, self.report.operation = paths.name, paths.operation
        self.client_request: Any = None
        self.generate: dict[str, Any] = {}
        self.stream: TierStream | None = None
        self._sse = SSEDecoder()

    # -- what the lifecycle needs to know (``ProducerExchange``) ---------------
    @property
    def sent(self) -> bool:
        return bool(self.generate)

    @property
    def streamed(self) -> bool:
        return bool(self.generate.get("stream"))

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def log_fields(self) -> dict[str, object]:
        return {"render_tier": self.tier.url}

    @property
    def request_id(self) -> str:
        return self.generate.get("request_id") or ""

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.generate.get("token_ids") or []

    # -- request ---------------------------------------------------------------
    async def request_body(self, body: bytes) -> Rewrite:
        try:
            return await self._render(body)
        except HTTPError as exc:
            self.refused(body, exc.status)
            raise

    async def _render(self, body: bytes) -> Rewrite:
        headers = {"X-Request-Id": self.x_request_id} if self.x_request_id else {}
        status, data = await self.tier.call("POST", self.paths.render_path, body, headers)
        if status != 200:
            raise tier_error(status, data)
        generate = orjson.loads(data)
        if isinstance(generate, list):  # /v1/completions/render: one per prompt
            if len(generate) != 1:
                raise HTTPError(400, ONE_PROMPT.format(n=len(generate)), param="prompt")
            generate = generate[0]
        self.client_request = orjson.loads(body)  # the render tier accepted it: a JSON object
        if self.paths is COMPLETION and self.client_request.get("echo"):
            raise HTTPError(400, NO_ECHO, param="echo")
        params = generate["sampling_params"]
        # vLLM writes SamplingParams without the fields equal to their defaults, and a producer
        # fills a missing max_tokens from max_model_len: put back the default (16) it left out.
        params.setdefault("max_tokens", _default_max_tokens())
        if params.get("stop"):
            if generate.get("stream"):
                raise HTTPError(400, _stream_stop_strings_error(), param="stop")
            # /derender cuts them; a --tokens-only producer would refuse them.
            params.update(stop=[], include_stop_str_in_output=False)
            params.pop("output_text_buffer_length", None)
        self.generate = generate
        self.report.model = self.client_request.get("model") or generate.get("model")
        return Rewrite(
            body=orjson.dumps(generate),
            path=GENERATE_PATH,
            set_headers={"content-type": "application/json"},
            prompt_ids=self.prompt_token_ids,
            cache_salt=generate.get("cache_salt"),
        )

    # -- response --------------------------------------------------------------
    def response_headers(self, status: int, upstream: str | None = None) -> ResponseStart:
        """The producer's status; ``upstream``: the replica Envoy reached, where aborts go."""
        self.response_started(status, upstream)
        if status == 200 and self.generate.get("stream"):
            self.stream = TierStream(self.generate["sampling_params"].get("n") or 1)
            if self.paths is CHAT:
                self.stream.echo = chat_echo(self.client_request)
            self.watch_stalls()
            return ResponseStart(
                {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"},
                ["content-length"],
                buffer=False,
            )
        return ResponseStart({"content-type": "application/json"}, ["content-length"], buffer=True)

    async def response_chunk(self, chunk: bytes, end: bool) -> bytes:
        """Streaming: one body chunk of the producer's SSE -> client bytes, one derender call per event."""
        assert self.stream is not None
        if self._watch is not None and self._watch.chunk():  # whatever comes after the stall's abort
            return self._fail(504, self._watch.message())
        out: list[bytes] = []
        try:
            payloads = self._sse.feed(chunk)
            if end:
                payloads += self._sse.close()
        except ValueError as exc:
            self._failed("parser_stream")
            return self._fail(502, f"invalid producer stream: {exc}")
        for payload in payloads:
            out.append(await self._event(payload))
        if end:
            out.append(self._end())
        if self.report.first_token is None and self.stream.completion_tokens:
            self.report.first_token = time.monotonic()
        return b"".join(out)

    async def _event(self, payload: bytes) -> bytes:
        stream = self.stream
        assert stream is not None
        if stream.finished:
            return b""
        if payload == b"[DONE]":
            return self._end()
        try:
            event = orjson.loads(payload)
            if not isinstance(event, dict):
                raise ValueError("not a JSON object")  # noqa: TRY004 - one handler for every bad event below
        except ValueError as exc:
            self._failed("parser_stream")
            return self._fail(502, f"invalid producer event: {exc}")
        if "error" in event:
            error = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}
            code = error.get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            self._failed("producer_error")
            return self._fail(status, str(error.get("message", "producer error")), error.get("type"))
        stream.producer_request_id = stream.producer_request_id or event.get("request_id")
        choices = event.get("choices") or []
        index = choices[0].get("index", 0) if choices else None
        status, data = await self.tier.call(
            "POST",
            self.paths.derender_path,
            orjson.dumps(
                {
                    "stream": True,
                    "model": self.client_request.get("model"),
                    "generate_chunk": event,
                    "stream_state": stream.states.get(index) if index is not None else None,
                    "prompt_tokens": len(self.prompt_token_ids),
                    "prompt_token_ids": self.prompt_token_ids,
                    self.paths.request_key: self.client_request,
                }
            ),
        )
        if status != 200:
            failure = tier_error(status, data)
            self._failed("parser_render_tier")
            self._abort("derender failed")
            return self._fail(failure.status, failure.message, failure.type)
        answer = orjson.loads(data)
        if index is not None:
            stream.states[index] = answer["stream_state"]
            stream.completion_tokens += len(choices[0].get("token_ids") or ())
            if choices[0].get("finish_reason") is not None:
                stream.done.add(index)
        chunk = answer["chunk"]
        if stream.created is None:
            stream.created = chunk.get("created")
        chunk["id"], chunk["created"] = self.request_id, stream.created
        head = b""
        if index is not None and index not in stream.started:
            stream.started.add(index)
            if stream.echo:
                head = self._echo_chunks(chunk, index)
        return head + b"data: " + orjson.dumps(chunk) + b"\n\n"

    def _echo_chunks(self, chunk: dict[str, Any], index: int) -> bytes:
        """Coupled vLLM's role chunk and echo chunk for one choice; the role leaves ``chunk``'s delta."""
        stream = self.stream
        assert stream is not None
        choice = next((c for c in chunk.get("choices") or () if c.get("index") == index), None)
        delta = choice.get("delta") if choice else None
        role = (delta.pop("role", None) if isinstance(delta, dict) else None) or "assistant"
        usage = None
        options = self.client_request.get("stream_options") or {}
        if options.get("include_usage") and options.get("continuous_usage_stats"):
            prompt = len(self.prompt_token_ids)
            usage = {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0}
        out = []
        for delta_out in ({"role": role, "content": ""}, {"content": stream.echo}):
            head = {
                "id": self.request_id,
                "object": "chat.completion.chunk",
                "created": stream.created,
                "model": chunk.get("model"),
                "choices": [{"index": index, "delta": delta_out, "logprobs": None, "finish_reason": None}],
            }
            if usage is not None:
                head["usage"] = usage
            out.append(b"data: " + orjson.dumps(head) + b"\n\n")
        return b"".join(out)

    def _end(self) -> bytes:
        """The producer's stream is over."""
        stream = self.stream
        assert stream is not None
        if stream.finished:
            return b""
        if len(stream.done) < stream.n:
            self._failed("producer_incomplete")
            return self._fail(502, INCOMPLETE)
        stream.finished = True
        return DONE

    def _fail(self, status: int, message: str, err_type: str | None = None) -> bytes:
        stream = self.stream
        assert stream is not None
        if stream.finished:
            return b""
        stream.finished = True
        return error_event(status, message, err_type) + DONE

    async def response_body(self, body: bytes) -> tuple[bytes, int | None]:
        """Buffered: the producer's whole body -> (client body, new status or None)."""
        self._answered = True
        if self.report.status != 200:
            return producer_error(self.report.status, body), None
        try:
            response = orjson.loads(body)
            self._completion_tokens = sum(len(c.get("token_ids") or ()) for c in response.get("choices") or ())
        except (ValueError, AttributeError, TypeError) as exc:
            self._failed("parser_response")
            self.report.client_status = 502
            return error_body(502, f"invalid producer response: {exc}"), 502
        ids, prompt_tokens = self.prompt_token_ids, len(self.prompt_token_ids)
        # vLLM's non-streaming chat derender gives its parser the response's own prompt_token_ids,
        # which a producer only sends with return_token_ids; without them a prompt that closed the
        # reasoning (continue_final_message, enable_thinking=False) reads as still reasoning.
        if isinstance(response, dict) and response.get("prompt_token_ids") is None:
            response["prompt_token_ids"] = ids
        if self.paths is CHAT:
            request = {"generate_response": response, "prompt_tokens": prompt_tokens, "prompt_token_ids": ids}
        else:
            request = {"generate_responses": [response], "prompt_tokens": [prompt_tokens], "prompt_token_ids": [ids]}
        request.update(model=self.client_request.get("model"), **{self.paths.request_key: self.client_request})
        status, data = await self.tier.call("POST", self.paths.derender_path, orjson.dumps(request))
        if status != 200:
            error = tier_error(status, data)
            self._failed("parser_render_tier")
            self.report.client_status = error.status
            return error.body(), error.status
        result = orjson.loads(data)
        result["id"] = self.request_id
        echo = chat_echo(self.client_request) if self.paths is CHAT else ""
        for choice in result.get("choices") or () if echo else ():
            message = choice.get("message") or {}
            message["content"] = echo + (message.get("content") or "")
        return dumps(result), None


class TierPassThrough(Answered):
    """``/tokenize`` and ``/detokenize``: the render tier's own answer, as an immediate reply."""

    def __init__(self, tier: RenderTier, path: str, x_request_id: str | None) -> None:
        super().__init__()
        self.tier = tier
        self.path = path
        self.x_request_id = x_request_id

    async def request_body(self, body: bytes) -> Reply:
        headers = {"X-Request-Id": self.x_request_id} if self.x_request_id else {}
        status, data = await self.tier.call("POST", self.path, body, headers)
        if status != 200:
            raise tier_error(status, data)
        return Reply(200, data)


# What render-tier mode makes of a request, for the endpoints that name one as their ``Endpoint.tier``:
# (tier, producer, x-request-id) -> the exchange. The others answer their ``not_in_tier`` (501).
def chat_exchange(tier: RenderTierClient, producer: Aborts, x_request_id: str | None) -> Exchange:
    assert isinstance(tier, RenderTier)
    return TierExchange(tier, CHAT, producer, x_request_id)


def completion_exchange(tier: RenderTierClient, producer: Aborts, x_request_id: str | None) -> Exchange:
    assert isinstance(tier, RenderTier)
    return TierExchange(tier, COMPLETION, producer, x_request_id)


def pass_through(path: str) -> Callable[[RenderTierClient, Aborts, str | None], Exchange]:
    """The tier's own answer to ``path`` (``/tokenize``, ``/detokenize``)."""

    def answer(tier: RenderTierClient, producer: Aborts, x_request_id: str | None) -> Exchange:
        assert isinstance(tier, RenderTier)
        return TierPassThrough(tier, path, x_request_id)

    return answer
