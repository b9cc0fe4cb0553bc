"""Every use of vLLM's non-public surface, in one module.

The filter reuses vLLM 0.33's own serving code for parity, and in a few places it reaches past vLLM's
public API: a private method called or overridden, a private attribute read or replaced, a loop
copied. Each such place is a *seam*, listed in ``SEAMS`` with where
in vLLM it was read (vLLM ``VLLM``), what the filter takes from it, and a check of its shape in the
installed vLLM. The rest of the package goes through the functions below and nothing else
(``tests/test_layout.py`` finds any private name or frame read elsewhere); ``check()`` says which
seams an installed vLLM has moved (``tests/test_vllm_seams.py``, and ``derender serve`` logs it at
start-up), so an upgrade names the seam that broke rather than failing somewhere downstream.

The module is longer than 400 lines on purpose: it is the catalogue, one short entry per seam, and
keeping every seam in one place is its point.

No seam reads a running frame or a closure: where the lean path needs the objects a vLLM loop keeps
in its locals, it runs the filter's copy of that loop (``chat_loop``, ``endpoints/responses/lean``),
and the seam checks that vLLM's loop is still the one copied (its source's digest). Those seams
(``LEAN``) also decide at run time: if one moved, the lean path is off and every stream takes vLLM's
own path (``lean_holds``). Most other seams have a fallback where they are used (the plain call);
their checks are for the reader of a failed upgrade.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any

VLLM = "0.33.0"  # the vLLM every seam below was read from


class SeamChanged(Exception):
    """The installed vLLM no longer has a seam's shape."""

    def __init__(self, seam: str, detail: str) -> None:
        super().__init__(f"vLLM seam {seam!r} (read from vLLM {VLLM}) is not as expected: {detail}")
        self.seam = seam


@dataclass(frozen=True)
class Seam:
    name: str
    where: str  # vLLM's module:qualified name
    use: str  # what the filter takes from it
    check: Callable[[], None]  # raises SeamChanged if the installed vLLM's shape differs


SEAMS: dict[str, Seam] = {}


