"""The parity oracle: vLLM 0.33.0's coupled ``/v1/chat/completions``, in process, on the CPU.

``OpenAIServingChat.create_chat_completion`` runs exactly as in ``vllm serve``:
vLLM renders the request, its ``InputProcessor`` builds the engine request, its
``OutputProcessor`` detokenizes and makes ``RequestOutput``s through a
``RequestOutputCollector``, and its stream generator writes the SSE frames.
Only the GPU engine core is replaced: ``ScriptedEngine`` yields, step by step,
the token ids (and logprobs) a test scripts, one engine step per producer event,
as ``AsyncLLM`` would hand them to the output processor. No derender code is used.
"""

from __future__ import annotations

import asyncio
import json
import os
from copy import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@dataclass
class Step:
    """One engine step of one choice: what the producer sends as one event."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None  # (logprob, rank, [(id, lp) top-k])


@dataclass
class Captured:
    prompt_token_ids: list[int] = field(default_factory=list)
    sampling_params: Any = None
    media: list[tuple[str, int, int]] = field(default_factory=list)  # images: (content hash, offset, length)


class ScriptedEngine:
    """What ``OpenAIServingChat`` needs of ``AsyncLLM``, with a script instead of a GPU."""

    errored = False
    delay = 0.0  # seconds between engine steps (the benchmark paces them like a decoding GPU)

    def __init__(self, vllm_config: Any, renderer: Any, steps: list[Step]) -> None:
        from vllm.v1.engine.input_processor import InputProcessor

        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer
        self.input_processor = InputProcessor(vllm_config, renderer)
        self.steps = steps
        self.captured = Captured()

    def check_admission(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any):
        from vllm.v1.engine import EngineCoreOutput, FinishReason
        from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector
        from vllm.v1.engine.parallel_sampling import ParentRequest
        from vllm.v1.outputs import LogprobsLists

        request = self.input_processor.process_inputs(
            request_id, prompt, sampling_params, supported_tasks=("generate",), arrival_time=None
        )
        self.input_processor.assign_request_id(request)
        params = request.params
        media = [(f.identifier, f.mm_position.offset, f.mm_position.length) for f in request.mm_features or ()]
        self.captured = Captured(list(request.prompt_token_ids or []), params, media)
        processor = OutputProcessor(self.renderer.get_tokenizer(), log_stats=False)
        queue = RequestOutputCollector(params.output_kind, request.request_id)
        ids: list[str] = []
        if params.n == 1:
            processor.add_request(request, None, None, 0, queue)
            ids.append(request.request_id)
        else:
            parent = ParentRequest(request)
            for i in range(params.n):
                child_id, child_params = parent.get_child_info(i)
                child = copy(request)
                child.request_id, child.sampling_params = child_id, child_params
                processor.add_request(child, None, parent, i, queue)
                ids.append(child_id)
        finish = {str(r): r for r in FinishReason}
        for step in self.steps:
            lps = None
            if step.logprobs is not None:
                rows = [[tid, *[t for t, _ in top]] for tid, (_, _, top) in zip(step.token_ids, step.logprobs)]
                vals = [[lp, *[v for _, v in top]] for lp, _, top in step.logprobs]
                lps = LogprobsLists(
                    np.array(rows, dtype=np.int64).reshape(len(rows), -1),
                    np.array(vals, dtype=np.float32).reshape(len(rows), -1),
                    np.array([r for _, r, _ in step.logprobs], dtype=np.int64),
                )
            out = EngineCoreOutput(
                request_id=ids[step.index],
                new_token_ids=list(step.token_ids),
                new_logprobs=lps,
                finish_reason=finish[step.finish_reason] if step.finish_reason else None,
                stop_reason=step.stop_reason,
            )
            processor.process_outputs([out])
            got = queue.get_nowait()
            if got is not None:
                yield got
                if got.finished:
                    return
            await self.pause()

    async def pause(self) -> None:
        """Between two engine steps."""
        await asyncio.sleep(self.delay)


class CoupledChat:
    """vLLM's coupled chat server for one model, built as ``vllm serve`` builds it (minus the GPU)."""

    def __init__(self, model_dir: str, *flags: str) -> None:
        from derender.translate import vision

        vision.prepare(model_dir)  # a VLM: torchvision and its classes, as the filter loads them
        from starlette.datastructures import State
        from vllm import AsyncEngineArgs
        from vllm.config import VllmConfig
        from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.entrypoints.launchers.render.app_state import init_render_app_state
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model_dir, *flags])
        engine_args = AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        model_config.quantization = None
        self.vllm_config = VllmConfig(
            model_config=model_config,
            structured_outputs_config=engine_args.create_structured_outputs_config(),
        )
        self.args = args
        self.state = State()
        asyncio.run(init_render_app_state(self.vllm_config, self.state, args))

    def serving(self, engine: ScriptedEngine, kind: Any = None) -> Any:
        """vLLM's coupled chat server (or ``kind``, a subclass such as ``AnthropicServingMessages``)
        with these flags, on ``engine``."""
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

        a, r = self.args, self.state.online_renderer
        return (kind or OpenAIServingChat)(
            engine,  # type: ignore[arg-type]
            self.state.openai_serving_models,
            "assistant",
            online_renderer=r,
            request_logger=None,
            chat_template=r.chat_template,
            chat_template_content_format=a.chat_template_content_format,
            reasoning_parser=a.reasoning_parser or self.vllm_config.structured_outputs_config.reasoning_parser or "",
            enable_auto_tools=a.enable_auto_tool_choice,
            tool_parser=a.tool_call_parser,
            default_chat_template_kwargs=r.default_chat_template_kwargs,
        )

    def run(self, body: dict, steps: list[Step]) -> tuple[list[dict] | dict, Captured]:
        """The coupled server's answer to ``body``: parsed SSE events (stream) or the JSON body."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        engine = ScriptedEngine(self.vllm_config, self.state.online_renderer.renderer, steps)
        serving = self.serving(engine)
        request = ChatCompletionRequest.model_validate(body)

        async def go():
            result = await serving.create_chat_completion(request)
            if hasattr(result, "model_dump") and not request.stream:
                return result.model_dump()
            frames = []
            async for frame in result:
                frames.append(frame)
            return frames

        result = asyncio.run(go())
        if isinstance(result, dict):
            return result, engine.captured
        events = []
        for frame in result:
            assert frame.startswith("data: ") and frame.endswith("\n\n"), frame
            payload = frame[6:-2]
            events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
        return events, engine.captured

    def serving_messages(self, engine: ScriptedEngine) -> Any:
        """vLLM's coupled Anthropic Messages server, with the same flags."""
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        return self.serving(engine, AnthropicServingMessages)

    def run_messages(self, body: dict, steps: list[Step]) -> tuple[list[tuple[str, dict]] | dict, Captured]:
        """The coupled server's ``/v1/messages`` answer: (event, data) pairs (stream) or the JSON body."""
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

        engine = ScriptedEngine(self.vllm_config, self.state.online_renderer.renderer, steps)
        serving = self.serving_messages(engine)
        request = AnthropicMessagesRequest.model_validate(body)

        async def go():
            result = await serving.create_messages(request)
            if hasattr(result, "error"):
                raise AssertionError(f"vLLM refused the request: {result}")
            if hasattr(result, "model_dump"):  # as vLLM's router sends it
                return result.model_dump(exclude_none=True)
            return [frame async for frame in result]

        result = asyncio.run(go())
        if isinstance(result, dict):
            return result, engine.captured
        return named_events("".join(result)), engine.captured


