"""``parser_tables.CompiledRegex``: vLLM's parser modules' ``regex`` calls served from compiled
patterns give what ``regex`` gives, for the patterns those modules pass and any text; the stream-level
proof is ``test_lean.py`` (the lean path patched against vLLM's path on ``regex`` itself)."""

from __future__ import annotations

import inspect
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


def test_unpatched_regex_gives_the_modules_regex_back():
    from vllm.tool_parsers import hermes_tool_parser as hermes

    patched = parser_tables.memoize_regex()  # none if a lean model in this process did it before
    try:
        assert isinstance(hermes.re, parser_tables.CompiledRegex)
        with parser_tables.unpatched_regex():
            assert hermes.re is regex
        assert isinstance(hermes.re, parser_tables.CompiledRegex)
    finally:
        for name in patched:  # as it was
            sys.modules[name].re = regex
