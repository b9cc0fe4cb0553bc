"""One served model: vLLM's own renderer, parsers and chat serving, built without an engine.

The objects are built exactly as ``vllm launch render`` builds its state (a
``VllmConfig`` from ``vllm serve`` flags, then ``init_render_app_state``), so
rendering and parsing behave as vLLM's. ``OpenAIServingChat`` gets a stand-in
engine client that only carries the config and renderer: the filter drives its
stream generator with outputs rebuilt from the producer's token events.
Everything here is read-only once built and shared by all streams of a process.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..settings import Settings
from . import longprompt, media, parser_tables, vision, vllm_seams

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

log = logging.getLogger("derender.model")


@dataclass(frozen=True)
class ModelSpec:
    """What ``vllm serve`` would be told about a model."""

    model: str
    served_model_name: tuple[str, ...] = ()
    max_model_len: int | None = None
    chat_template: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    default_chat_template_kwargs: str | None = None  # JSON, as vLLM takes it
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens from the producer
    stream_interval: int = 1  # the producer sends a streaming event every N tokens (SamplingParams.stream_interval)
    lora_modules: tuple[str, ...] = ()  # vllm serve --lora-modules: "name=path" or its JSON form, one each
    # Vision-language models (``vision``, ``media``): where image URLs may come from, as vllm serve takes it,
    # plus the networks besides public ones media may be fetched from; vLLM's processor cache per process.
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    allowed_media_networks: tuple[str, ...] = ()
    mm_processor_cache_gb: float = 0.5  # vLLM's default is 4 GiB per process: too much for every gateway worker
    max_producer_body_bytes: int = 16 << 20  # a larger rendered request is a 413 (Envoy's buffer, BODY_LIMIT_BYTES)
    settings: Settings = field(
        default_factory=Settings
    )  # what the process serves it with (not vllm serve's): stream path, store

    def vllm_argv(self) -> list[str]:
        argv = ["--model", self.model, "--mm-processor-cache-gb", str(self.mm_processor_cache_gb)]
        if self.served_model_name:
            argv += ["--served-model-name", *self.served_model_name]
        if self.max_model_len:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.chat_template:
            argv += ["--chat-template", self.chat_template]
        if self.reasoning_parser:
            argv += ["--reasoning-parser", self.reasoning_parser]
        if self.tool_call_parser:
            argv += ["--tool-call-parser", self.tool_call_parser]
        if self.enable_auto_tool_choice:
            argv += ["--enable-auto-tool-choice"]
        if self.default_chat_template_kwargs:
            argv += ["--default-chat-template-kwargs", self.default_chat_template_kwargs]
        if self.enable_prompt_tokens_details:
            argv += ["--enable-prompt-tokens-details"]
        if self.stream_interval != 1:
            argv += ["--stream-interval", str(self.stream_interval)]
        if self.lora_modules:
            argv += ["--lora-modules", *self.lora_modules]
        if self.allowed_local_media_path:
            argv += ["--allowed-local-media-path", self.allowed_local_media_path]
        if self.allowed_media_domains:
            argv += ["--allowed-media-domains", *self.allowed_media_domains]
        return argv


def _serving_options(model: Model) -> dict[str, Any]:
    """What ``vllm serve`` gives its serving objects from its arguments (``init_app_state``, the
    generate router), for every option the filter serves with; each class takes the ones it names."""
    args, renderer = model.args, model.online_renderer
    return {
        "response_role": args.response_role,
        "online_renderer": renderer,
        "request_logger": None,  # the filter writes one line per request itself (never the text)
        "chat_template": renderer.chat_template,
        "chat_template_content_format": args.chat_template_content_format,
        "trust_request_chat_template": args.trust_request_chat_template,
        "return_tokens_as_token_ids": args.return_tokens_as_token_ids,
        "reasoning_parser": model.reasoning_parser,
        "enable_auto_tools": args.enable_auto_tool_choice,
        "exclude_tools_when_tool_choice_none": args.exclude_tools_when_tool_choice_none,
        "tool_parser": args.tool_call_parser,
        "tool_strict_level": args.tool_strict_level,
        "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
        "enable_force_include_usage": args.enable_force_include_usage,
        "default_chat_template_kwargs": renderer.default_chat_template_kwargs,
        "disabled_thinking_effort": args.anthropic_disabled_thinking_effort,
    }


class _EngineStandIn:
    """What ``OpenAIServingChat`` reads from an engine client, and nothing more."""

    errored = False
    input_processor = None

    def __init__(self, vllm_config: Any, renderer: Any) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer

    def check_admission(self, *args: Any, **kwargs: Any) -> None:
        """Admission (queue limits) is the producer's: it answers 503 itself when full."""
        return

    async def add_lora(self, lora_request: Any) -> bool:
        """A LoRA adapter is the producers' to load (``--lora-modules`` there too): nothing to load here."""
        return True


