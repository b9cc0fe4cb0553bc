"""Each worker renders one request before it listens (``derender.ops.warmup``), for every kind of model."""

from __future__ import annotations

import asyncio
import logging

import pytest

# The parity suite's model configs: reasoning and tool parsers, Harmony for gpt-oss.
CONFIGS = {
    "qwen3": {"reasoning_parser": "qwen3", "tool_call_parser": "hermes", "enable_auto_tool_choice": True},
    "deepseek-r1": {"reasoning_parser": "deepseek_r1"},
    "gpt-oss": {"reasoning_parser": "openai_gptoss", "tool_call_parser": "openai", "enable_auto_tool_choice": True},
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    from derender.ops import assets
    from derender.translate.model import Model, ModelSpec

    name = request.param
    return Model(ModelSpec(model=str(assets.fetch(name, quiet=True)), served_model_name=(name,), max_model_len=4096,
                           **CONFIGS[name]))


def test_warm_up_renders_and_builds_a_stream(model, caplog):
    from derender.ops import warmup

    body = warmup.request_body(model)
    assert (b'"tools"' in body) == model.spec.enable_auto_tool_choice  # tool parsers get a tool to adjust for
    with caplog.at_level(logging.INFO, logger="derender.warmup"):
        asyncio.run(warmup.warm_up(model))
    messages = [r.getMessage() for r in caplog.records if r.name == "derender.warmup"]
    assert len(messages) == 1 and messages[0].startswith(f"model {model.name} warmed up in "), messages
    assert all(r.levelno < logging.WARNING for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_failed_warm_up_is_logged_not_raised(model, caplog, monkeypatch):
    from derender.ops import warmup

    async def broken(*args):
        raise RuntimeError("no template today")

    monkeypatch.setattr(warmup, "render_chat", broken)
    with caplog.at_level(logging.INFO, logger="derender.warmup"):
        asyncio.run(warmup.warm_up(model))
    warnings = [r for r in caplog.records if r.name == "derender.warmup" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "first request will be slower" in warnings[0].getMessage()
