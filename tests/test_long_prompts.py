"""Long prompts tokenized in pieces (``derender.translate.longprompt``) give exactly vLLM's token ids.

The oracle is the tokenizer's own one-call encoding of the whole text, the call
vLLM's renderer makes. Hypothesis builds long texts from text in many scripts,
whitespace runs, digits, code, contractions and the literal text of special
tokens, for the three real tokenizers; then a whole chat request is rendered
by the filter's renderer (pieces) and by vLLM's (one call), with and without
truncation. Tokenizers the reasoning does not cover are refused.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from derender.translate import longprompt
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

PIECE = st.one_of(
    st.sampled_from(list("abcxyz XYZ  \n\t\r.,;:'!?-_()[]{}<>|/\\\"0123456789")),
    st.sampled_from(["'s", "'ll", " 's", "n't", "a\u0301", "é", "你好", "こんにちは", "🤖", "👍🏽", "\u200d", "مرحبا", "नमस्ते",
                     "<|im_end|>", "<|im_start|>", "<think>", "<｜end▁of▁sentence｜>", "<|endoftext|>", "<|return|>",
                     "def f(x):\n    return x  # ok\n", "   ", "\n\n", "1234567", "A B", "x y", "Ab Cd"]),
    st.characters(exclude_categories=("Cs",)),
)
SEGMENT = st.lists(PIECE, max_size=30).map("".join)


def long_text(segments: list[str]) -> str:
    base = "".join(segments) + " and some plain words between "
    return (base * math.ceil(longprompt.MIN_CHARS * 1.2 / len(base)))[: int(longprompt.MIN_CHARS * 1.2)]


def test_the_real_tokenizers_are_splittable(hf_tokenizer):
    assert longprompt.splittable(hf_tokenizer)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(segments=st.lists(SEGMENT, min_size=1, max_size=30))
def test_pieces_give_the_whole_texts_ids(hf_tokenizer, segments):
    text = long_text(segments)
    parts = longprompt.pieces(hf_tokenizer, text)
    assert "".join(parts) == text
    event(f"{len(parts)} pieces" if len(parts) < 3 else "3+ pieces")
    assert longprompt.encode(hf_tokenizer, parts) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def models(qwen3_dir):
    """The filter's model (pieces installed) and one whose renderer is vLLM's, untouched."""
    from derender.translate.model import Model, ModelSpec

    spec = ModelSpec(model=qwen3_dir, served_model_name=("qwen3",), max_model_len=16384)
    ours = Model(spec)
    plain = Model(spec)
    plain.renderer.__dict__.pop("_tokenize_prompt")  # back to the class's method
    from vllm.utils.async_utils import make_async

    plain.renderer._tokenize_prompt_async = make_async(plain.renderer._tokenize_prompt, executor=plain.renderer._executor)
    assert ours.long_prompts
    return ours, plain


@pytest.mark.parametrize("truncate", [None, 5000, -1])
def test_a_long_chat_renders_to_vllms_prompt(models, qwen3_tokenizer, truncate):
    from derender.translate.render import render_chat

    ours, plain = models
    text = f"Tell me about it ({truncate}). " + "The report lists revenue, costs and risks per region; 12 of 40 items are late. " * 600  # new each time: the memo holds what came before
    body = {"model": "qwen3", "messages": [{"role": "user", "content": text}], "max_tokens": 10}
    if truncate is not None:
        body["truncate_prompt_tokens"] = truncate
    raw = json.dumps(body).encode()
    split = longprompt.split_prompts
    theirs = asyncio.run(render_chat(plain, raw, None)).prompt_token_ids
    assert longprompt.split_prompts == split  # vLLM's own renderer: one call
    mine = asyncio.run(render_chat(ours, raw, None)).prompt_token_ids
    assert longprompt.split_prompts == split + 1, "the filter's renderer did not tokenize in pieces"
    assert len(theirs) >= 5000
    assert mine == theirs


def test_tokenizers_the_reasoning_does_not_cover_are_refused():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def fast(pre_tokenizer=None, normalizer=None):
        backend = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, " ": 2, "▁": 3}, merges=[]))
        if pre_tokenizer is not None:
            backend.pre_tokenizer = pre_tokenizer
        if normalizer is not None:
            backend.normalizer = normalizer
        backend.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=backend)

    from tokenizers import Regex

    assert longprompt.splittable(fast(pre_tokenizers.Split(Regex(r"\p{L}+|\s+"), "isolated")))
    assert not longprompt.splittable(fast(pre_tokenizers.Metaspace()))
    assert not longprompt.splittable(fast(pre_tokenizers.Split(Regex(r"(?<=a)b|\s+"), "isolated")))
    assert not longprompt.splittable(fast(pre_tokenizers.Split(Regex(r"\bab|\s+"), "isolated")))
    assert not longprompt.splittable(fast(pre_tokenizers.ByteLevel(add_prefix_space=True)))
    assert not longprompt.splittable(fast(normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.NFC()])))
    assert not longprompt.splittable(fast(normalizer=normalizers.Strip()))


def test_long_prompts_through_envoy_on_forked_workers(sim, client, script, qwen3_tokenizer):
    """The filter's default workers are forked after the model loads (and the tokenizer threads
    warm up): every worker must tokenize long prompts in pieces, and the producer gets the ids
    of the whole rendered text. The kernel spreads Envoy's ext_proc connections over the workers."""
    from stack import wait_for

    ids = qwen3_tokenizer.encode(" done", add_special_tokens=False).ids
    script.set({"index": 0, "token_ids": ids + [151645]})
    text = "Please summarize:" + " international cooperation" * 1200  # ~31k characters, ~2.4k tokens
    assert len(text) > longprompt.MIN_CHARS
    before = sim.sim_received()
    for _ in range(6):
        answer = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": text}], timeout=30)
        assert answer.choices[0].message.content == " done"
    wait_for(lambda: sim.sim_received() >= before + 6, what="the six producer requests")
    for request in sim.sim_requests()[-6:]:
        prompt = request["token_ids"]
        rendered = qwen3_tokenizer.decode(prompt, skip_special_tokens=False)
        assert text in rendered
        assert qwen3_tokenizer.encode(rendered, add_special_tokens=False).ids == prompt  # the whole text's ids
