"""A toggle for ``bench/inproc_ab.py``: Responses' lean loop body deciding a delta inside the open
item in place (``LoopBody._within``) against running the body's lines for it.

    .venv/bin/python bench/inproc_ab.py --api responses --toggle bench/toggles/responses_within.py

``off()`` makes ``_within`` decline every delta, so each goes through the body's lines
(``maybe_filter_parallel_tool_calls``, ``split_delta``, ``resolve_target_state``,
``needs_transition``, then the template), as before it; ``on()`` puts the method back.
"""

from __future__ import annotations

from typing import Any

_ORIGINAL: Any = None


def _decline(self: Any, dm: Any, output: Any, sink: Any) -> bool:
    return False


def on() -> None:
    from derender.endpoints.responses.lean import LoopBody

    if _ORIGINAL is not None:
        LoopBody._within = _ORIGINAL  # type: ignore[method-assign]


def off() -> None:
    global _ORIGINAL
    from derender.endpoints.responses.lean import LoopBody

    if _ORIGINAL is None:
        _ORIGINAL = LoopBody._within
    LoopBody._within = _decline  # type: ignore[method-assign]
