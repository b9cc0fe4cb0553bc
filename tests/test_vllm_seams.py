"""vLLM's non-public surface the filter relies on (``derender.translate.vllm_seams``): every seam holds in
the installed vLLM, and a seam that moves is reported by its name."""

from __future__ import annotations

import importlib.metadata

import pytest

from derender.translate import model  # noqa: F401  (vLLM's environment defaults, before vLLM is imported)
from derender.translate import vllm_seams


def test_every_seam_holds_in_the_installed_vllm():
    assert importlib.metadata.version("vllm") == vllm_seams.VLLM
    assert vllm_seams.check() == []
    for seam in vllm_seams.SEAMS.values():
        assert ":" in seam.where and seam.use, seam.name
        vllm_seams._find(seam.where)  # where it says it was read from exists


def test_a_removed_private_method_names_its_seam(monkeypatch):
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    monkeypatch.delattr(OpenAIServingChat, "_make_parser")
    problems = vllm_seams.check()
    assert len(problems) == 1 and "'chat parser'" in problems[0] and vllm_seams.VLLM in problems[0]


def test_a_renamed_generator_local_names_its_seam(monkeypatch):
    """The chat generator's locals, read from its running frame by the lean path: a vLLM whose generator
    keeps them under other names is caught by the check, and the running read refuses it by name."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    async def generator_raw(self, request, result_generator, request_id, model_name, *args, **kwargs):
        created = 0
        per_choice = []
        yield (created, per_choice, request_id, model_name)

    monkeypatch.setattr(OpenAIServingChat, "chat_completion_stream_generator_raw", generator_raw)
    problems = vllm_seams.check()
    assert len(problems) == 1 and "'chat generator locals'" in problems[0]
    assert "processors" in problems[0] and "created_time" in problems[0]

    async def first():
        raw = generator_raw(None, None, None, "id", "m")
        await raw.__anext__()
        try:
            with pytest.raises(vllm_seams.SeamChanged, match="chat generator locals"):
                vllm_seams.chat_generator_locals(raw)
        finally:
            await raw.aclose()

    import asyncio

    asyncio.run(first())


def test_a_closure_without_its_counter_names_its_seam():
    def numbering(event):
        return event

    with pytest.raises(vllm_seams.SeamChanged, match="responses sequence number"):
        vllm_seams.sequence_number_cell(numbering)

    sequence_number = 7

    def counting(event):
        nonlocal sequence_number
        sequence_number += 1
        return event

    cell = vllm_seams.sequence_number_cell(counting)
    assert [vllm_seams.take_sequence_number(cell) for _ in range(3)] == [7, 8, 9]
    assert sequence_number == 10


def test_frames_other_than_the_simple_loop_are_not_read():
    import sys

    assert vllm_seams.responses_loop_locals(None) is None
    assert vllm_seams.responses_loop_locals(sys._getframe()) is None
