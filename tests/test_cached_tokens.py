"""``--enable-prompt-tokens-details``: the producer's prefix-cache hits reach the client (issue 13).

The simulator models vLLM's prefix cache and reports ``prompt_tokens_details.cached_tokens`` in
its usage as ``vllm serve --enable-prompt-tokens-details`` does; the filter, with the same flag,
passes that count on in each endpoint's usage as vLLM's own serving classes write it:
``prompt_tokens_details.cached_tokens`` (chat, completions), ``cache_read_input_tokens`` with
``input_tokens`` net of it (Anthropic Messages), ``input_tokens_details.cached_tokens``
(Responses). The expected count is the simulator's own, never the filter's.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from openai import OpenAI

from stack import Stack, http_get

SYSTEM = "You answer questions about the quarterly report. " * 30


@pytest.fixture(scope="module")
def cached_stack(qwen3_dir):
    stack = Stack(qwen3_dir, ["--served-model-name", "qwen3", "--enable-prompt-tokens-details"],
                  sim_flags=["--prefix-cache-blocks", "4096", "--enable-prompt-tokens-details"]).start()
    yield stack
    stack.stop()


def sim_cached(stack: Stack) -> int:
    return json.loads(http_get(stack.sim_url + "/sim/stats")[1])["cached_prompt_tokens"]


def twice(stack: Stack, ask) -> tuple[object, int, object, int]:
    """The same request twice: (first usage, the simulator's hits for it, second usage, its hits)."""
    before = sim_cached(stack)
    first = ask()
    middle = sim_cached(stack)
    second = ask()
    return first, middle - before, second, sim_cached(stack) - middle


@pytest.mark.parametrize("stream", [False, True])
def test_chat_usage_carries_the_producers_cached_tokens(cached_stack, stream):
    client = OpenAI(base_url=cached_stack.base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"chat stream={stream}"}]

    def ask():
        if not stream:
            return client.chat.completions.create(model="qwen3", messages=messages).usage
        chunks = list(client.chat.completions.create(model="qwen3", messages=messages, stream=True,
                                                     stream_options={"include_usage": True}))
        return chunks[-1].usage

    first, hits1, second, hits2 = twice(cached_stack, ask)
    assert hits2 > 0 and hits2 > hits1
    assert first.prompt_tokens_details.cached_tokens == hits1
    assert second.prompt_tokens_details.cached_tokens == hits2


@pytest.mark.parametrize("stream", [False, True])
def test_completions_usage_carries_the_producers_cached_tokens(cached_stack, stream):
    client = OpenAI(base_url=cached_stack.base_url, api_key="unused", max_retries=0)
    prompt = SYSTEM + f"completions stream={stream}"

    def ask():
        if not stream:
            return client.completions.create(model="qwen3", prompt=prompt, max_tokens=8).usage
        chunks = list(client.completions.create(model="qwen3", prompt=prompt, max_tokens=8, stream=True,
                                                stream_options={"include_usage": True}))
        return chunks[-1].usage

    first, hits1, second, hits2 = twice(cached_stack, ask)
    assert hits2 > 0
    assert (first.prompt_tokens_details.cached_tokens, second.prompt_tokens_details.cached_tokens) == (hits1, hits2)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_usage_reads_the_cache_as_anthropic_counts_it(cached_stack, stream):
    client = anthropic.Anthropic(base_url=cached_stack.envoy_url, api_key="unused", max_retries=0)
    body = {"model": "qwen3", "max_tokens": 32, "system": SYSTEM,
            "messages": [{"role": "user", "content": f"messages stream={stream}"}]}

    def ask():
        if not stream:
            return client.messages.create(**body).usage
        with client.messages.stream(**body) as events:
            return events.get_final_message().usage

    first, hits1, second, hits2 = twice(cached_stack, ask)
    assert hits2 > 0
    assert second.cache_read_input_tokens == hits2
    assert (first.cache_read_input_tokens or 0) == hits1
    # Anthropic's input_tokens leave the cached ones out; together they are the whole prompt.
    assert second.input_tokens + second.cache_read_input_tokens == first.input_tokens + (first.cache_read_input_tokens or 0)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_usage_carries_the_producers_cached_tokens(cached_stack, stream):
    body = {"model": "qwen3", "instructions": SYSTEM, "input": f"responses stream={stream}", "stream": stream,
            "store": False}

    def ask():
        r = httpx.post(cached_stack.base_url + "/responses", json=body, timeout=60)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["usage"]
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        [done] = [e for e in events if e.get("type") == "response.completed"]
        return done["response"]["usage"]

    first, hits1, second, hits2 = twice(cached_stack, ask)
    assert hits2 > 0
    assert first["input_tokens_details"]["cached_tokens"] == hits1
    assert second["input_tokens_details"]["cached_tokens"] == hits2


def test_without_the_flag_nothing_is_claimed(sim, script, qwen3_tokenizer, client):
    """The default filter (no flag) writes no cache details, as vllm serve without it."""
    script.set({"index": 0, "token_ids": qwen3_tokenizer.encode("ok", add_special_tokens=False).ids + [151645]})
    usage = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hi"}]).usage
    assert usage.prompt_tokens_details is None
