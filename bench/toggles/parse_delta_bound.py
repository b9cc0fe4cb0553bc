"""A toggle for ``bench/inproc_ab.py``: the most any lean parser could save on the lean path.

    .venv/bin/python bench/inproc_ab.py --api chat --toggle bench/toggles/parse_delta_bound.py

``on()`` replaces vLLM's ``DelegatingParser.parse_delta`` with a stand-in that only advances the
parser's stream state and hands the new text back as content: no reasoning split, no tool calls.
Its output is wrong on purpose; what it measures is the parsers' share of a token (setting B
against A), an upper bound for a leaner parser with vLLM's as the fallback. ``off()`` puts vLLM's
method back.
"""

from __future__ import annotations

from typing import Any

_ORIGINAL: Any = None


def _stand_in(self: Any, delta_text: str, delta_token_ids: list[int], request: Any,
              prompt_token_ids: Any = None, *, finished: bool) -> Any:
    from vllm.entrypoints.generate.base.protocol import DeltaMessage

    self._stream_state.advance(delta_text, delta_token_ids)
    return DeltaMessage(content=delta_text)


def on() -> None:
    global _ORIGINAL
    from vllm.parser.abstract_parser import DelegatingParser

    if _ORIGINAL is None:
        _ORIGINAL = DelegatingParser.parse_delta
    DelegatingParser.parse_delta = _stand_in  # type: ignore[method-assign]


def off() -> None:
    from vllm.parser.abstract_parser import DelegatingParser

    if _ORIGINAL is not None:
        DelegatingParser.parse_delta = _ORIGINAL  # type: ignore[method-assign]
