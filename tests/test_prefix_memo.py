"""Repeated prompt prefixes tokenized once (``derender.translate.prefixmemo``) give exactly vLLM's ids.

The oracle is the tokenizer's own one-call encoding of the whole text, the call vLLM's renderer
makes. Hypothesis builds texts of turns opened by each tokenizer's special tokens (and text in many
scripts, whitespace, digits and the literal text of other special tokens between them), encodes a
prefix, then the prefix with more turns and other texts, all through one memo, for the three real
tokenizers. Then an agent's growing conversation is rendered by the filter's renderer and by vLLM's.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_long_prompts import SEGMENT

from derender.translate import longprompt, prefixmemo

# boundaries() reads the whole tokenizer (a second for gpt-oss's): once per tokenizer, which is
# kept here so that its id is not another's.
_MARKERS: dict[int, tuple[object, list[str]]] = {}


def markers_of(tokenizer) -> list[str]:
    if id(tokenizer) not in _MARKERS:
        _MARKERS[id(tokenizer)] = (tokenizer, prefixmemo.boundaries(tokenizer))
    return _MARKERS[id(tokenizer)][1]


def memo_of(tokenizer) -> prefixmemo.PrefixMemo:
    return prefixmemo.PrefixMemo(markers_of(tokenizer), lambda texts: longprompt.encode_each(tokenizer, texts))


def test_each_real_tokenizer_has_turn_openers_to_cut_before(hf_tokenizer):
    markers = prefixmemo.boundaries(hf_tokenizer)
    assert markers, "no special token to cut before"
    assert any(m in markers for m in ("<|im_start|>", "<|start|>", "<｜User｜>", "<｜Assistant｜>")), markers


def turns(tokenizer):
    markers = markers_of(tokenizer)
    return st.lists(st.tuples(st.sampled_from(markers), SEGMENT).map("".join), min_size=1, max_size=12).map("".join)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_held_prefixes_give_the_whole_texts_ids(hf_tokenizer, data):
    memo = memo_of(hf_tokenizer)
    whole = lambda text: hf_tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731 - the oracle
    lead = data.draw(SEGMENT, "text before the first turn")
    first = lead + data.draw(turns(hf_tokenizer), "the first request")
    assert (memo.encode(first) or whole(first)) == whole(first)
    later = first + data.draw(turns(hf_tokenizer), "turns added")
    hits = memo.hits
    assert (memo.encode(later) or whole(later)) == whole(later)
    event("a held prefix was used" if memo.hits > hits else "nothing held matched")
    other = data.draw(SEGMENT, "an edit") + later[len(lead):]  # the same turns after other text
    assert (memo.encode(other) or whole(other)) == whole(other)


def test_held_ids_stay_within_the_budget(qwen3_dir, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    monkeypatch.setattr(prefixmemo, "BUDGET_IDS", 500)
    memo = memo_of(tokenizer)
    for k in range(40):
        text = f"<|im_start|>system\nprompt {k} " + "words " * 40 + "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        assert memo.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert 0 < memo.held_ids <= 500


@pytest.fixture(scope="module")
def models(qwen3_dir):
    """The filter's model (memo installed) and one whose renderer is vLLM's, untouched."""
    from vllm.utils.async_utils import make_async

    from derender.translate.model import Model, ModelSpec

    spec = ModelSpec(model=qwen3_dir, served_model_name=("qwen3",), max_model_len=40960,
                     tool_call_parser="hermes", enable_auto_tool_choice=True)
    ours, plain = Model(spec), Model(spec)
    plain.renderer.__dict__.pop("_tokenize_prompt")  # back to the class's method
    plain.renderer._tokenize_prompt_async = make_async(plain.renderer._tokenize_prompt, executor=plain.renderer._executor)
    return ours, plain


def test_an_agents_growing_conversation_renders_to_vllms_prompt(models):
    """An agent's turns: a long system prompt and tools, then tool calls and results added each turn.
    From the second turn on the filter reuses the held ids of what came before."""
    from derender.translate.render import render_chat

    ours, plain = models
    memo = ours.prompt_memo
    assert memo is not None
    tools = [{"type": "function", "function": {"name": f"tool_{k}", "description": "Reads a file. " * 30,
                                                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
             for k in range(12)]
    messages = [{"role": "system", "content": "You are a coding agent. Follow the rules. " * 300},
                {"role": "user", "content": "Fix the failing test in parser.py"}]
    previous: list[int] = []
    for turn in range(4):
        body = {"model": "qwen3", "messages": messages, "tools": tools, "max_tokens": 10}
        raw = json.dumps(body).encode()
        reused = memo.reused_ids
        mine = asyncio.run(render_chat(ours, raw, None)).prompt_token_ids
        theirs = asyncio.run(render_chat(plain, raw, None)).prompt_token_ids
        assert mine == theirs, turn
        # all of the last turn's prompt but its closing "<|im_start|>assistant\n" came from memory
        assert memo.reused_ids - reused >= len(previous) - 5, turn
        previous = mine
        call = {"id": f"call_{turn}", "type": "function", "function": {"name": "tool_1", "arguments": json.dumps({"path": f"f{turn}.py"})}}
        messages = [*messages, {"role": "assistant", "content": f"Reading file {turn}.", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"contents of f{turn}.py\n" * 50}]
    assert len(previous) > 5_000


def test_an_agents_growing_responses_conversation_renders_to_vllms_prompt(models):
    """The same through vLLM's Responses server, which asks the tokenizer for special tokens on the
    rendered prompt (chat does not): they add none on this tokenizer, so the memo takes the prompt,
    and the ids are still vLLM's own."""
    from derender.endpoints.responses.endpoint import render_responses

    ours, plain = models
    memo = ours.prompt_memo
    assert longprompt.adds_no_special_tokens(ours.renderer.get_tokenizer())

    async def prompt_of(model, raw: bytes) -> list[int]:
        rendered = await render_responses(model, raw, None)
        rendered.session.cancel()
        return rendered.prompt_token_ids

    tools = [{"type": "function", "name": f"tool_{k}", "description": "Reads a file. " * 30,
              "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}} for k in range(12)]
    items: list[dict] = [{"role": "user", "content": "Fix the failing test in parser.py"}]
    previous: list[int] = []
    for turn in range(4):
        body = {"model": "qwen3", "instructions": "You are a coding agent. Follow the rules. " * 300, "input": items,
                "tools": tools, "max_output_tokens": 10}
        raw = json.dumps(body).encode()
        reused = memo.reused_ids
        mine = asyncio.run(prompt_of(ours, raw))
        theirs = asyncio.run(prompt_of(plain, raw))
        assert mine == theirs, turn
        assert memo.reused_ids - reused >= len(previous) - 5, turn
        previous = mine
        items = [*items, {"type": "function_call", "call_id": f"call_{turn}", "name": "tool_1",
                          "arguments": json.dumps({"path": f"f{turn}.py"})},
                 {"type": "function_call_output", "call_id": f"call_{turn}", "output": f"contents of f{turn}.py\n" * 50}]
    assert len(previous) > 5_000


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_special_tokens_asked_for_add_none_where_the_check_says_so(hf_tokenizer, data):
    """``adds_no_special_tokens`` lets a prompt that asks for special tokens (a Responses prompt) take
    the memo and the pieces: on each shipped tokenizer it says so, and then both encodings agree."""
    assert longprompt.adds_no_special_tokens(hf_tokenizer)
    text = data.draw(SEGMENT, "text before the first turn") + data.draw(turns(hf_tokenizer), "turns")
    assert hf_tokenizer(text, add_special_tokens=True)["input_ids"] == hf_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_tokenizer_that_adds_a_bos_keeps_vllms_call(qwen3_dir):
    """A post-processor that adds a token (a BOS, as many tokenizers' do): the check says no, and
    such a prompt is tokenized by vLLM's own call."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from derender.translate import vllm_seams

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    backend = vllm_seams.raw_tokenizer(tokenizer)
    bos = "<|endoftext|>"
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, backend.token_to_id(bos))])
    assert tokenizer("hi", add_special_tokens=True)["input_ids"] != tokenizer("hi", add_special_tokens=False)["input_ids"]
    assert not longprompt.adds_no_special_tokens(tokenizer)


def test_no_cut_where_another_added_tokens_match_could_cover_it(qwen3_dir):
    """A special token ending with what a turn opener begins with wins the leftmost match: no cut there.
    (The tokenizer matches special tokens first, then the others on what is left; boundaries() treats
    all alike, which may refuse a cut that was safe, never the reverse.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    tokenizer.add_tokens(["xy<|im"], special_tokens=True)
    text = ("xy<|im_start|>system\n" + "rules " * 400) * 2 + "<|im_start|>user\nhi<|im_end|>\n"
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    markers = prefixmemo.boundaries(tokenizer)
    assert "<|im_start|>" not in markers and "<|im_end|>" not in markers and "<|endoftext|>" in markers
    assert (memo_of(tokenizer).encode(text) or whole) == whole
    # what the check prevents: cut before every "<|im_start|>", the ids differ
    assert prefixmemo.PrefixMemo(["<|im_start|>"], lambda texts: longprompt.encode_each(tokenizer, texts)).encode(text) != whole


def test_through_envoy_a_second_turn_takes_its_prefix_from_memory(qwen3_dir):
    """A filter behind the real Envoy, the OpenAI SDK as client: the producer gets the tokenizer's
    ids for each turn's prompt, and the metrics say the second turn's first part came from memory."""
    from openai import OpenAI
    from stack import Stack, free_port, metric_total
    from transformers import AutoTokenizer

    port = free_port()
    stack = Stack(qwen3_dir, ["--served-model-name", "qwen3", "--max-model-len", "4096", "--workers", "1",
                              "--metrics-port", str(port)], ["--mode", "echo"]).start()
    try:
        tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
        client = OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
        metrics = f"http://127.0.0.1:{port}/metrics"
        messages = [{"role": "system", "content": "You review code. Be brief and exact. " * 80},
                    {"role": "user", "content": "Is `x = x + 1` the same as `x += 1`?"}]
        prompts = []
        for turn in range(2):
            held = metric_total(metrics, "derender_prompt_memo_tokens_total", source="held")
            client.chat.completions.create(model="qwen3", messages=messages, max_tokens=5)
            prompt = stack.sim_requests()[-1]["token_ids"]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert prompt == tokenizer(text, add_special_tokens=False)["input_ids"], turn
            prompts.append(prompt)
            took = metric_total(metrics, "derender_prompt_memo_tokens_total", source="held") - held
            messages = [*messages, {"role": "assistant", "content": "For ints, yes."}, {"role": "user", "content": "And lists?"}]
        assert took >= len(prompts[0]) - 5  # all of turn 1's prompt but its "<|im_start|>assistant\n"
    finally:
        stack.stop()
