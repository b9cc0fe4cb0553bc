"""The rest of the OpenAI surface through the real Envoy: completions, models, tokenize, health.

``/v1/completions`` is compared event by event with vLLM 0.33.0's coupled
``OpenAIServingCompletion.create_completion`` run in process on the same token ids:
vLLM renders the prompt, its real ``InputProcessor`` / ``OutputProcessor`` run, only
the GPU engine core is scripted (``reference.ScriptedEngine``). Only per-run values
are normalized (``id``, ``created``, ``system_fingerprint``). ``/v1/models``,
``/tokenize`` and ``/detokenize`` are compared with vLLM's own serving objects.
"""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import openai
import pytest
from parity_cases import Case, Choice, chunked, logprob_rows
from reference import CoupledChat, ScriptedEngine
from stack import wait_for

FLAGS = ("--served-model-name", "qwen3", "--max-model-len", "4096")  # conftest's plain_stack
EOS = 151643  # <|endoftext|>: what a base-model completion ends with
TEXT = "Robot: 🤖 done. 你好，世界！ STOP here, then more text 🛑 after it."


class CoupledCompletion(CoupledChat):
    """vLLM's coupled ``/v1/completions`` for one model, built as ``vllm serve`` builds it (minus the GPU)."""

    def run(self, body: dict, steps) -> list | dict:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

        engine = ScriptedEngine(self.vllm_config, self.state.online_renderer.renderer, steps)
        serving = OpenAIServingCompletion(
            engine,  # type: ignore[arg-type]
            self.state.openai_serving_models,
            online_renderer=self.state.online_renderer,
            request_logger=None,
        )
        request = CompletionRequest.model_validate(body)

        async def go():
            result = await serving.create_completion(request)
            if hasattr(result, "model_dump"):
                return result.model_dump()
            return [frame async for frame in result]

        result = asyncio.run(go())
        self.captured = engine.captured
        if isinstance(result, dict):
            return result
        return ["[DONE]" if f[6:-2] == "[DONE]" else json.loads(f[6:-2]) for f in result]


@pytest.fixture(scope="module")
def coupled(qwen3_dir) -> CoupledCompletion:
    return CoupledCompletion(qwen3_dir, *FLAGS)


@pytest.fixture(scope="module")
def ids(qwen3_tokenizer):
    return qwen3_tokenizer.encode(TEXT, add_special_tokens=False).ids


def sse(response: httpx.Response) -> list:
    return [
        "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])
        for line in response.iter_lines()
        if line.startswith("data: ")
    ]


def normalize(result: list | dict) -> list | dict:
    """Per-run values out: one ``cmpl-`` id per response, ``created``, the fingerprint."""
    items = [result] if isinstance(result, dict) else result
    found = {e["id"] for e in items if isinstance(e, dict) and "id" in e}
    assert len(found) == 1 and found.pop().startswith("cmpl-"), found
    out = []
    for e in copy.deepcopy(items):
        if isinstance(e, dict) and "id" in e:
            e["id"], e["created"] = "<id>", "<created>"
            if e.get("system_fingerprint"):
                e["system_fingerprint"] = "<fingerprint>"
        out.append(e)
    return out[0] if isinstance(result, dict) else out


def post(stack, path: str, body: dict | bytes, **kw) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(stack.envoy_url + path, content=data, headers={"content-type": "application/json"}, timeout=60, **kw)


