"""The lean path's vLLM patches, all on its output parsers: the streaming parser engine's drop
tables built once per (config, tokenizer) and shared (``memoize``); the parsers' module-level
``regex`` calls served from compiled patterns and a quick no from ``is_complete_json`` where
``json.loads`` cannot take the text, and the parsers' delta models validated without vLLM's
extra-field logger (``patch_parsers``). Installed by a ``Model`` on the lean stream path; a process
that serves only ``--stream-path vllm`` never patches vLLM.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

# The same guard as the event decoder's: a text with fewer brackets is far from the recursion limit.
from .eventjson import MAX_OPENERS


def memoize() -> None:
    """vLLM's streaming parser engine, built for every parser object (three per chat request: the
    render's, the filter's early one and the generator's), rebuilds from the tokenizer's special
    tokens the same drop table each time: a regex per special token (``regex.escape`` ~0.1 ms
    each) and a ``LexerShape``, which vLLM documents as immutable and shares. Built once per
    (engine config, tokenizer) here -- vLLM caches its configs, so they are the same objects --
    and shared, as vLLM shares the config's own shape.
    ``tests/test_lean.py`` checks the shared table equals a fresh one for every shipped parser."""
    from . import vllm_seams

    build = vllm_seams.parser_drop_table_builder()
    if getattr(build, "derender_memo", False):
        return
    tables: dict[tuple[int, int], tuple[Any, Any, Any]] = {}

    def drop_info(config: Any, tokenizer: Any) -> Any:
        key = (id(config), id(tokenizer))
        hit = tables.get(key)
        if hit is None or hit[0] is not config or hit[1] is not tokenizer:
            hit = tables[key] = (config, tokenizer, build(config, tokenizer))  # the pair kept: ids stay theirs
        return hit[2]

    drop_info.derender_memo = True  # type: ignore[attr-defined]
    drop_info.built = build  # type: ignore[attr-defined]
    drop_info.tables = tables  # type: ignore[attr-defined]
    vllm_seams.set_parser_drop_table_builder(drop_info)


# Where vLLM's output parsers live: their modules call ``regex.search(pattern, text)`` per token.
PARSER_MODULES = ("vllm.tool_parsers.", "vllm.reasoning.", "vllm.parser.")
MAX_PATTERNS = 256  # patterns held per process; past that, calls go to ``regex`` as they are


def _served(name: str) -> Any:
    """``regex.<name>(pattern, string, flags)`` run by the compiled pattern's own ``<name>(string)``."""

    def call(self: CompiledRegex, pattern: Any, string: Any, flags: int = 0, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return getattr(self.module, name)(pattern, string, flags, *args, **kwargs)
        return getattr(self._pattern(pattern, flags), name)(string)

    call.__name__ = name
    return call


class CompiledRegex:
    """The ``regex`` module as a parser module sees it, its pattern-taking calls served from the
    pattern compiled once. ``regex.search(p, s)`` compiles through ``regex._compile`` on every call,
    a cache lookup in Python with enum flag arithmetic (~4 us; Hermes calls it twice per token
    of a tool call), and then runs the compiled pattern's ``search(s)``; this runs the same compiled
    pattern (``regex.compile(p, flags)`` is what ``_compile`` returns), so the match is the same.
    Calls with arguments past (pattern, string, flags) go to ``regex`` itself."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self._compiled: dict[tuple[type, Any, int], Any] = {}

    def __getattr__(self, name: str) -> Any:  # everything else: ``regex``'s own (compile, escape, DOTALL ...)
        return getattr(self.module, name)

    def _pattern(self, pattern: Any, flags: int) -> Any:
        key = (type(pattern), pattern, flags)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.module.compile(pattern, flags)
            if len(self._compiled) < MAX_PATTERNS:
                self._compiled[key] = compiled
        return compiled

    search = _served("search")
    match = _served("match")
    fullmatch = _served("fullmatch")
    findall = _served("findall")


# What a JSON text's last character can be, past trailing whitespace: the end of an object, an
# array, a string, a number, true / false, null, NaN or (-)Infinity (which ``json.loads`` accepts).
_JSON_ENDS = frozenset('}]"0123456789elNy')


def is_complete_json(input_str: Any) -> bool:
    """vLLM's ``tool_parsers.utils.is_complete_json`` (whether ``json.loads`` takes the text), with
    a quick no for a text whose last character cannot end a JSON value -- Hermes asks it of a tool
    call's growing arguments on every token, and ``json.loads`` builds a ``JSONDecodeError`` to say
    no. Any other text (and one nested deep enough to meet the recursion limit) goes to vLLM's."""
    if type(input_str) is str and input_str.count("[") + input_str.count("{") <= MAX_OPENERS:
        end = input_str.rstrip(" \t\n\r")
        if not end or end[-1] not in _JSON_ENDS:
            return False
    return _vllm_check(input_str)


def _first_vllm_check(input_str: Any) -> bool:
    """vLLM's ``is_complete_json``, looked up on the first call and called directly after it."""
    global _vllm_check
    from vllm.tool_parsers import utils

    _vllm_check = utils.is_complete_json
    return _vllm_check(input_str)


_vllm_check: Callable[[Any], bool] = _first_vllm_check


def _swaps() -> list[tuple[str, Any, Any]]:
    """(a parser module's global, vLLM's object, the lean path's)."""
    global _compiled
    import regex  # type: ignore[import-untyped]
    from vllm.tool_parsers import utils

    if _compiled is None:
        _compiled = CompiledRegex(regex)
    return [("re", regex, _compiled), ("is_complete_json", utils.is_complete_json, is_complete_json)]


_compiled: CompiledRegex | None = None  # the one every patched module shares
DEFINING = "vllm.tool_parsers.utils"  # where is_complete_json is vLLM's own: never patched


def _parser_modules() -> list[Any]:
    return [m for name, m in list(sys.modules.items()) if name.startswith(PARSER_MODULES) and name != DEFINING]


# The models vLLM's output parsers build per token (one or two a token, ``DeltaToolCall`` inside
# ``DeltaMessage`` for a tool call's), as ``module:class``.
DELTA_MODELS = (
    "vllm.entrypoints.generate.base.protocol:DeltaMessage",
    "vllm.entrypoints.generate.base.protocol:DeltaToolCall",
)


def _without_extra_field_log(schema: Any, logger: Any) -> Any:
    """``schema`` (a pydantic core schema) without its ``function-wrap`` nodes that call ``logger``,
    each replaced by the schema it wraps (which keeps the wrapper's ``ref``)."""
    if isinstance(schema, list):
        return [_without_extra_field_log(item, logger) for item in schema]
    if not isinstance(schema, dict):
        return schema
    function = schema.get("function")
    if (
        schema.get("type") == "function-wrap"
        and isinstance(function, dict)
        and getattr(function.get("function"), "__func__", None) is logger
    ):
        inner = dict(_without_extra_field_log(schema["schema"], logger))
        if "ref" in schema:
            inner.setdefault("ref", schema["ref"])
        return inner
    return {key: _without_extra_field_log(value, logger) for key, value in schema.items()}


def _model_swaps() -> list[tuple[Any, Any, Any]]:
    """(a delta model, vLLM's validator, the lean path's). vLLM's ``OpenAIBaseModel`` wraps every
    model's validation in ``__log_extra_fields__``, a Python call that logs the fields a client's
    request named beyond the model's (a debug line) and changes nothing; about 0.7 us of the 1.8 a
    ``DeltaMessage`` costs. The parsers pass their fields by name, never one beyond the model's, so
    the lean path validates these models with the same schema less that wrapper."""
    global _model_validators
    if _model_validators is None:
        import importlib

        from pydantic_core import SchemaValidator

        from . import vllm_seams

        logger = vllm_seams.extra_field_logger()
        _model_validators = []
        for where in DELTA_MODELS if logger is not None else ():
            module, name = where.split(":")
            cls = getattr(importlib.import_module(module), name)
            schema = _without_extra_field_log(cls.__pydantic_core_schema__, logger)
            _model_validators.append((cls, cls.__pydantic_validator__, SchemaValidator(schema)))
    return _model_validators


_model_validators: list[tuple[Any, Any, Any]] | None = None


def patch_parsers() -> list[str]:
    """Every loaded parser module that calls ``regex`` through a module global ``re`` gets a
    ``CompiledRegex`` instead, and every one that imported ``is_complete_json`` gets the one above
    (the modules of the parsers a model has built are loaded by then); the delta models their
    validator without the extra-field logger (``_model_swaps``). What was patched now, as
    ``module.global`` names. ``tests/test_lean.py`` runs the lean path so patched against vLLM's
    path on vLLM's own objects (``unpatched``) over generated streams."""
    swaps, patched = _swaps(), []
    for module in _parser_modules():
        for name, theirs, ours in swaps:
            if getattr(module, name, None) is theirs:
                setattr(module, name, ours)
                patched.append(f"{module.__name__}.{name}")
    for cls, theirs, ours in _model_swaps():
        if cls.__pydantic_validator__ is theirs:
            cls.__pydantic_validator__ = ours
            patched.append(f"{cls.__module__}.{cls.__name__}.__pydantic_validator__")
    return patched


@contextlib.contextmanager
def unpatched() -> Iterator[None]:
    """vLLM's parser modules with vLLM's own objects while this lasts (the differential tests' vLLM path)."""
    swaps, held = _swaps(), []
    for module in _parser_modules():
        for name, theirs, ours in swaps:
            if getattr(module, name, None) is ours:
                setattr(module, name, theirs)
                held.append((module, name, ours))
    for cls, theirs, ours in _model_swaps():
        if cls.__pydantic_validator__ is ours:
            cls.__pydantic_validator__ = theirs
            held.append((cls, "__pydantic_validator__", ours))
    try:
        yield
    finally:
        for module, name, ours in held:
            setattr(module, name, ours)
