"""The vLLM functions the filter runs its own copies of, and their originals kept beside them.

Two lean paths run a copy of a vLLM 0.33.0 loop (``vllm_seams``' "chat stream generator" and
"responses simple loop"). Each copy's original is kept in ``vllm_originals/`` as vLLM's text, and the
whole difference from the original to the copy in a ``.diff`` there: so after an upgrade one can see
what vLLM changed in the original (``installed_diff``) and what the filter changed in its copy
(``edits``), and ``tests/test_vllm_seams.py`` holds both to the kept files. ``derender seams``
(``make seams``) prints them.
"""

from __future__ import annotations

import difflib
import hashlib
import textwrap
from dataclasses import dataclass
from pathlib import Path

from . import vllm_seams

ORIGINALS = Path(__file__).resolve().parent / "vllm_originals"


@dataclass(frozen=True)
class Copy:
    seam: str  # the seam in ``vllm_seams`` that pins it
    where: str  # vLLM's function (module:qualified name)
    original: str  # its text in ``vllm_originals/``
    copy: str  # the filter's copy, for the reader
    edits: str  # the diff original -> copy in ``vllm_originals/``
    sha256: str  # the original's digest, as ``vllm_seams`` pins it


COPIES: dict[str, Copy] = {
    copy.seam: copy
    for copy in (
        Copy(
            "chat stream generator",
            vllm_seams.CHAT_GENERATOR,
            "chat_completion_stream_generator_raw.txt",
            "derender.translate.chat_loop:chat_stream",
            "chat_stream.diff",
            vllm_seams.CHAT_GENERATOR_SOURCE,
        ),
        Copy(
            "responses simple loop",
            vllm_seams.SIMPLE_LOOP,
            "_process_simple_streaming_events.txt",
            "derender.endpoints.responses.lean:lean_serving_class (LeanServingResponses)",
            "responses_simple_loop.diff",
            vllm_seams.SIMPLE_LOOP_SOURCE,
        ),
    )
}


def kept(copy: Copy) -> str:
    """The original as kept (vLLM 0.33.0's text)."""
    return (ORIGINALS / copy.original).read_text()


def installed(copy: Copy) -> str:
    """The original's source in the installed vLLM."""
    return vllm_seams.source(copy.where)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def diff(before: str, after: str, before_name: str, after_name: str) -> str:
    """A unified diff of two sources, each dedented first."""
    return "".join(
        difflib.unified_diff(
            textwrap.dedent(before).splitlines(keepends=True),
            textwrap.dedent(after).splitlines(keepends=True),
            before_name,
            after_name,
            n=2,
        )
    )


def installed_diff(copy: Copy) -> str:
    """What the installed vLLM changed in the original ("" if nothing)."""
    return diff(kept(copy), installed(copy), f"vllm {vllm_seams.VLLM}: {copy.where}", f"installed: {copy.where}")


def edits(copy: Copy, copy_source: str) -> str:
    """The difference from the kept original to the copy's source ``copy_source``."""
    return diff(kept(copy), copy_source, f"vllm {vllm_seams.VLLM}: {copy.where}", f"derender: {copy.copy}")


def kept_edits(copy: Copy) -> str:
    return (ORIGINALS / copy.edits).read_text()


def report(copy_sources: dict[str, str]) -> tuple[list[str], bool]:
    """One line per seam (holds, or how it moved), and for a copied function whose installed original
    or whose copy is not the kept one, the diff to read; and whether everything holds.
    ``copy_sources``: each copy's source now."""
    moved = vllm_seams.moved()
    edited = False
    lines = []
    for name, seam in vllm_seams.SEAMS.items():
        lines.append(f"{'MOVED' if name in moved else 'holds'}  {name}  ({seam.where})")
        if name in moved:
            lines.append(f"       {moved[name]}")
        copy = COPIES.get(name)
        if copy is None:
            continue
        changed = installed_diff(copy)
        if changed:
            lines.append(f"       the installed original differs from the kept one ({copy.original}):")
            lines += ["       " + line for line in changed.splitlines()]
        source = copy_sources.get(name)
        if source is not None and edits(copy, source) != kept_edits(copy):
            edited = True
            lines.append(f"       the copy ({copy.copy}) is not the kept original with {copy.edits}'s edits")
    return lines, not moved and not edited
