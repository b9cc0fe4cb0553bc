"""OpenAI request body -> the producer's ``GenerateRequest``, rendered by vLLM itself.

This is what vLLM's ``/v1/chat/completions/render`` does (``ServingRender``):
validation with vLLM's request model, the model check (404), the chat
template with tools and ``chat_template_kwargs``, ``max_tokens`` from
``max_model_len``, sampling params. One change on the way out: stop strings
stay with the filter. The filter holds the detokenizer, so it matches them,
holds text back and aborts the producer, as the coupled server does; a
``--tokens-only`` producer would refuse them. So that it can abort in time,
a non-streaming request with stop strings is streamed from the producer.
"""

from __future__ import annotations

from copy import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import orjson

from . import vllm_seams
from .errors import HTTPError, from_exception, parse_body
from .model import Model


@dataclass
class Rendered:
    request: Any  # vLLM ChatCompletionRequest
    request_id: str  # the OpenAI response id ("chatcmpl-...")
    prompt_token_ids: list[int]
    params: Any  # vLLM SamplingParams as the client asked (stop strings included)
    body: bytes  # JSON for POST /inference/v1/generate
    chat_template_kwargs: dict[str, Any]
    conversation: list[Any]  # the rendered messages; only needed for ``echo``
    media: tuple[tuple[str, int, int], ...] = ()  # the images: (content hash, placeholder offset, length)
    metered: bool = False  # non-streaming under a key's budget it may outrun: collected (``as_stream``)

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)

    @property
    def collect(self) -> bool:
        """Non-streaming with stop strings (or ``metered``): the producer streams, the filter answers
        once (``collect``)."""
        return not self.stream and (bool(self.params.stop) or self.metered)

    def as_stream(self, model: Model) -> bytes:
        """``metered``: the producer body of this non-streaming request asked as a stream, so that the
        filter sees its tokens as they come and can end the answer at the key's budget."""
        self.metered = True
        body = orjson.loads(self.body)
        body["stream"] = True
        return _dumps(_stream_options(body, model.prompt_tokens_details, model.stream_interval))


def parse_chat_request(model: Model, raw: bytes) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return parse_body(lambda body: ChatCompletionRequest.model_validate(body, from_attributes=True), raw)


async def render_chat(model: Model, raw: bytes, x_request_id: str | None) -> Rendered:
    """Render a ``/v1/chat/completions`` body; raises ``HTTPError`` for bad input."""
    return await render_chat_request(model, parse_chat_request(model, raw), x_request_id)


async def render_chat_request(model: Model, request: Any, x_request_id: str | None) -> Rendered:
    """Render a validated ``ChatCompletionRequest``; raises ``HTTPError`` for bad input."""
    headers = {"X-Request-Id": x_request_id} if x_request_id else {}
    with_tensors(request)
    try:
        result = await model.serving_render.render_chat_request(request, SimpleNamespace(headers=headers))
    except Exception as exc:  # vLLM raises for some bad input instead of returning
        raise from_exception(exc) from None
    if not hasattr(result, "token_ids"):
        raise HTTPError.from_vllm(result)
    conversation: list[Any] = []
    if request.echo:  # the coupled server echoes the last message from its conversation
        conversation = (await model.online_renderer.render_chat(request))[0]
    return Rendered(
        request=request,
        request_id=result.request_id,
        prompt_token_ids=list(result.token_ids),
        params=result.sampling_params,
        body=producer_body(result, usage=model.prompt_tokens_details, stream_interval=model.stream_interval),
        chat_template_kwargs=vllm_seams.effective_chat_template_kwargs(model.serving_chat, request),
        conversation=conversation,
        media=media_of(result.features),
    )


def media_of(features: Any) -> tuple[tuple[str, int, int], ...]:
    """The (content hash, placeholder offset, length) of each item of a ``GenerateRequest.features``,
    sorted by offset: what vLLM's prefix-cache block hashes carry of them."""
    if features is None:
        return ()
    items = [
        (digest, r.offset, r.length)
        for modality, digests in features.mm_hashes.items()
        for digest, r in zip(digests, features.mm_placeholders.get(modality, ()), strict=False)
    ]
    return tuple(sorted(items, key=lambda item: item[1]))


def with_tensors(request: Any) -> None:
    """A producer reads an image item without its tensors as one in its cache: whatever a client asks of
    vLLM's render endpoint (``mm_payload``, ``return_mm_kwargs``), a request that goes on to a producer
    carries them."""
    if getattr(request, "mm_payload", "tensors") != "tensors":
        request.mm_payload = "tensors"


def producer_body(generate_request: Any, usage: bool = False, stream_interval: int = 1) -> bytes:
    """The JSON vLLM's render endpoint would return, minus the stop strings.

    A non-streaming request with stop strings asks the producer for a stream:
    the filter has to see the tokens as they come to stop the producer at the
    stop string, as vLLM's engine stops itself (``collect``). ``usage``: a stream
    asks for the producer's final usage event, which carries its prefix-cache hits
    (``--enable-prompt-tokens-details``). ``stream_interval`` > 1: a stream asks the producer for
    an event every that many tokens (``SamplingParams.stream_interval``; vLLM's output processor
    takes the larger of it and the producer's own ``--stream-interval``), as ``vllm serve
    --stream-interval`` makes its own engine do.
    """
    params = generate_request.sampling_params
    if params.stop:
        params = copy(params)
        params.stop = []
        params.include_stop_str_in_output = False
        params.output_text_buffer_length = 0
        update: dict[str, Any] = {"sampling_params": params}
        if not generate_request.stream:
            update["stream"] = True
        generate_request = generate_request.model_copy(update=update)
    body = generate_request.model_dump()
    # vLLM serializes SamplingParams without fields equal to their defaults, and a
    # producer fills a missing max_tokens from max_model_len: an explicit 16 (the
    # default) would be lost. The coupled server honours it, so send it always.
    body["sampling_params"]["max_tokens"] = params.max_tokens
    return _dumps(_stream_options(body, usage, stream_interval))


def _stream_options(body: dict[str, Any], usage: bool, stream_interval: int) -> dict[str, Any]:
    if body.get("stream"):
        if usage:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        if stream_interval > 1:
            body["sampling_params"]["stream_interval"] = stream_interval
    return body


def _dumps(body: dict[str, Any]) -> bytes:
    return orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
