"""Priming vLLM's detokenizer with the prompt's tail gives vLLM's text for any prompt and output.

vLLM (the oracle here) primes ``DecodeStream`` with the whole prompt; the filter
primes it with the last ``PRIMING_TAIL`` prompt tokens when that is provably the
same (``outputs.prime_with_tail``). For the three real tokenizers, hypothesis
draws prompts and outputs from text in many scripts, random ids (byte tokens
that cut characters in half) and special tokens, and every step of vLLM's own
``FastIncrementalDetokenizer`` must give the same text both ways, with special
tokens skipped or kept and with or without spaces between them.
"""

from __future__ import annotations

from derender.translate.outputs import PRIMING_TAIL
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("ab Z.,\n\t 你好世界こんにちは🤖🚀👍🏽🧑\u200d🚀éü\u0301مرحباनमस्ते")),
        st.characters(exclude_categories=("Cs",)),
    ),
    max_size=30,
)


def ids_strategy(tokenizer, max_pieces: int):
    specials = sorted(tokenizer.all_special_ids) or [0]
    piece = st.one_of(
        TEXT.map(lambda t: tokenizer.encode(t, add_special_tokens=False)),
        st.lists(st.integers(0, len(tokenizer) - 1), max_size=4),  # random ids: half characters, rare tokens
        st.sampled_from(specials).map(lambda i: [i]),
    )
    return st.lists(piece, max_size=max_pieces).map(lambda pieces: [i for p in pieces for i in p])


def detokenizer(tokenizer, prompt: list[int], skip_special_tokens: bool, spaces_between_special_tokens: bool):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    params = SamplingParams(skip_special_tokens=skip_special_tokens,
                            spaces_between_special_tokens=spaces_between_special_tokens)
    request = EngineCoreRequest(request_id="r", prompt_token_ids=prompt, mm_features=None, sampling_params=params,
                                pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
                                data_parallel_rank=None)
    return FastIncrementalDetokenizer(tokenizer, request)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans(), spaces=st.booleans())
def test_tail_priming_gives_vllms_text(hf_tokenizer, data, skip, spaces):
    from derender.translate.outputs import prime_with_tail

    head = data.draw(ids_strategy(hf_tokenizer, 40), label="head")  # what falls before the tail
    prompt = FILLER(hf_tokenizer) + head + data.draw(ids_strategy(hf_tokenizer, 20), label="prompt end")
    output = data.draw(ids_strategy(hf_tokenizer, 8), label="output")
    vllm = detokenizer(hf_tokenizer, prompt, skip, spaces)
    ours = detokenizer(hf_tokenizer, prompt, skip, spaces)
    primed = ours.stream
    prime_with_tail(ours, prompt)
    event("tail" if ours.stream is not primed else "whole prompt (guard)")
    assert [vllm.decode_next(i) for i in output] == [ours.decode_next(i) for i in output]


def FILLER(tokenizer) -> list[int]:
    return tokenizer.encode("Some words before the interesting part. " * 8, add_special_tokens=False)[: PRIMING_TAIL + 1]


def test_tail_priming_is_used_for_a_plain_long_prompt(hf_tokenizer):
    """The guard does not refuse ordinary prompts (else the test above proves nothing new)."""
    from derender.translate.outputs import prime_with_tail

    prompt = hf_tokenizer.encode("A long prompt about nothing in particular. " * 20, add_special_tokens=False)
    ours = detokenizer(hf_tokenizer, prompt, True, True)
    before = ours.stream
    prime_with_tail(ours, prompt)
    assert ours.stream is not before