class Model:
    """Read-only vLLM objects for one served model."""

    def __init__(self, spec: ModelSpec) -> None:
        vision.prepare(spec.model)  # a VLM's classes and torchvision, before vLLM (and transformers) load
        from starlette.datastructures import State
        from vllm import AsyncEngineArgs, envs
        from vllm.config import VllmConfig
        from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.entrypoints.launchers.render.app_state import init_render_app_state
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        self.spec = spec
        self.settings = spec.settings
        self.lean = _lean(spec.settings)  # the lean stream path (``lean``, ``parser_tables``)
        if self.lean:
            parser_tables.memoize()
        if (Path(spec.model) / "o200k_base.tiktoken").is_file():
            # gpt-oss: openai-harmony reads its encoding from here, never from a hub.
            os.environ.setdefault("TIKTOKEN_ENCODINGS_BASE", str(Path(spec.model).resolve()))
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(spec.vllm_argv())
        engine_args = AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        model_config.quantization = None  # rendering only: no kernels
        envs.VLLM_CPU_KVCACHE_SPACE = 0
        vllm_config = VllmConfig(
            model_config=model_config,
            logging_config=engine_args.create_logging_config(),
            structured_outputs_config=engine_args.create_structured_outputs_config(),
        )
        state = State()
        asyncio.run(init_render_app_state(vllm_config, state, args))

        self.args = args
        self.vllm_config = vllm_config
        self.model_config = model_config
        self.max_model_len: int = model_config.max_model_len
        self.max_producer_body: int = spec.max_producer_body_bytes
        self.multimodal: bool = bool(model_config.is_multimodal_model)
        if self.multimodal:
            media.install(spec.allowed_media_networks)
        self.served_names: list[str] = list(args.served_model_name or [args.model])
        self.name = self.served_names[0]
        self.registry = state.openai_serving_models
        if args.lora_modules:  # the adapters, as vllm serve's OpenAIServingModels holds them
            self.registry = _with_adapters(self.registry, vllm_config, state, args.lora_modules)
        # Names a request may give: the served names, then every adapter's.
        self.adapters: list[str] = list(getattr(self.registry, "lora_requests", {}))
        self.online_renderer = state.online_renderer
        self.serving_render = state.serving_render
        self.serving_tokenization = state.serving_tokenization
        self.renderer = self.online_renderer.renderer
        if self.multimodal:
            # vLLM's sender-side processor cache assumes an engine behind it that holds what it was sent
            # (it sends an item seen before as None); the filter has none, and a producer reads None as
            # "in my cache". Every path renders through the processor-only cache, as vLLM's render
            # endpoints do (``skip_mm_cache=True``): Responses (vLLM's own serving class) included.
            vllm_seams.render_through_processor_only_cache(self.renderer)
            vision.guard_features(self.serving_render)  # sparse placeholders: a 400, not a wrong answer
        self.tokenizer = self.renderer.get_tokenizer()
        self.parser_cls = self.online_renderer.parser
        self.use_harmony = model_config.hf_config.model_type == "gpt_oss"
        # The reasoning parser's name, as ``vllm serve`` resolves it (every serving object takes it).
        self.reasoning_parser: str = (
            args.reasoning_parser or vllm_config.structured_outputs_config.reasoning_parser or ""
        )
        self.serving_chat = self.vllm_serving(OpenAIServingChat)
        # The producers' prefix-cache hits, passed on in every endpoint's usage (outputs.LateCount).
        self.prompt_tokens_details: bool = bool(args.enable_prompt_tokens_details)
        # vllm serve --stream-interval: every streaming producer request asks for an event every N tokens.
        self.stream_interval: int = args.stream_interval
        # Long prompts tokenized in pieces, an agent's repeated prefix from memory (its memo, if any).
        self.long_prompts, self.prompt_memo = longprompt.install(self.renderer)
        for problem in vllm_seams.check_once():
            log.warning("%s; the filter falls back to vLLM's own path where it can", problem)
        self._warm_up()
        if self.lean:  # the parsers' modules are loaded now: the warm-up built them
            parser_tables.patch_parsers()
        log.info("model %s loaded from %s (max_model_len %d)", self.name, spec.model, self.max_model_len)

    def with_settings(self, settings: Settings) -> Model:
        """This model served with other settings (another stream path, say), sharing its vLLM objects."""
        other = copy.copy(self)
        other.spec = replace(self.spec, settings=settings)
        other.settings = settings
        other.lean = _lean(settings)
        if other.lean:
            parser_tables.memoize()
            parser_tables.patch_parsers()
        return other

    def vllm_serving(self, cls: type, engine: Any = None) -> Any:
        """A vLLM serving object (``OpenAIServingChat``, ``OpenAIServingCompletion``,
        ``AnthropicServingMessages``, ``OpenAIServingResponses``) for this model, given the options
        ``vllm serve`` gives it, on ``engine`` (default: a stand-in that generates nothing)."""
        params = inspect.signature(cls).parameters
        options = {k: v for k, v in _serving_options(self).items() if k in params}
        engine = engine or _EngineStandIn(self.vllm_config, self.renderer)
        return cls(engine, self.registry, **options)

    def _warm_up(self) -> None:
        """Pay now (once, before workers fork) what vLLM computes on a first request.

        The first logprobs request reads the tokenizer's leading-space marker by
        serializing the whole tokenizer (seconds for a 200k vocab, long enough on a
        busy host to trip Envoy's per-message timeout); Harmony loads its encoding.
        """
        from vllm.tokenizers.detokenizer_utils import get_leading_space_marker

        get_leading_space_marker(self.tokenizer)  # cached on the tokenizer
        if self.long_prompts:  # the tokenizer copies its two threads borrow
            longprompt.encode(self.tokenizer, ["warm up the tokenizer copies " * 2000] * 2)
        if self.use_harmony:
            from vllm.entrypoints.openai.parser.harmony_utils import get_encoding

            get_encoding()
        if self.multimodal:  # the image processor, built and run once (seconds), in this thread: no
            self.renderer.warmup_mm()  # executor thread may start before the workers fork

    def response_name(self, requested: str | None) -> str:
        """The ``model`` vLLM writes in its answers to a request for ``requested``
        (``models.model_name(lora_request)``): the adapter's name, else the first served name."""
        adapters = getattr(self.registry, "lora_requests", {})
        return self.registry.model_name(adapters.get(requested) if requested else None)

    def lora(self, requested: str | None) -> tuple[str, str] | None:
        """The (name, path) of the adapter ``requested`` names, if it names one."""
        adapter = getattr(self.registry, "lora_requests", {}).get(requested) if requested else None
        return (adapter.lora_name, adapter.lora_path) if adapter is not None else None

    def serves(self, name: str | None) -> bool:
        return not name or name in self.served_names


def _with_adapters(registry: Any, vllm_config: Any, state: Any, lora_modules: list[Any]) -> Any:
    """vLLM's ``OpenAIServingModels`` with ``lora_modules`` loaded (``init_static_loras``), in place
    of the render server's registry, which knows no adapters: model cards list them with their
    ``parent``, the model check accepts their names, and a request naming one renders with it (its
    ``GenerateRequest.model`` names it, which selects the adapter at the producer)."""
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    engine = _EngineStandIn(vllm_config, state.online_renderer.renderer)
    models = OpenAIServingModels(engine, registry.base_model_paths, lora_modules=lora_modules)  # type: ignore[arg-type]
    asyncio.run(models.init_static_loras())
    for serving in (state.serving_render, state.serving_tokenization):
        serving.models = models
    return models


def _lean(settings: Settings) -> bool:
    """The lean stream path, if asked for and the vLLM seams it rests on hold (``vllm_seams.LEAN``)."""
    if settings.stream_path != "lean":
        return False
    if not vllm_seams.lean_holds():
        log.warning(
            "the installed vLLM is not the one the lean stream path was written for: vLLM's path for every stream"
        )
        return False
    return True
