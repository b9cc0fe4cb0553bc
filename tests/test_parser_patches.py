"""The lean path's patches of vLLM's parser modules (``parser_tables.patch_parsers``) give what vLLM's
own objects give: ``CompiledRegex`` what ``regex`` gives, for the patterns those modules pass and any
text; ``is_complete_json`` what vLLM's gives, for any prefix of any JSON text and any other text. The
stream-level proof is ``test_lean.py`` (the lean path patched against vLLM's path unpatched)."""

from __future__ import annotations

import inspect
import json
import re as stdlib_re
import sys

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from derender.translate import parser_tables

# Text near what the parsers see: tool-call JSON, markup, any character.
PIECES = st.sampled_from(['"name"', '"arguments"', ":", " ", "\n", "{", "}", '"', "get_weather", "<tool_call>",
                          "</tool_call>", "<think>", "é", "東京", "🤖", "\\", ",", "[", "]", "a", "0"])
TEXT = st.one_of(st.lists(PIECES, max_size=30).map("".join), st.text(max_size=40))


def _parser_patterns() -> list[str]:
    """The literal patterns vLLM's loaded parser modules pass to ``re.search/match/fullmatch/findall``."""
    call = stdlib_re.compile(r"""\bre\.(?:search|match|fullmatch|findall)\(\s*r?(['"])(.+?)\1\s*,""")
    found = set()
    for name, module in list(sys.modules.items()):
        if name.startswith(parser_tables.PARSER_MODULES) and getattr(module, "re", None) is not None:
            try:
                source = inspect.getsource(module)
            except (OSError, TypeError):
                continue
            for m in call.finditer(source):
                try:
                    found.add(eval("r" + m.group(1) + m.group(2) + m.group(1)))  # noqa: S307 (a literal)
                except SyntaxError:
                    continue
    return sorted(found)


@pytest.fixture(scope="module")
def patterns() -> list[str]:
    import vllm.parser.qwen3  # noqa: F401  the shipped parsers' modules
    import vllm.tool_parsers.hermes_tool_parser  # noqa: F401

    found = _parser_patterns()
    assert r'"arguments"\s*:\s*' in found and r'"name"\s*:\s*"([^"]+)"' in found, found  # Hermes's, per token
    return found


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, list):
        return a == b
    return (a.span(), a.groups(), a.group(0)) == (b.span(), b.groups(), b.group(0))


def test_compiled_calls_equal_regex(patterns):
    compiled = parser_tables.CompiledRegex(regex)

    @settings(max_examples=300, deadline=None)
    @given(st.sampled_from(patterns), TEXT, st.sampled_from([0, regex.DOTALL, regex.IGNORECASE]))
    def check(pattern, text, flags):
        for name in ("search", "match", "fullmatch", "findall"):
            assert _same(getattr(compiled, name)(pattern, text, flags), getattr(regex, name)(pattern, text, flags)), name
        # extra arguments go to regex as they are
        assert _same(compiled.search(pattern, text, flags, 1), regex.search(pattern, text, flags, 1))

    check()
    assert compiled.DOTALL is regex.DOTALL and compiled.escape is regex.escape  # the rest is regex's own
    assert compiled._compiled  # the calls went through the held patterns


def test_held_patterns_are_bounded():
    compiled = parser_tables.CompiledRegex(regex)
    for i in range(parser_tables.MAX_PATTERNS + 50):
        assert compiled.search(f"x{i}", f"ax{i}").span() == (1, 2 + len(str(i)))
    assert len(compiled._compiled) == parser_tables.MAX_PATTERNS


def _restore(patched: list[str]) -> None:
    """What ``patch_parsers`` patched (its names), as it was."""
    from vllm.tool_parsers import utils

    vllms = {"re": regex, "is_complete_json": utils.is_complete_json}
    validators = {f"{cls.__module__}.{cls.__name__}": theirs for cls, theirs, _ in parser_tables._model_swaps()}
    for dotted in patched:
        owner, name = dotted.rsplit(".", 1)
        if name == "__pydantic_validator__":
            module, cls = owner.rsplit(".", 1)
            setattr(getattr(sys.modules[module], cls), name, validators[owner])
        else:
            setattr(sys.modules[owner], name, vllms[name])


def test_unpatched_gives_the_modules_vllms_objects_back():
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.tool_parsers import hermes_tool_parser as hermes
    from vllm.tool_parsers import utils

    (_, vllms_validator, ours), _ = parser_tables._model_swaps()
    patched = parser_tables.patch_parsers()  # none if a lean model in this process did it before
    try:
        assert isinstance(hermes.re, parser_tables.CompiledRegex)
        assert hermes.is_complete_json is parser_tables.is_complete_json
        assert utils.is_complete_json is not parser_tables.is_complete_json  # vLLM's own module keeps its own
        assert DeltaMessage.__pydantic_validator__ is ours
        with parser_tables.unpatched():
            assert hermes.re is regex and hermes.is_complete_json is utils.is_complete_json
            assert DeltaMessage.__pydantic_validator__ is vllms_validator
        assert isinstance(hermes.re, parser_tables.CompiledRegex)
        assert hermes.is_complete_json is parser_tables.is_complete_json
        assert DeltaMessage.__pydantic_validator__ is ours
    finally:
        _restore(patched)


def _json_values():
    scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                       st.text(alphabet=st.sampled_from('ab "\\{}[]:,é東🤖\n\t'), max_size=8))
    return st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                        max_leaves=12)


