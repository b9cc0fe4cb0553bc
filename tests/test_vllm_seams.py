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


def test_a_changed_chat_generator_names_its_seam(monkeypatch):
    """The lean chat path runs the filter's copy of vLLM 0.33.0's chat stream generator
    (``translate/chat_loop.py``): a vLLM whose generator is another is caught by the check, by name."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    original = OpenAIServingChat.chat_completion_stream_generator_raw

    async def generator_raw(self, *args, **kwargs):
        async for chunk in original(self, *args, **kwargs):
            yield chunk

    monkeypatch.setattr(OpenAIServingChat, "chat_completion_stream_generator_raw", generator_raw)
    problems = vllm_seams.check()
    assert len(problems) == 1 and "'chat stream generator'" in problems[0] and "source" in problems[0]
    # The copy may no longer do what this vLLM does: the lean path is off, every stream vLLM's.
    from derender.translate.model import _lean
    from derender.settings import Settings

    vllm_seams._moved_once.cache_clear()
    try:
        assert not vllm_seams.lean_holds()
        assert not _lean(Settings(stream_path="lean"))
    finally:
        vllm_seams._moved_once.cache_clear()
    monkeypatch.undo()
    assert vllm_seams.lean_holds() and _lean(Settings(stream_path="lean"))


def test_a_changed_responses_loop_names_its_seam(monkeypatch):
    """The lean Responses path runs the filter's copy of vLLM 0.33.0's simple streaming loop: a vLLM
    whose loop is not that one (same arguments, other lines) is caught by the check, by name."""
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    original = OpenAIServingResponses._process_simple_streaming_events

    async def loop(self, request, sampling_params, result_generator, context, model_name, tokenizer,
                   request_metadata, created_time, _increment_sequence_number_and_return):
        async for event in original(self, request, sampling_params, result_generator, context, model_name,
                                    tokenizer, request_metadata, created_time, _increment_sequence_number_and_return):
            yield event

    monkeypatch.setattr(OpenAIServingResponses, "_process_simple_streaming_events", loop)
    problems = vllm_seams.check()
    assert len(problems) == 1 and "'responses simple loop'" in problems[0] and "source" in problems[0]


def test_the_lean_responses_loop_is_vllms_but_for_its_body():
    """The filter's loop (``lean_serving_class``) overrides only the simple streaming loop, and takes
    the arguments vLLM's generator passes it."""
    import inspect

    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    from derender.endpoints.responses.lean import lean_serving_class

    cls = lean_serving_class(lambda request_id, body: None)
    assert issubclass(cls, OpenAIServingResponses)
    assert [name for name in vars(cls) if callable(vars(cls)[name])] == ["_process_simple_streaming_events"]
    ours = inspect.signature(cls._process_simple_streaming_events).parameters
    assert list(ours) == list(inspect.signature(OpenAIServingResponses._process_simple_streaming_events).parameters)
