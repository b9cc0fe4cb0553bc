"""Small bodies are rendered on the event loop, large ones on vLLM's pool (``derender.inline_render``)."""

from __future__ import annotations

import asyncio
import json

import pytest

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def model(qwen3_dir):
    from derender.model import Model, ModelSpec

    return Model(ModelSpec(model=qwen3_dir, served_model_name=("qwen3",), max_model_len=40960,
                           reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True))


def body(text: str, stream: bool = True) -> bytes:
    return json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": text}], "tools": [TOOL],
                       "stream": stream, "max_tokens": 10}).encode()


def render(model, raw: bytes, monkeypatch) -> tuple[object, int]:
    """The render of ``raw``, and how many calls it handed to the renderer's pool."""
    from derender.render import render_chat

    pool = model.renderer._executor
    handed = []
    submit = pool.submit
    monkeypatch.setattr(pool, "submit", lambda *a, **k: handed.append(a) or submit(*a, **k))
    try:
        return asyncio.run(render_chat(model, raw, None)), len(handed)
    finally:
        monkeypatch.setattr(pool, "submit", submit)


def test_a_small_body_is_rendered_without_the_pool_and_to_the_same_ids(model, monkeypatch):
    from derender import inline_render

    raw = body("What will the weather be like in Paris? Answer in one word, please: é ü ✓")
    inline, handed = render(model, raw, monkeypatch)
    assert handed == 0
    monkeypatch.setattr(inline_render, "INLINE_BYTES", 0)  # every body through vLLM's pool, as vLLM does
    pooled, handed = render(model, raw, monkeypatch)
    assert handed == 2  # the chat template, then the tokenizer
    assert inline.prompt_token_ids == pooled.prompt_token_ids and len(inline.prompt_token_ids) > 100
    assert json.loads(inline.body) == {**json.loads(pooled.body), "request_id": json.loads(inline.body)["request_id"]}


def test_a_large_body_goes_to_the_pool(model, monkeypatch):
    from derender import inline_render

    text = "The weather in Paris is mild in spring. " * (inline_render.INLINE_BYTES // 40 + 1)
    rendered, handed = render(model, body(text), monkeypatch)
    assert handed == 2 and len(rendered.prompt_token_ids) > inline_render.INLINE_BYTES // 10


def test_an_error_raised_inline_reaches_the_client_as_from_the_pool(model, monkeypatch):
    from derender.errors import HTTPError

    def broken(*args, **kwargs):
        raise ValueError("this prompt cannot be tokenized")

    monkeypatch.setattr(model.renderer, "_tokenize_prompt", broken)
    with pytest.raises(HTTPError) as failed:
        render(model, body("hello"), monkeypatch)
    assert failed.value.status == 400 and "this prompt cannot be tokenized" in failed.value.message