def _outcome(fn, text):
    try:
        return fn(text)
    except Exception as exc:  # noqa: BLE001  both must fail alike
        return type(exc)


def test_is_complete_json_answers_as_vllms():
    """Over every prefix of JSON texts as a model writes them (Hermes's growing tool call), JSON's
    edge cases, whitespace around them and any text: the same answer as vLLM's, and the quick no
    answered some of them (so the test compares two functions)."""
    from vllm.tool_parsers.utils import is_complete_json as vllms

    quick = []

    @settings(max_examples=400, deadline=None)
    @given(_json_values(), st.sampled_from([None, 1, 2]), st.sampled_from([(", ", ": "), (",", ":")]),
           st.sampled_from(["", " ", "\n", " \t\r\n", "\u00a0", "x"]), st.text(max_size=12))
    def check(value, indent, separators, tail, noise):
        text = json.dumps(value, indent=indent, separators=separators, ensure_ascii=False)
        texts = [text[:i] for i in range(len(text) + 1)] + [text + tail, tail + text, noise, text + noise]
        for t in texts:
            assert _outcome(parser_tables.is_complete_json, t) == _outcome(vllms, t), repr(t)
            quick.append(not t.rstrip(" \t\n\r") or t.rstrip(" \t\n\r")[-1] not in parser_tables._JSON_ENDS)

    check()
    for t in ['{"a": NaN}', "-Infinity", "[" * 300 + "]" * 300, "[" * 5000 + "1,", "[" * 5000, '"\ud800"', "\ufeff{}",
              b"{}", 12, None]:
        assert _outcome(parser_tables.is_complete_json, t) == _outcome(vllms, t), repr(t)[:40]
    assert any(quick) and not all(quick)


def _delta_kwargs():
    """Keyword arguments of ``DeltaMessage`` as the parsers pass them, and some no parser passes:
    tool calls as models or dicts, a field beyond the model's (it allows extras), a wrong type."""
    from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaToolCall

    text = st.one_of(st.none(), st.text(max_size=6))
    function = st.one_of(st.none(), st.builds(DeltaFunctionCall, name=text, arguments=text),
                         st.fixed_dictionaries({}, optional={"name": text, "arguments": text}))
    call = st.one_of(
        st.builds(DeltaToolCall, index=st.integers(0, 3), id=text, function=function),
        st.fixed_dictionaries({"index": st.one_of(st.integers(0, 3), st.just("x"))},
                              optional={"id": text, "type": st.sampled_from(["function", None]), "function": function,
                                        "extra": st.integers()}),
    )
    return st.fixed_dictionaries({}, optional={"role": st.sampled_from(["assistant", None]), "content": text,
                                               "reasoning": text, "tool_calls": st.lists(call, max_size=2),
                                               "unknown": st.integers(), "content ": st.just(3)})


def _built(cls, kwargs):
    try:
        model = cls(**kwargs)
    except Exception as exc:  # noqa: BLE001  both must refuse alike
        return type(exc), str(exc).split("\n")[0]
    return (model.model_dump_json(exclude_unset=True), model.model_dump_json(), sorted(model.model_fields_set),
            model.__pydantic_extra__, repr(model))


def test_delta_models_without_the_extra_field_logger_validate_as_vllms():
    """``DeltaMessage`` and ``DeltaToolCall`` on the lean path's validator (vLLM's schema less its
    ``__log_extra_fields__`` wrapper, nested ones too) build what vLLM's build from any keyword
    arguments: the same fields set, extras, values and serialization, the same refusals; and the
    wrapper is gone from both (so the test compares two validators)."""
    from vllm.entrypoints.generate.base.protocol import DeltaMessage, DeltaToolCall

    swaps = parser_tables._model_swaps()
    assert [cls for cls, _, _ in swaps] == [DeltaMessage, DeltaToolCall]
    for cls, theirs, ours in swaps:
        assert ours is not theirs
        assert "__log_extra_fields__" not in repr(ours) and "__log_extra_fields__" in repr(theirs)
    patched = parser_tables.patch_parsers()  # none if a lean model in this process did it before
    try:
        assert DeltaMessage.__pydantic_validator__ is swaps[0][2]

        @settings(max_examples=400, deadline=None)
        @given(_delta_kwargs())
        def check(kwargs):
            ours = _built(DeltaMessage, kwargs)
            with parser_tables.unpatched():
                assert DeltaMessage.__pydantic_validator__ is swaps[0][1]
                theirs = _built(DeltaMessage, kwargs)
            assert ours == theirs, kwargs
            for call in kwargs.get("tool_calls", ()):
                if isinstance(call, dict):
                    ours = _built(DeltaToolCall, call)
                    with parser_tables.unpatched():
                        assert ours == _built(DeltaToolCall, call), call

        check()
    finally:
        _restore(patched)


def test_a_moved_extra_field_logger_leaves_the_delta_models_vllms():
    """If the installed vLLM's ``__log_extra_fields__`` is not the one read (its source's digest), the
    seam says so and the delta models keep vLLM's validator: nothing to swap."""
    import subprocess

    code = (
        "from derender.translate import parser_tables, vllm_seams\n"
        "print(len(parser_tables._model_swaps()))\n"
        "vllm_seams.EXTRA_FIELD_LOGGER_SOURCE = '0' * 64\n"
        "vllm_seams._moved_once.cache_clear()\n"
        "parser_tables._model_validators = None\n"
        "print(len(parser_tables._model_swaps()), 'delta models\\' extra-field logger' in vllm_seams.moved())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-3:-1] == ["2", "0 True"], out.stdout
