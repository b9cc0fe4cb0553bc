"""The chat stream generator of the lean path: vLLM 0.33.0's, for the streams the lean path takes.

vLLM's ``OpenAIServingChat.chat_completion_stream_generator_raw`` keeps a choice's live state in its
own locals: the ``ChatStreamProcessor`` (vLLM's public per-choice class, with the choice's reasoning
and tool parsers) and the ids the reasoning count is taken over. The lean path (``lean``) steps that
processor itself for the middle events, so it must hold the same objects. Instead of reading them
from the running generator's frame, the lean path runs this generator: vLLM 0.33.0's, line for line,
for the requests ``lean.eligible`` admits (one choice; no logprobs, echo, token ids, prompt text or
output logging), which keeps those objects in a ``LoopState`` the stream holds too. Each branch
below is the branch of vLLM's generator that such a request takes; what it calls on the serving
object and vLLM's private helpers goes through ``vllm_seams``, whose "chat stream generator" seam
checks that vLLM's generator is still the one copied (its source's digest). ``tests/test_lean.py``
runs this path and vLLM's generator over generated streams for every shipped tokenizer and parser
configuration and demands identical bytes; ``--stream-path vllm`` serves with vLLM's generator.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Final

from . import vllm_seams

# vLLM's own logger name, so that its lines read as vLLM's generator writes them
logger = logging.getLogger("vllm.entrypoints.openai.chat_completion.serving")


class LoopState:
    """The generator's per-stream objects, shared with the lean path (``lean._Frame``)."""

    __slots__ = ("created", "generated", "model_name", "object", "processors", "request_id")

    def __init__(self) -> None:
        self.processors: list[Any] = []
        self.generated: list[list[int]] = []  # per choice: the ids the reasoning tokens are counted over
        self.request_id = ""
        self.model_name = ""
        self.object = "chat.completion.chunk"
        self.created = 0


