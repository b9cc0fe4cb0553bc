"""``POST /v1/completions`` by vLLM's own completion server code, one prompt per request.

Rendering is what vLLM's ``/v1/completions/render`` does (``ServingRender``).
Output goes through vLLM's ``OpenAIServingCompletion`` generators, streaming
and full, fed the ``RequestOutput``s the coupled server would see: the stream
generator is driven by hand exactly as ``derender.ChatStream`` drives the chat
one. So ``echo``, ``logprobs`` (with ``text_offset``), ``n``, stop strings,
``return_token_ids`` and usage come out as ``vllm serve`` writes them.

Two refusals, both 400 before anything reaches a producer:
- several prompts in one request: Envoy maps one HTTP request to one producer
  request, so each prompt must be sent in its own request;
- prompt logprobs (``prompt_logprobs``, or ``echo`` with ``logprobs``, which
  asks for them): the producer's token stream does not carry them.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ..exchange import Endpoint
from ..translate import vllm_seams
from ..translate.errors import ONE_PROMPT, HTTPError, dumps, from_exception, parse_body
from ..translate.model import Model
from ..translate.render import Rendered, producer_body, with_tensors
from ..translate.stream import ChatStream
from . import rendertier
from .chat import ChatExchange

NO_PROMPT_LOGPROBS = (
    "Prompt logprobs are not available here: the producer's token stream does not carry them. "
    "Remove prompt_logprobs (and logprobs when echo is set)."
)


@dataclass
class RenderedCompletion(Rendered):
    # What the coupled server hands its generators as the engine input: the
    # prompt ids, and the prompt text when ``echo`` needs it.
    engine_input: dict[str, Any] = field(default_factory=dict)


@functools.cache
def serving_completion(model: Model) -> Any:
    """vLLM's ``OpenAIServingCompletion`` for ``model``, with the chat server's stand-in engine."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    return model.vllm_serving(OpenAIServingCompletion)


async def render_completion(model: Model, raw: bytes, x_request_id: str | None) -> RenderedCompletion:
    """Render a ``/v1/completions`` body; raises ``HTTPError`` for bad input."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request = parse_body(lambda body: CompletionRequest.model_validate(body, from_attributes=True), raw)
    headers = {"X-Request-Id": x_request_id} if x_request_id else {}
    try:
        with_tensors(request)
        result = await model.serving_render.render_completion_request(request, SimpleNamespace(headers=headers))
    except Exception as exc:  # vLLM raises for some bad input instead of returning
        raise from_exception(exc) from None
    if not isinstance(result, list):
        raise HTTPError.from_vllm(result)
    if len(result) != 1:
        raise HTTPError(400, ONE_PROMPT.format(n=len(result)), param="prompt")
    if request.prompt_logprobs is not None or (request.echo and request.logprobs is not None):
        raise HTTPError(400, NO_PROMPT_LOGPROBS, param="prompt_logprobs")
    generate = result[0]
    engine_input: dict[str, Any] = {"type": "token", "prompt_token_ids": list(generate.token_ids)}
    if request.echo:  # the prompt text as the coupled server's renderer gives it
        engine_input = dict((await model.online_renderer.render_completion(request, skip_mm_cache=True))[0])
    return RenderedCompletion(
        request=request,
        request_id=generate.request_id,
        prompt_token_ids=list(generate.token_ids),
        params=generate.sampling_params,
        body=producer_body(generate, usage=model.prompt_tokens_details, stream_interval=model.stream_interval),
        chat_template_kwargs={},
        conversation=[],
        engine_input=engine_input,
    )


class CompletionStream(ChatStream):
    """One streaming completion: ``ChatStream``'s driver around vLLM's completion generator."""

    def _generator(self, model: Model, rendered: RenderedCompletion):  # type: ignore[override]
        from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata

        return serving_completion(model).completion_stream_generator(
            rendered.request,
            [rendered.engine_input],
            self._indexed(),
            rendered.request_id,
            int(time.time()),
            model.response_name(rendered.request.model),
            num_prompts=1,
            tokenizer=model.tokenizer,
            request_metadata=RequestResponseMetadata(request_id=rendered.request_id),
        )

    async def _indexed(self):
        """``(prompt index, output)`` pairs, as ``merge_async_iterators`` yields them."""
        async for output in self._results():
            yield 0, output


async def completion_response(model: Model, rendered: RenderedCompletion, final: Any) -> bytes:
    """The generation's final ``RequestOutput`` -> the ``text_completion`` JSON, by vLLM's own code."""
    from vllm.entrypoints.generate.base.protocol import RequestResponseMetadata

    serving = serving_completion(model)
    if final.prompt is None:
        final.prompt = vllm_seams.extract_prompt_text(serving, rendered.engine_input)
    try:
        result = serving.request_output_to_completion_response(
            [final],
            rendered.request,
            rendered.request_id,
            int(time.time()),
            model.response_name(rendered.request.model),
            model.tokenizer,
            RequestResponseMetadata(request_id=rendered.request_id),
        )
    except Exception as exc:  # e.g. finish_reason "error": the coupled server answers 500
        raise from_exception(exc) from None
    return dumps(result.model_dump())


class CompletionExchange(ChatExchange):
    """One ``/v1/completions`` exchange: ``ChatExchange`` with the completion pieces."""

    render = staticmethod(render_completion)
    stream_class = CompletionStream
    lean_class = None
    full_response = staticmethod(completion_response)
    endpoint = "completion"
    operation = "text_completion"


ENDPOINT = Endpoint("/v1/completions", CompletionExchange, tier=rendertier.completion_exchange)