def _seam(name: str, where: str, use: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(check: Callable[[], None]) -> Callable[[], None]:
        SEAMS[name] = Seam(name, where, use, check)
        return check

    return register


def check() -> list[str]:
    """What differs in the installed vLLM: one line per seam that moved (empty: every seam holds)."""
    return [problem for _, problem in _moved()]


def moved() -> dict[str, str]:
    """The seams the installed vLLM has moved: name -> what differs."""
    return dict(_moved())


def source(where: str) -> str:
    """The installed vLLM's source of ``where`` (``module:Qual.name``)."""
    return inspect.getsource(inspect.unwrap(_find(where)))


def _moved() -> list[tuple[str, str]]:
    problems = []
    for seam in SEAMS.values():
        try:
            seam.check()
        except SeamChanged as exc:
            problems.append((seam.name, str(exc)))
        except Exception as exc:  # noqa: BLE001 - an import or attribute gone: that seam moved
            problems.append((seam.name, str(SeamChanged(seam.name, f"{type(exc).__name__}: {exc}"))))
    return problems


@functools.cache
def check_once() -> tuple[str, ...]:
    """``check()``, once per process (each ``Model`` logs what it found)."""
    return tuple(problem for _, problem in _moved_once())


@functools.cache
def _moved_once() -> tuple[tuple[str, str], ...]:
    return tuple(_moved())


# The seams under the lean path's copies of vLLM's loops: if one moved, the copies may no longer do
# what the installed vLLM does, and every stream takes vLLM's own path (``lean_holds``).
LEAN = ("chat stream generator", "chat usage details", "responses simple loop", "responses errors and logprobs")


def lean_holds() -> bool:
    """Every seam the lean path rests on holds in the installed vLLM (checked once per process)."""
    return not any(name in LEAN for name, _ in _moved_once())


# -- shape checks ------------------------------------------------------------------------------------
def _find(where: str) -> Any:
    """``module:Qual.name`` -> the object."""
    module, _, qualname = where.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def _code(where: str) -> CodeType:
    return inspect.unwrap(_find(where)).__code__


def _same_source(seam: str, where: str, sha256: str) -> None:
    """``where``'s source is the one the filter's copy of it was made from (its digest)."""
    if hashlib.sha256(source(where).encode()).hexdigest() != sha256:
        raise SeamChanged(seam, "its source is not the one the filter's copy was made from")


def _sets(seam: str, code: CodeType, attribute: str) -> None:
    if attribute not in code.co_names:
        raise SeamChanged(seam, f"{code.co_name} no longer sets or reads .{attribute}")


def _parameters(seam: str, where: str, names: tuple[str, ...]) -> None:
    params = inspect.signature(_find(where)).parameters
    missing = [n for n in names if n not in params]
    if missing:
        raise SeamChanged(seam, f"{where} takes no {', '.join(missing)} (it takes {', '.join(params)})")


# -- the chat stream generator (translate/chat_loop.py) ---------------------------------------------------
CHAT_GENERATOR = (
    "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_stream_generator_raw"
)
# The sha256 of vLLM 0.33.0's source of the generator that ``chat_loop.chat_stream`` copies.
CHAT_GENERATOR_SOURCE = "f946a97899fce0d95f150fb5a6ffad72b3b011c523f133398e04336ad2a214ca"
CHAT_SERVING = "vllm.entrypoints.openai.chat_completion.serving"


@_seam(
    "chat stream generator",
    CHAT_GENERATOR,
    "the lean path runs the filter's copy of it (translate/chat_loop.py) for the requests it takes, "
    "which keeps the per-choice processors and generated ids where the lean path steps them",
)
def _check_chat_generator() -> None:
    _same_source("chat stream generator", CHAT_GENERATOR, CHAT_GENERATOR_SOURCE)


@_seam(
    "chat usage details",
    f"{CHAT_SERVING}:_make_completion_tokens_details",
    "the usage's completion and prompt token details as the chat generator builds them "
    "(_make_completion_tokens_details, _make_prompt_tokens_details), and _raise_if_error",
)
def _check_chat_usage_details() -> None:
    _parameters("chat usage details", f"{CHAT_SERVING}:_make_completion_tokens_details", ("reasoning_tokens",))
    _parameters(
        "chat usage details",
        f"{CHAT_SERVING}:_make_prompt_tokens_details",
        ("enable_prompt_tokens_details", "num_cached_tokens", "num_cache_creation_tokens", "mm_token_counts"),
    )
    _parameters(
        "chat usage details", f"{CHAT_SERVING}:OpenAIServingChat._raise_if_error", ("finish_reason", "request_id")
    )


def chat_usage_details() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(``_make_completion_tokens_details``, ``_make_prompt_tokens_details``) of vLLM's chat serving."""
    module = importlib.import_module(CHAT_SERVING)
    return module._make_completion_tokens_details, module._make_prompt_tokens_details


@_seam(
    "reasoning token details",
    "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.__init__",
    "whether the generator counts reasoning tokens per chunk (_include_reasoning_tokens_details)",
)
def _check_reasoning_details() -> None:
    _sets("reasoning token details", _code(SEAMS["reasoning token details"].where), "_include_reasoning_tokens_details")


def include_reasoning_tokens_details(serving_chat: Any) -> bool:
    return bool(serving_chat._include_reasoning_tokens_details)


# -- the parsers' delta models (translate/parser_tables.py) ---------------------------------------------
EXTRA_FIELD_LOGGER = "vllm.entrypoints.serve.engine.protocol:OpenAIBaseModel.__log_extra_fields__"
# The sha256 of vLLM 0.33.0's source of it: it validates, then logs a request's unknown fields, nothing else.
EXTRA_FIELD_LOGGER_SOURCE = "6f963e0ab2f731b8175eb134b2930d00028b52bc1fc8013259798d7dcf7423a1"


@_seam(
    "delta models' extra-field logger",
    EXTRA_FIELD_LOGGER,
    "the lean path validates the parsers' delta models (DeltaMessage, DeltaToolCall) without this "
    "wrapping validator, which only logs; if it changed, they keep it",
)
def _check_extra_field_logger() -> None:
    _same_source("delta models' extra-field logger", EXTRA_FIELD_LOGGER, EXTRA_FIELD_LOGGER_SOURCE)


def extra_field_logger() -> Any:
    """The function under vLLM's ``OpenAIBaseModel.__log_extra_fields__`` validator, or None if that
    seam moved (the checks run once per process, as ``lean_holds`` reads them)."""
    if any(name == "delta models' extra-field logger" for name, _ in _moved_once()):
        return None
    return inspect.unwrap(_find(EXTRA_FIELD_LOGGER)).__func__


# -- the Messages request (endpoints/messages/) ---------------------------------------------------
@_seam(
    "messages inline system",
    "vllm.entrypoints.anthropic.serving:AnthropicServingMessages.__init__",
    "_merge_inline_system, which to_chat_completion_request takes from the serving object",
)
def _check_merge_inline_system() -> None:
    _sets("messages inline system", _code(SEAMS["messages inline system"].where), "_merge_inline_system")
    _parameters(
        "messages inline system",
        "vllm.entrypoints.anthropic.serving:AnthropicServingMessages.to_chat_completion_request",
        ("anthropic_request", "merge_inline_system"),
    )


def merge_inline_system(serving_messages: Any) -> Any:
    return serving_messages._merge_inline_system


# -- the Responses loop (endpoints/responses/lean.py) ----------------------------------------------------
RESPONSES = "vllm.entrypoints.openai.responses.serving:OpenAIServingResponses"
SIMPLE_LOOP = f"{RESPONSES}._process_simple_streaming_events"
# The sha256 of vLLM 0.33.0's source of the loop that ``lean_serving_class`` copies.
SIMPLE_LOOP_SOURCE = "79ceb6536458d3646226e6b9204f1913bbf96bffd245f61d649c6940fe89311b"


@_seam(
    "responses simple loop",
    SIMPLE_LOOP,
    "the lean path overrides it with a copy of it (endpoints/responses/lean.py, lean_serving_class) that "
    "builds the loop's objects itself and lends them to the session; its arguments (the numbering "
    "function among them) are what responses_stream_generator passes",
)
def _check_simple_loop() -> None:
    _parameters(
        "responses simple loop",
        SIMPLE_LOOP,
        (
            "request",
            "sampling_params",
            "result_generator",
            "context",
            "model_name",
            "tokenizer",
            "request_metadata",
            "created_time",
            "_increment_sequence_number_and_return",
        ),
    )
    _same_source("responses simple loop", SIMPLE_LOOP, SIMPLE_LOOP_SOURCE)
    _sets("responses simple loop", _code(f"{RESPONSES}.responses_stream_generator"), "_process_simple_streaming_events")


@_seam(
    "responses errors and logprobs",
    f"{RESPONSES}._raise_if_error",
    "the loop's two calls on the serving object: _raise_if_error (an engine error) and "
    "_create_response_logprobs (an output's logprobs)",
)
def _check_responses_helpers() -> None:
    _parameters("responses errors and logprobs", f"{RESPONSES}._raise_if_error", ("finish_reason", "request_id"))
    _parameters(
        "responses errors and logprobs",
        f"{RESPONSES}._create_response_logprobs",
        ("token_ids", "logprobs", "tokenizer", "top_logprobs"),
    )


def raise_if_error(serving: Any, finish_reason: str | None, request_id: str) -> None:
    serving._raise_if_error(finish_reason, request_id)


def response_logprobs(serving: Any, **kwargs: Any) -> Any:
    return serving._create_response_logprobs(**kwargs)


@_seam(
    "responses event states",
    "vllm.entrypoints.openai.responses.streaming_events:_StateType",
    "the event processor's states (NONE, REASONING, CONTENT, TOOL_CALL), which the loop body compares",
)
def _check_state_type() -> None:
    states = _find(SEAMS["responses event states"].where)
    for name in ("NONE", "REASONING", "CONTENT", "TOOL_CALL"):
        getattr(states, name)


def responses_state_type() -> Any:
    from vllm.entrypoints.openai.responses import streaming_events

    return streaming_events._StateType


# -- private methods called -------------------------------------------------------------------------
@_seam(
    "chat template kwargs",
    "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat._effective_chat_template_kwargs",
    "a chat request's chat-template kwargs as the serving object merges them (the parsers take them)",
)
def _check_template_kwargs() -> None:
    _parameters("chat template kwargs", SEAMS["chat template kwargs"].where, ("request",))


def effective_chat_template_kwargs(serving_chat: Any, request: Any) -> dict[str, Any]:
    return serving_chat._effective_chat_template_kwargs(request)


@_seam(
    "chat parser",
    "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat._make_parser",
    "the reasoning / tool parser of a chat request, built as the serving object builds it",
)
def _check_make_parser() -> None:
    _parameters("chat parser", SEAMS["chat parser"].where, ("request", "tokenizer", "chat_template_kwargs"))


def make_parser(serving_chat: Any, request: Any, tokenizer: Any, chat_template_kwargs: Any) -> Any:
    return serving_chat._make_parser(request, tokenizer, chat_template_kwargs)


@_seam(
    "completion prompt text",
    "vllm.entrypoints.serve.engine.serving:BaseServing._extract_prompt_text",
    "the prompt text a non-streaming completion echoes",
)
def _check_prompt_text() -> None:
    _parameters("completion prompt text", SEAMS["completion prompt text"].where, ("prompt",))


def extract_prompt_text(serving: Any, engine_input: Any) -> Any:
    return serving._extract_prompt_text(engine_input)


@_seam(
    "multimodal features",
    "vllm.entrypoints.scale_out.render.serving:ServingRender._extract_mm_features",
    "a rendered prompt's images as the generate wire carries them; wrapped to refuse sparse placeholders",
)
def _check_mm_features() -> None:
    _parameters("multimodal features", SEAMS["multimodal features"].where, ("engine_input", "mm_payload"))


def extract_mm_features(serving_render: Any, engine_input: Any, **kwargs: Any) -> Any:
    return serving_render._extract_mm_features(engine_input, **kwargs)


def wrap_mm_features(serving_render: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """``serving_render``'s feature extraction becomes ``wrap(its own)``."""
    serving_render._extract_mm_features = wrap(serving_render._extract_mm_features)


# -- replaced or read inside vLLM's objects -------------------------------------------------------------
@_seam(
    "parser drop table",
    "vllm.parser.engine.streaming_parser_engine:_build_drop_info",
    "the streaming parser engine's drop table, built once per (config, tokenizer) on the lean path",
)
def _check_drop_info() -> None:
    _parameters("parser drop table", SEAMS["parser drop table"].where, ("config", "tokenizer"))


def parser_drop_table_builder() -> Any:
    from vllm.parser.engine import streaming_parser_engine as engine

    return engine._build_drop_info


def set_parser_drop_table_builder(build: Callable[..., Any]) -> None:
    from vllm.parser.engine import streaming_parser_engine as engine

    engine._build_drop_info = build


RENDERER = "vllm.renderers.base:BaseRenderer"


@_seam(
    "renderer tokenization",
    RENDERER,
    "a text prompt's tokenization (_tokenize_prompt, its async twin on _executor, _wants_offsets, "
    "_build_tokens_prompt), replaced to tokenize long prompts in pieces",
)
def _check_renderer() -> None:
    _parameters("renderer tokenization", f"{RENDERER}._tokenize_prompt", ("prompt", "params"))
    _parameters("renderer tokenization", f"{RENDERER}._wants_offsets", ("prompt", "params"))
    _parameters("renderer tokenization", f"{RENDERER}._build_tokens_prompt", ("token_ids", "prompt", "offset_mapping"))
    for name in ("_executor", "_tokenize_prompt_async"):  # set in __init__: the async twin runs on the executor
        _sets("renderer tokenization", _code(f"{RENDERER}.__init__"), name)


def renderer_tokenize_prompt(renderer: Any) -> Callable[[Any, Any], Any]:
    return renderer._tokenize_prompt


def renderer_wants_offsets(renderer: Any, prompt: Any, params: Any) -> bool:
    return renderer._wants_offsets(prompt, params)


def renderer_tokens_prompt(renderer: Any, ids: list[int], prompt: Any) -> Any:
    return renderer._build_tokens_prompt(ids, prompt, offset_mapping=None)


def set_renderer_tokenize_prompt(renderer: Any, tokenize_prompt: Callable[[Any, Any], Any]) -> None:
    from vllm.utils.async_utils import make_async

    renderer._tokenize_prompt = tokenize_prompt
    renderer._tokenize_prompt_async = make_async(tokenize_prompt, executor=renderer._executor)


def raw_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` inside vLLM's Hugging Face tokenizer wrapper."""
    return tokenizer._tokenizer


@_seam(
    "processor-only image cache",
    f"{RENDERER}.__init__",
    "the renderer's sender-side image cache (_mm_processor_cache) swapped for its processor-only one",
)
def _check_mm_cache() -> None:
    init = _code(f"{RENDERER}.__init__")
    for name in ("_mm_processor_cache", "_mm_processor_only_cache"):
        _sets("processor-only image cache", init, name)


def render_through_processor_only_cache(renderer: Any) -> None:
    renderer._mm_processor_cache = renderer._mm_processor_only_cache


@_seam(
    "media file URLs",
    "vllm.multimodal.media.connector:MediaConnector._load_file_url",
    "file:// image loading, wrapped so a forbidden path is the client's 400",
)
def _check_file_url() -> None:
    _parameters("media file URLs", SEAMS["media file URLs"].where, ("url_spec", "media_io"))


def media_file_loader() -> Callable[..., Any]:
    from vllm.multimodal.media.connector import MediaConnector

    return MediaConnector._load_file_url


def set_media_file_loader(load: Callable[..., Any]) -> None:
    from vllm.multimodal.media.connector import MediaConnector

    MediaConnector._load_file_url = load  # type: ignore[method-assign]


@_seam(
    "media HTTP client",
    "vllm.connections:HTTPConnection.get_async_client",
    "the aiohttp session image URLs are fetched with (_async_client), made with a guarded connector",
)
def _check_http_client() -> None:
    _sets("media HTTP client", _code(SEAMS["media HTTP client"].where), "_async_client")


def http_client(connection: Any) -> Any:
    return connection._async_client


def set_http_client(connection: Any, client: Any) -> None:
    connection._async_client = client


@_seam(
    "model registry",
    "vllm.model_executor.models.registry:_LazyRegisteredModel",
    "a model's architecture loaded in this process (_RegisteredModel.from_model_cls) so it is inspected here",
)
def _check_registry() -> None:
    _find("vllm.model_executor.models.registry:_LazyRegisteredModel.load_model_cls")
    _find("vllm.model_executor.models.registry:_RegisteredModel.from_model_cls")


def register_in_process(arch: str) -> None:
    """Load architecture ``arch`` in this process if vLLM registered it lazily."""
    from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel, _RegisteredModel

    registered = ModelRegistry.models.get(arch)
    if isinstance(registered, _LazyRegisteredModel):
        ModelRegistry.models[arch] = _RegisteredModel.from_model_cls(registered.load_model_cls())


@_seam(
    "stop strings error",
    "vllm.entrypoints.scale_out.derender.serving:_STREAM_STOP_STRINGS_ERROR",
    "the render tier's refusal of stop strings on streams, answered before the tier is asked",
)
def _check_stop_strings() -> None:
    if not isinstance(_find(SEAMS["stop strings error"].where), str):
        raise SeamChanged("stop strings error", "not a string")


def stream_stop_strings_error() -> str:
    from vllm.entrypoints.scale_out.derender.serving import _STREAM_STOP_STRINGS_ERROR

    return _STREAM_STOP_STRINGS_ERROR