def through_envoy(stack, body: dict) -> list | dict:
    if not body.get("stream"):
        r = post(stack, "/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()
    with httpx.stream("POST", stack.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse(r)


# -- the cases: a body and what the "GPU" generates ------------------------------------------
def cases(ids: list[int]) -> dict[str, Case]:
    def body(**kw) -> dict:
        return {"model": "qwen3", "prompt": "Tell me about robots.", "max_tokens": 200, **kw}

    second = ids[5:] + [EOS]
    return {
        "n=2 logprobs usage": Case(
            "n2",
            body(n=2, logprobs=2, stream_options={"include_usage": True, "continuous_usage_stats": True}),
            [
                Choice(ids + [EOS], [1] * (len(ids) + 1), logprobs=logprob_rows(ids + [EOS], 2)),
                Choice(second, chunked(second, "rand", seed=3).chunks, logprobs=logprob_rows(second, 2)),
            ],
        ),
        "token-id prompt, echo, length": Case(
            "echo", body(prompt=ids[:7], echo=True, max_tokens=9), [chunked(ids[7:16], "3-4", finish_reason="length")]
        ),
        "stop string across events": Case(
            "stop", body(stop=["STOP"], logprobs=0), [chunked(ids + [EOS], "3-4", logprobs=logprob_rows(ids + [EOS], 0))]
        ),
        "return_token_ids, finish-only tail": Case(
            "tail", body(prompt=[ids[:4]], return_token_ids=True), [chunked(ids + [EOS], "rand", seed=5)], tail=True
        ),
    }


@pytest.fixture(params=["n=2 logprobs usage", "token-id prompt, echo, length", "stop string across events",
                        "return_token_ids, finish-only tail"])
def case(request, ids) -> Case:
    return cases(ids)[request.param]


def run(sim, script, coupled, case: Case, stream: bool) -> tuple:
    script.set(*case.script())
    sim.sim_config(finish_only_tail=case.tail)
    body = {**case.body, "stream": stream}
    if not stream:
        body.pop("stream_options", None)
    got = through_envoy(sim, body)
    sent = sim.sim_requests()[-1]
    want = coupled.run(body, case.steps())
    assert sent["token_ids"] == coupled.captured.prompt_token_ids, "the prompt differs from vLLM's render"
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    sp = GenerateRequest.model_validate(sent).sampling_params  # as the producer reads it
    for name in ("n", "max_tokens", "logprobs", "prompt_logprobs", "temperature", "skip_special_tokens"):
        assert getattr(sp, name) == getattr(coupled.captured.sampling_params, name), name
    assert not sp.stop, "stop strings stay with the filter"
    return got, want


def test_completion_stream_matches_vllm(sim, script, coupled, case):
    got, want = run(sim, script, coupled, case, stream=True)
    assert want[-1] == "[DONE]" and len(want) > 3
    assert normalize(got) == normalize(want)


def test_completion_full_matches_vllm(sim, script, coupled, case):
    got, want = run(sim, script, coupled, case, stream=False)
    assert want["object"] == "text_completion" and want["choices"][0]["text"]
    assert normalize(got) == normalize(want)


def test_echo_and_text_offsets(sim, script, coupled, ids, qwen3_tokenizer):
    """What the comparisons above rest on: echo puts the prompt first, text_offset counts characters."""
    case = cases(ids)["n=2 logprobs usage"]
    got, _ = run(sim, script, coupled, case, stream=False)
    choice = got["choices"][0]
    assert choice["text"] == qwen3_tokenizer.decode(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and len(lp["top_logprobs"][0]) == 2
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    echo = cases(ids)["token-id prompt, echo, length"]
    got, _ = run(sim, script, coupled, echo, stream=False)
    assert got["choices"][0]["text"] == qwen3_tokenizer.decode(ids[:16])
    assert got["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [True, False])
def test_stop_string_aborts_the_producer(sim, script, coupled, ids, stream):
    """Streaming or not: a non-streaming request with stop strings is streamed from the producer too."""
    case = cases(ids)["stop string across events"]
    sim.sim_config(delay=0.01)
    got, _ = run(sim, script, coupled, case, stream=stream)
    assert sim.sim_requests()[-1]["stream"] is True
    if stream:
        text = "".join(c["text"] for e in got if isinstance(e, dict) for c in e["choices"])
    else:
        text = got["choices"][0]["text"]
    assert "STOP" not in text and "after" not in text and text
    engine_id = "generate-tokens-" + (got[0] if stream else got)["id"].removeprefix("cmpl-")
    wait_for(lambda: engine_id in sim.sim_aborted(), what="the producer request's abort at the stop string")


def test_completions_with_the_openai_sdk(sim, client, script, ids, qwen3_tokenizer):
    script.set({"index": 0, "token_ids": ids + [EOS], "chunks": [2] * (len(ids) // 2 + 1)})
    full = client.completions.create(model="qwen3", prompt="Robots?", max_tokens=100)
    assert full.object == "text_completion" and full.choices[0].text == qwen3_tokenizer.decode(ids)
    assert full.usage.completion_tokens == len(ids) + 1
    assert full.usage.prompt_tokens == len(sim.sim_requests()[-1]["token_ids"])
    stream = client.completions.create(model="qwen3", prompt=[9707, 1879], max_tokens=100, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == qwen3_tokenizer.decode(ids)
    assert chunks[-1].usage.completion_tokens == len(ids) + 1
    assert sim.sim_requests()[-1]["token_ids"] == [9707, 1879]


# -- refusals: a clear 400 before anything reaches the producer ------------------------------------
@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"prompt": ["one", "two"]}, 400, "one prompt per request"),
        ({"prompt": [[1, 2], [3]]}, 400, "one prompt per request"),
        ({"prompt": "hi", "echo": True, "logprobs": 1}, 400, "Prompt logprobs are not available"),
        ({"prompt": "hi", "prompt_logprobs": 1}, 400, "Prompt logprobs are not available"),
        ({"prompt": "hi", "model": "gpt-4"}, 404, "The model `gpt-4` does not exist"),
        ({"prompt": "hi", "max_tokens": "lots"}, 400, "validation error"),
        ({"prompt": "word " * 5000}, 400, "maximum context length"),
    ],
    ids=["two-strings", "two-id-lists", "echo-logprobs", "prompt-logprobs", "unknown-model", "wrong-type", "too-long"],
)
def test_bad_completions_are_refused_before_the_producer(sim, body, status, words):
    before = sim.sim_received()
    r = post(sim, "/v1/completions", {"model": "qwen3", **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and words in error["message"], error
    assert sim.sim_received() == before


def test_one_prompt_in_a_list_is_served(sim, script, ids, qwen3_tokenizer):
    script.set({"index": 0, "token_ids": ids[:5] + [EOS]})
    r = post(sim, "/v1/completions", {"model": "qwen3", "prompt": ["just one"], "max_tokens": 20})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == qwen3_tokenizer.decode(ids[:5])


def test_unknown_model_error_is_vllms(sim, coupled):
    r = post(sim, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert r.json() == coupled.run({"model": "gpt-4", "prompt": "hi"}, [])


# -- models, tokenize, health ------------------------------------------------------------------------
def _card(card: dict) -> dict:
    card = copy.deepcopy(card)
    card["created"] = "<created>"
    for p in card["permission"]:
        p["id"], p["created"] = "<id>", "<created>"
    return card


def test_models_list_and_retrieve(sim, client, coupled):
    expected = asyncio.run(coupled.state.openai_serving_models.show_available_models()).model_dump()
    r = httpx.get(sim.base_url + "/models", timeout=10)
    assert r.status_code == 200 and r.json()["object"] == "list"
    assert [_card(c) for c in r.json()["data"]] == [_card(c) for c in expected["data"]]
    assert [m.id for m in client.models.list().data] == ["qwen3"]
    model = client.models.retrieve("qwen3")
    assert model.id == "qwen3" and model.owned_by == "vllm"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    error = info.value.body
    assert error == coupled.run({"model": "gpt-4", "prompt": "x"}, [])["error"]


TOKENIZE = [
    ("/tokenize", {"model": "qwen3", "prompt": TEXT}),
    ("/tokenize", {"prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True}),
    ("/tokenize", {"model": "qwen3", "messages": [{"role": "user", "content": "hi 👋"}], "add_generation_prompt": True}),
    ("/detokenize", {"model": "qwen3", "tokens": [9707, 1879, 0, 151645]}),
    ("/tokenize", {"model": "gpt-4", "prompt": "hi"}),
    ("/detokenize", {"model": "qwen3", "tokens": "not a list"}),
]


@pytest.mark.parametrize("path, body", TOKENIZE, ids=["prompt", "token-strs", "chat", "detokenize", "unknown-model", "invalid"])
def test_tokenize_and_detokenize_as_vllm(sim, coupled, path, body):
    from types import SimpleNamespace

    from pydantic import TypeAdapter, ValidationError
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

    before = sim.sim_received()
    r = post(sim, path, body)
    assert sim.sim_received() == before, "tokenize must not reach the producer"
    serving = coupled.state.serving_tokenization
    try:
        request = TypeAdapter(TokenizeRequest if path == "/tokenize" else DetokenizeRequest).validate_python(body)
    except ValidationError:
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
        return
    create = serving.create_tokenize if path == "/tokenize" else serving.create_detokenize
    want = asyncio.run(create(request, SimpleNamespace(headers={}))).model_dump()
    status = want["error"]["code"] if "error" in want else 200
    assert (r.status_code, r.json()) == (status, want)


def test_health_and_methods(sim):
    assert httpx.get(sim.envoy_url + "/health", timeout=10).status_code == 200
    r = httpx.get(sim.envoy_url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405
    r = httpx.post(sim.envoy_url + "/tokenize", timeout=10)
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
