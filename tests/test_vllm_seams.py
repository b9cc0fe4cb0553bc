"""vLLM's non-public surface the filter relies on (``derender.translate.vllm_seams``): every seam holds in
the installed vLLM, and a seam that moves is reported by its name."""

from __future__ import annotations

import importlib.metadata

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


def test_each_copied_vllm_function_is_its_kept_original_with_its_kept_edits():
    """Each copy of a vLLM function (``translate/vllm_originals``): vLLM 0.33.0's text kept beside it is
    the installed vLLM's source and the one the seam's digest pins, and the copy differs from it by
    exactly the kept diff (pruned branches, calls through ``vllm_seams``), nothing unreviewed."""
    from derender.cli import copied_sources
    from derender.translate import vllm_copies

    sources = copied_sources()
    assert set(sources) == set(vllm_copies.COPIES) and set(vllm_copies.COPIES) <= set(vllm_seams.LEAN)
    for name, copy in vllm_copies.COPIES.items():
        assert vllm_copies.kept(copy) == vllm_copies.installed(copy), name
        assert vllm_copies.digest(vllm_copies.kept(copy)) == copy.sha256, name
        edits = vllm_copies.edits(copy, sources[name])
        assert edits == vllm_copies.kept_edits(copy), f"{name}: the copy changed; `derender seams --write-edits`"
        assert edits.startswith("---") and "\n-" in edits and "\n+" in edits


def test_a_copy_edited_beyond_its_kept_diff_is_found():
    from derender.cli import copied_sources
    from derender.translate import vllm_copies

    sources = copied_sources()
    copy = vllm_copies.COPIES["chat stream generator"]
    edited = sources["chat stream generator"].replace("num_choices", "choices_count", 1)
    assert vllm_copies.edits(copy, edited) != vllm_copies.kept_edits(copy)
    lines, holds = vllm_copies.report({**sources, "chat stream generator": edited})
    assert not holds
    assert any("is not the kept original" in line and "chat_loop" in line for line in lines)


def test_make_seams_prints_each_seam_and_the_diff_of_a_moved_copy(monkeypatch, capsys):
    """``make seams`` (``derender seams``): a line per seam saying it holds; on a vLLM whose copied loop
    changed, that seam is MOVED and the diff from the kept original to the installed source follows."""
    from derender import cli

    assert cli.main(["seams"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[1] for line in out] == list(vllm_seams.SEAMS)
    assert all(line.startswith("holds  ") for line in out)

    from derender.translate import vllm_copies

    copy = vllm_copies.COPIES["responses simple loop"]
    changed = vllm_copies.kept(copy).replace("continue", "pass  # changed upstream", 1)
    monkeypatch.setattr(vllm_seams, "source", lambda where: changed if where == copy.where else "")
    monkeypatch.setattr(vllm_seams, "moved", lambda: {copy.seam: "its source is not the one the filter's copy was made from"})
    lines, holds = vllm_copies.report(cli.copied_sources())
    assert not holds
    at = lines.index(next(line for line in lines if line.startswith("MOVED  responses simple loop")))
    assert "the installed original differs from the kept one" in lines[at + 2]
    assert any(line.strip() == "-            continue" for line in lines[at:]), lines[at:]
    assert any("+            pass  # changed upstream" in line for line in lines[at:])