async def chat_stream(
    serving: Any,
    state: LoopState,
    request: Any,
    result_generator: Any,
    request_id: str,
    model_name: str,
    conversation: Any,
    tokenizer: Any,
    request_metadata: Any,
    chat_template_kwargs: dict[str, Any] | None = None,
    mm_token_counts: dict[str, int] | None = None,
) -> Any:
    """vLLM 0.33.0's ``chat_completion_stream_generator_raw`` for a request ``lean.eligible`` admits,
    its per-stream objects kept in ``state``."""
    from vllm.entrypoints.generate.base.protocol import DeltaMessage, PerRequestMetrics
    from vllm.entrypoints.generate.base.serving import build_per_request_timing_metrics, build_spec_decoding_metrics
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )
    from vllm.entrypoints.openai.chat_completion.stream_processor import ChatStreamProcessor
    from vllm.entrypoints.serve.engine.protocol import UsageInfo
    from vllm.entrypoints.serve.utils.api_utils import should_include_usage
    from vllm.exceptions import GenerationError
    from vllm.utils.collection_utils import as_list

    completion_details, prompt_details = vllm_seams.chat_usage_details()
    reasoning_details = vllm_seams.include_reasoning_tokens_details(serving)
    created_time = int(time.time())
    chunk_object_type: Final = "chat.completion.chunk"
    state.request_id, state.model_name, state.object, state.created = (
        request_id,
        model_name,
        chunk_object_type,
        created_time,
    )
    first_iteration = True

    def chunk_of(choices: list[Any], **fields: Any) -> Any:
        """A chunk as vLLM's generator builds each: these fields, and ``fields`` set explicitly."""
        return ChatCompletionStreamResponse(
            id=request_id, object=chunk_object_type, created=created_time, choices=choices, model=model_name, **fields
        )

    num_choices = 1 if request.n is None else request.n
    generated_token_ids: list[list[int]] = [[] for _ in range(num_choices)]
    state.generated = generated_token_ids
    previous_reasoning_tokens = [0] * num_choices
    finish_reason_sent = [False] * num_choices
    num_prompt_tokens = 0
    num_cached_tokens = None
    num_cache_creation_tokens = None

    try:
        if serving.parser_cls is not None:
            if tokenizer is None:
                raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
            processors = [
                ChatStreamProcessor(
                    request,
                    vllm_seams.make_parser(serving, request, tokenizer, chat_template_kwargs),
                    enable_auto_tools=serving.enable_auto_tools,
                    parser_cls=serving.parser_cls,
                )
                for _ in range(num_choices)
            ]
        else:
            processors = [
                ChatStreamProcessor(request, None, enable_auto_tools=serving.enable_auto_tools, parser_cls=None)
                for _ in range(num_choices)
            ]
    except Exception as e:
        logger.exception("Error in parser creation.")
        yield serving.create_error_response(e)
        return
    state.processors = processors

    include_usage, include_continuous_usage = should_include_usage(
        request.stream_options, serving.enable_force_include_usage
    )

    last_res = None
    try:
        async for res in result_generator:
            last_res = res
            if res.prompt_token_ids is not None:
                num_prompt_tokens = len(res.prompt_token_ids)
                if res.encoder_prompt_token_ids is not None:
                    num_prompt_tokens += len(res.encoder_prompt_token_ids)

            if first_iteration:
                num_cached_tokens = res.num_cached_tokens
                num_cache_creation_tokens = res.num_cache_creation_tokens
                role = serving.get_chat_request_role(request)
                for i in range(num_choices):
                    choice_data = ChatCompletionResponseStreamChoice(
                        index=i, delta=DeltaMessage(role=role, content=""), logprobs=None, finish_reason=None
                    )
                    # eligible: no return_token_ids, no return_prompt_text
                    chunk = chunk_of([choice_data], prompt_token_ids=None, prompt_text=None)
                    if include_continuous_usage:
                        chunk.usage = UsageInfo(
                            prompt_tokens=num_prompt_tokens,
                            completion_tokens=0,
                            total_tokens=num_prompt_tokens,
                            completion_tokens_details=(completion_details(0) if reasoning_details else None),
                        )
                    yield chunk
                # eligible: no echo
                first_iteration = False

            for output in res.outputs:
                i = output.index
                processor = processors[i]
                parser = processor.parser
                if finish_reason_sent[i]:
                    continue

                vllm_seams.raise_if_error(serving, output.finish_reason, request_id)
                logprobs = None  # eligible: no logprobs
                delta_text = output.text

                if (
                    not delta_text
                    and not output.token_ids
                    and not processor.num_output_tokens
                    and (output.finish_reason is None)
                ):
                    continue  # chunked prefill: no empty chunks

                delta_message, finish_reason = processor.step(
                    delta_text, as_list(output.token_ids), output.finish_reason, res.prompt_token_ids
                )

                if parser is not None and reasoning_details:
                    generated_token_ids[i].extend(output.token_ids)
                    if include_continuous_usage:
                        previous_reasoning_tokens[i] = parser.count_reasoning_tokens(tuple(generated_token_ids[i]))

                if delta_message is None:
                    # eligible: no logprobs and no return_token_ids, so only a finish sends a chunk
                    if output.finish_reason is None:
                        continue
                    delta_message = DeltaMessage()

                # eligible: no output logging, no return_token_ids
                if output.finish_reason is None:
                    choice_data = ChatCompletionResponseStreamChoice(
                        index=i, delta=delta_message, logprobs=logprobs, finish_reason=None, token_ids=None
                    )
                else:
                    choice_data = ChatCompletionResponseStreamChoice(
                        index=i,
                        delta=delta_message,
                        logprobs=logprobs,
                        finish_reason=finish_reason,
                        stop_reason=output.stop_reason,
                        token_ids=None,
                        weight_versions=(output.weight_versions if request.return_weight_versions else None),
                    )
                    finish_reason_sent[i] = True

                chunk = chunk_of(
                    [choice_data], kv_transfer_params=(res.kv_transfer_params if finish_reason_sent[i] else None)
                )
                if (
                    not include_usage
                    and serving.system_fingerprint is not None
                    and choice_data.finish_reason is not None
                ):
                    chunk.system_fingerprint = serving.system_fingerprint

                if include_continuous_usage:
                    completion_tokens = processor.num_output_tokens
                    chunk.usage = UsageInfo(
                        prompt_tokens=num_prompt_tokens,
                        completion_tokens=completion_tokens,
                        total_tokens=num_prompt_tokens + completion_tokens,
                        completion_tokens_details=(
                            completion_details(previous_reasoning_tokens[i]) if reasoning_details else None
                        ),
                    )
                yield chunk

        if reasoning_details and not include_continuous_usage:
            for i, processor in enumerate(processors):
                parser = processor.parser
                if parser is not None and generated_token_ids[i]:
                    previous_reasoning_tokens[i] = parser.count_reasoning_tokens(tuple(generated_token_ids[i]))

        if include_usage:
            completion_tokens = sum(p.num_output_tokens for p in processors)
            final_usage = UsageInfo(
                prompt_tokens=num_prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=num_prompt_tokens + completion_tokens,
                completion_tokens_details=completion_details(sum(previous_reasoning_tokens))
                if reasoning_details
                else None,
            )
            final_usage.prompt_tokens_details = prompt_details(
                serving.enable_prompt_tokens_details, num_cached_tokens, num_cache_creation_tokens, mm_token_counts
            )
            stream_per_request_metrics = None
            if (request.n or 1) == 1:
                if serving.enable_per_request_metrics:
                    last_metrics = last_res.metrics if last_res is not None else None
                    stream_per_request_metrics = build_per_request_timing_metrics(last_metrics, completion_tokens)
                spec_stats = build_spec_decoding_metrics(last_res)
                if spec_stats is not None:
                    if stream_per_request_metrics is None:
                        stream_per_request_metrics = PerRequestMetrics()
                    stream_per_request_metrics.speculative_decoding = spec_stats
            yield chunk_of(
                [], usage=final_usage, system_fingerprint=serving.system_fingerprint, metrics=stream_per_request_metrics
            )

        num_completion_tokens = sum(p.num_output_tokens for p in processors)
        request_metadata.final_usage_info = UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            completion_tokens_details=completion_details(sum(previous_reasoning_tokens)) if reasoning_details else None,
        )
        # eligible: no output logging
    except GenerationError as e:
        yield serving.create_error_response(str(e), err_type="InternalServerError", status_code=e.status_code)
    except Exception as e:
        logger.exception("Error in chat completion stream generator.")
        yield serving.create_error_response(e)