def named_events(text: str) -> list[tuple[str, dict]]:
    """An SSE stream of named events (Anthropic Messages, OpenAI Responses) as (event name, data) pairs."""
    events = []
    for frame in text.split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def coupled_responses(coupled: CoupledChat, engine: ScriptedEngine) -> Any:
    """vLLM's coupled Responses server, with ``coupled``'s flags."""
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    a, r = coupled.args, coupled.state.online_renderer
    return OpenAIServingResponses(
        engine,  # type: ignore[arg-type]
        coupled.state.openai_serving_models,
        r,
        request_logger=None,
        chat_template=r.chat_template,
        chat_template_content_format=a.chat_template_content_format,
        reasoning_parser=a.reasoning_parser or coupled.vllm_config.structured_outputs_config.reasoning_parser or "",
        enable_auto_tools=a.enable_auto_tool_choice,
        tool_parser=a.tool_call_parser,
        default_chat_template_kwargs=r.default_chat_template_kwargs,
    )


def run_responses(coupled: CoupledChat, body: dict, steps: list[Step]) -> tuple[list[tuple[str, dict]] | dict, Captured]:
    """The coupled server's ``/v1/responses`` answer: (event, data) pairs (stream) or the JSON body,
    serialized as vLLM's router serializes them."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    engine = ScriptedEngine(coupled.vllm_config, coupled.state.online_renderer.renderer, steps)
    serving = coupled_responses(coupled, engine)
    request = ResponsesRequest.model_validate(body)

    async def go():
        result = await serving.create_responses(request)
        if hasattr(result, "error"):
            raise AssertionError(f"vLLM refused the request: {result}")
        if not hasattr(result, "__aiter__"):
            return result.model_dump(mode="json", by_alias=True)
        return [(getattr(e, "type", "unknown"), json.loads(e.model_dump_json(indent=None, by_alias=True)))
                async for e in result]

    return asyncio.run(go()), engine.captured
