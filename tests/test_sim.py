"""derender.sim against vLLM 0.33.0's own models, serializers and error handlers."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer

from derender import sim

MODELS = Path("~/.cache/derender/models").expanduser()
QWEN = str(MODELS / "qwen3")
QWEN_TOK = Tokenizer.from_file(f"{QWEN}/tokenizer.json")
QWEN_EOS = 151645
USER_TEXT = "Hello there, how are you? Ünïcödé ✓"
CHATML = (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nfirst<|im_end|>\n"
          f"<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\n{USER_TEXT}<|im_end|>\n"
          f"<|im_start|>assistant\n")
PROMPT = QWEN_TOK.encode(CHATML, add_special_tokens=False).ids
ANSWER = QWEN_TOK.encode(USER_TEXT, add_special_tokens=False).ids + [QWEN_EOS]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def vllm():
    """vLLM's protocol, serving helpers and a FastAPI app with its real router and error
    handlers (validation runs before the handler, so no engine is needed)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient as FastAPIClient
    from vllm.entrypoints.scale_out.token_in_token_out import api_router, protocol, serving
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.exceptions import GenerationError, VLLMValidationError
    from vllm.logprobs import append_logprobs_for_next_position

    app = FastAPI()
    app.include_router(api_router.router)
    init_exception_handler(app)
    app.state.args = argparse.Namespace(log_error_stack=False)
    return argparse.Namespace(
        p=protocol, serving=serving, oracle=FastAPIClient(app), ErrorResponse=ErrorResponse,
        create_error_response=create_error_response, GenerationError=GenerationError,
        VLLMValidationError=VLLMValidationError, append_logprobs=append_logprobs_for_next_position)


def run(app, fn):
    async def go():
        async with TestClient(TestServer(app)) as client:
            return await fn(client)
    return asyncio.run(go())


def body(**kw):
    sp = kw.pop("sampling_params", {})
    return {"token_ids": PROMPT, "sampling_params": sp, **kw}


async def stream(client, payload, headers=None):
    """POST a streaming request; return (response, list of raw `data:` payloads)."""
    resp = await client.post("/inference/v1/generate", json=payload, headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    text = (await resp.read()).decode()
    frames = text.split("\n\n")
    assert frames[-1] == "" and all(f.startswith("data: ") for f in frames[:-1])
    return resp, [f[len("data: "):] for f in frames[:-1]]


def check_stream_bytes(vllm, events):
    """Every event re-serializes byte-identically the way vLLM's generator dumps it."""
    assert events[-1] == "[DONE]"
    parsed = []
    for raw in events[:-1]:
        chunk = vllm.p.GenerateTokensStreamResponse.model_validate_json(raw)
        if chunk.choices:
            exclude = {n for n in ("prompt_token_ids", "mm_placeholders", "metrics")
                       if getattr(chunk, n) is None}
            assert chunk.model_dump_json(exclude=exclude) == raw
            assert len(chunk.choices) == 1
        else:
            assert chunk.model_dump_json(exclude_none=True) == raw
        parsed.append(chunk)
    return parsed


def tokens_by_choice(chunks):
    out: dict[int, list[int]] = {}
    for c in chunks:
        for ch in c.choices:
            out.setdefault(ch.index, []).extend(ch.token_ids)
    return out


def test_echo_stream_matches_vllm(vllm):
    async def go(client):
        return await stream(client, body(stream=True, stream_options={"include_usage": True}),
                            headers={"X-Request-Id": "abc"})
    _, events = run(sim.build_app(QWEN), go)
    chunks = check_stream_bytes(vllm, events)
    assert all(c.request_id == "generate-tokens-abc" for c in chunks)
    token_chunks, usage = chunks[:-1], chunks[-1]
    assert [len(c.choices[0].token_ids) for c in token_chunks] == [1] * len(ANSWER)
    assert tokens_by_choice(token_chunks) == {0: ANSWER}
    assert QWEN_TOK.decode(ANSWER[:-1]) == USER_TEXT
    assert [c.choices[0].finish_reason for c in token_chunks][-2:] == [None, "stop"]
    assert token_chunks[-1].choices[0].stop_reason is None
    assert all(c.usage is None and c.prompt_token_ids is None for c in token_chunks)
    assert usage.choices == [] and usage.usage.completion_tokens == len(ANSWER)
    assert usage.usage.prompt_tokens == len(PROMPT)


def test_nonstream_body_matches_vllm(vllm):
    async def go(client):
        resp = await client.post("/inference/v1/generate", json=body(
            request_id="rid", return_token_ids=True, sampling_params={"max_tokens": 3}))
        assert resp.status == 200 and resp.content_type == "application/json"
        return await resp.text()
    raw = run(sim.build_app(QWEN), go)
    res = vllm.p.GenerateTokensResponse.model_validate_json(raw)
    # Starlette JSONResponse rendering of res.model_dump()
    assert json.dumps(res.model_dump(), ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")) == raw
    assert res.request_id == "generate-tokens-rid" and res.prompt_token_ids == PROMPT
    (choice,) = res.choices
    assert choice.token_ids == ANSWER[:3] and choice.finish_reason == "length"
    assert res.usage.completion_tokens == 3 and res.usage.total_tokens == len(PROMPT) + 3


def test_n_round_robin_and_continuous_usage(vllm):
    async def go(client):
        return await stream(client, body(
            stream=True, return_token_ids=True, sampling_params={"n": 3, "max_tokens": 5},
            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    _, events = run(sim.build_app(QWEN, tokens_per_event=2), go)
    chunks = check_stream_bytes(vllm, events)
    token_chunks = chunks[:-1]
    assert [c.choices[0].index for c in token_chunks] == [0, 1, 2] * 3
    assert [len(c.choices[0].token_ids) for c in token_chunks] == [2] * 6 + [1] * 3
    assert tokens_by_choice(token_chunks) == {i: ANSWER[:5] for i in range(3)}
    assert token_chunks[0].prompt_token_ids == PROMPT
    assert all(c.prompt_token_ids is None for c in chunks[1:])
    assert [c.usage.completion_tokens for c in token_chunks] == [2] * 3 + [4] * 3 + [5] * 3
    finals = [c.choices[0] for c in token_chunks[-3:]]
    assert all(ch.finish_reason == "length" and ch.stop_reason is None for ch in finals)
    assert chunks[-1].usage.completion_tokens == 15


def test_continuous_usage_needs_include_usage(vllm):
    async def go(client):
        return await stream(client, body(stream=True,
                                         stream_options={"continuous_usage_stats": True}))
    _, events = run(sim.build_app(QWEN), go)
    chunks = check_stream_bytes(vllm, events)
    assert all(c.usage is None and c.choices for c in chunks)


def write_script(tmp_path, *lines):
    path = tmp_path / "script.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_script_chunks_finish_tail_and_reuse(vllm, tmp_path):
    script = write_script(tmp_path, {"index": 0, "token_ids": [5, 6, 7, 8, 9, 10],
                                     "finish_reason": "stop", "stop_reason": 10,
                                     "chunks": [1, 3]})

    async def go(client):
        return await stream(client, body(stream=True, sampling_params={"n": 2}))
    def app():
        return sim.build_app(QWEN, mode="script", script=script, tokens_per_event=2,
                             finish_only_tail=True)
    _, events = run(app(), go)
    chunks = check_stream_bytes(vllm, events)
    sizes = [(c.choices[0].index, c.choices[0].token_ids) for c in chunks]
    assert sizes == [(0, [5]), (1, [5]), (0, [6, 7, 8]), (1, [6, 7, 8]),
                     (0, [9, 10]), (1, [9, 10]), (0, []), (1, [])]
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert [(c.choices[0].finish_reason, c.choices[0].stop_reason) for c in chunks[-2:]] == \
        [("stop", 10)] * 2
    # the script is re-read on every request
    Path(script).write_text(json.dumps({"token_ids": [1, 2], "finish_reason": "length"}))
    _, events = run(app(), go)
    assert tokens_by_choice(check_stream_bytes(vllm, events)) == {0: [1, 2], 1: [1, 2]}


def test_nonstream_n_choices_in_index_order(vllm, tmp_path):
    script = write_script(tmp_path, {"index": 1, "token_ids": [7, 8], "finish_reason": "stop",
                                     "stop_reason": "</s>"}, {"index": 0, "token_ids": [3]})

    async def go(client):
        resp = await client.post("/inference/v1/generate", json=body(
            sampling_params={"n": 3, "logprobs": 0}))
        return await resp.text()
    raw = run(sim.build_app(QWEN, mode="script", script=script), go)
    res = vllm.p.GenerateTokensResponse.model_validate_json(raw)
    assert json.dumps(res.model_dump(), separators=(",", ":"), ensure_ascii=False) == raw
    assert [(c.index, c.token_ids, c.stop_reason) for c in res.choices] == \
        [(0, [3], None), (1, [7, 8], "</s>"), (2, [7, 8], "</s>")]
    assert res.usage.completion_tokens == 5
    assert [len(c.logprobs.content) for c in res.choices] == [1, 2, 2]


def test_stop_token_ids_cut_answer(vllm):
    async def go(client):
        resp = await client.post("/inference/v1/generate", json=body(
            sampling_params={"stop_token_ids": [ANSWER[2]], "max_tokens": 2}))
        return vllm.p.GenerateTokensResponse.model_validate_json(await resp.text())
    (choice,) = run(sim.build_app(QWEN), go).choices
    assert choice.token_ids == ANSWER[:2] and choice.finish_reason == "length"

    async def go2(client):
        resp = await client.post("/inference/v1/generate", json=body(
            sampling_params={"stop_token_ids": [ANSWER[2]], "max_tokens": 3}))
        return vllm.p.GenerateTokensResponse.model_validate_json(await resp.text())
    (choice,) = run(sim.build_app(QWEN), go2).choices  # the stop token beats the cap
    assert choice.token_ids == ANSWER[:3] and choice.finish_reason == "stop"
    assert choice.stop_reason == ANSWER[2]


def test_random_chunking_is_seeded(vllm):
    async def go(client):
        return await stream(client, body(stream=True))
    sizes = []
    for _ in range(2):
        _, events = run(sim.build_app(QWEN, tokens_per_event="random:7"), go)
        chunks = check_stream_bytes(vllm, events)
        assert tokens_by_choice(chunks) == {0: ANSWER}
        sizes.append([len(c.choices[0].token_ids) for c in chunks])
    assert sizes[0] == sizes[1] and set(sizes[0]) - {1, 2, 3, 4} == set()
    assert len(set(sizes[0])) > 1


def engine_logprobs(vllm, token_ids, steps, k):
    """vLLM's own path: engine (sampled + top-k) arrays -> Logprob dicts ->
    ServingTokens._create_tokens_logprobs."""
    per_position = []
    for tok, (lp, rank, top) in zip(token_ids, steps):
        ids = [tok] + [t for t, _ in top[:k]]
        lps = [lp] + [v for _, v in top[:k]]
        vllm.append_logprobs(per_position, ids, lps, [None] * len(ids), rank, k)
    return vllm.serving.ServingTokens._create_tokens_logprobs(None, token_ids, per_position)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_logprobs_engine_order(vllm, tmp_path, k):
    tops = [[[5, -0.1], [9, -1.5], [8, -2.0]], [[3, -0.2], [6, -0.9], [4, -3.0]],
            [[1, -0.01], [2, -0.5], [7, -1.25]]]
    steps = [(-0.1, 1, tops[0]), (-0.9, 2, tops[1]), (-4.0, 9, tops[2])]
    script = write_script(tmp_path, {"token_ids": [5, 6, 7], "logprobs": [
        {"logprob": lp, "top": top} for lp, _, top in steps[:2]] + [
        {"logprob": -4.0, "rank": 9, "top": tops[2]}]})

    async def go(client):
        _, events = await stream(client, body(stream=True, sampling_params={"logprobs": k}))
        resp = await client.post("/inference/v1/generate",
                                 json=body(sampling_params={"logprobs": k}))
        return events, await resp.text()
    events, raw = run(sim.build_app(QWEN, mode="script", script=script), go)
    chunks = check_stream_bytes(vllm, events)
    expected = engine_logprobs(vllm, [5, 6, 7], steps, k)
    content = [e for c in chunks for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in content] == [e.model_dump() for e in expected.content]
    full = vllm.p.GenerateTokensResponse.model_validate_json(raw)
    assert full.choices[0].logprobs == expected


def test_fake_logprobs_shape(vllm):
    async def go(client):
        _, events = await stream(client, body(stream=True, sampling_params={"logprobs": 1}))
        return events
    chunks = check_stream_bytes(vllm, run(sim.build_app(QWEN, finish_only_tail=True), go))
    content = [e for c in chunks for e in c.choices[0].logprobs.content]
    assert [e.token_id for e in content] == ANSWER
    for pos, e in enumerate(content):
        assert e.top_logprobs[0].token_id == e.token_id  # sampled first
        assert len(e.top_logprobs) == (2 if pos % 3 == 2 else 1)  # k+1 when not in top k
        assert e.rank == (2 if pos % 3 == 2 else 1)
    tail = chunks[-1].choices[0]
    assert tail.token_ids == [] and tail.logprobs.content == []


def test_logprobs_over_max(vllm):
    async def go(client):
        _, events = await stream(client, body(stream=True, sampling_params={"logprobs": 21}))
        resp = await client.post("/inference/v1/generate",
                                 json=body(sampling_params={"logprobs": 21}))
        return events, resp.status, await resp.text()
    events, status, raw = run(sim.build_app(QWEN), go)
    err = vllm.create_error_response(vllm.VLLMValidationError(
        "Requested sample logprobs of 21, which is greater than max allowed: 20",
        parameter="logprobs", value=21))
    assert events == [json.dumps(err.model_dump()), "[DONE]"]
    assert status == 400 and raw == err.model_dump_json()


def test_error_after(vllm):
    async def go(client):
        _, events = await stream(client, body(stream=True, stream_options={
            "include_usage": True}))
        resp = await client.post("/inference/v1/generate", json=body())
        return events, resp.status, await resp.text()
    events, status, raw = run(sim.build_app(QWEN, error_after=2), go)
    err = vllm.create_error_response(vllm.GenerationError())
    check_stream_bytes(vllm, events[:2] + ["[DONE]"])
    assert events[2:] == [json.dumps(err.model_dump()), "[DONE]"]  # json.dumps spacing
    assert status == 500 and raw == err.model_dump_json()


def test_http_error(vllm):
    async def go(client):
        resp = await client.post("/inference/v1/generate", json=body(stream=True))
        return resp.status, await resp.text()
    status, raw = run(sim.build_app(QWEN, http_error=503), go)
    err = vllm.ErrorResponse.model_validate_json(raw)
    assert status == 503 and err.model_dump_json() == raw
    assert (err.error.code, err.error.type) == (503, "ServiceUnavailableError")


BAD_BODIES = [
    '{"sampling_params":{}}', '{"token_ids":[],"sampling_params":{}}',
    '{"token_ids":[1,-2],"sampling_params":{}}', '{"token_ids":[1]}', '{}',
    '{"token_ids":[1],"sampling_params":{"n":0}}',
    '{"token_ids":[1],"sampling_params":{"max_tokens":0}}',
    '{"token_ids":[1],"sampling_params":{"logprobs":-3}}',
    '{"token_ids":[],"sampling_params":{"max_tokens":0}}',
    '{"token_ids":"abc","sampling_params":{}}', '{"token_ids":[1,"x"],"sampling_params":{}}',
    '{"token_ids":[1],"sampling_params":{"n":"x"}}', '{"token_ids":[1],"sampling_params":3}',
    '{"token_ids":[1],"sampling_params":[]}', '{"token_ids":[1],"sampling_params":{"n":null}}',
    '{"token_ids":[1],"sampling_params":{"max_tokens":"a","logprobs":null}}', '',
    'nope', '[1]',
]


def test_validation_errors_match_vllm(vllm):
    async def go(client):
        out = []
        for raw in BAD_BODIES:
            resp = await client.post("/inference/v1/generate", data=raw, headers=JSON)
            out.append((resp.status, await resp.text()))
        resp = await client.post("/inference/v1/generate", data="{}",
                                 headers={"content-type": "text/plain"})
        out.append((resp.status, await resp.text()))
        return out
    got = run(sim.build_app(QWEN), go)
    want = [vllm.oracle.post("/inference/v1/generate", content=raw, headers=JSON)
            for raw in BAD_BODIES]
    want.append(vllm.oracle.post("/inference/v1/generate", content="{}",
                                 headers={"content-type": "text/plain"}))
    for raw, (status, text), expected in zip(BAD_BODIES + ["text/plain"], got, want):
        assert (status, text) == (expected.status_code, expected.text), raw


def test_abort(vllm):
    async def go(client):
        resp = await client.post("/inference/v1/generate", headers={"X-Request-Id": "a1"},
                                 json=body(stream=True, sampling_params={"n": 2},
                                           stream_options={"include_usage": True}))
        first = await resp.content.readuntil(b"\n\n")
        bad = await client.post("/inference/v1/abort_requests", json={"ids": []})
        ok = await client.post("/inference/v1/abort_requests",
                               json={"request_ids": ["a1", "generate-tokens-a1"]})
        assert (bad.status, ok.status, await ok.text()) == (400, 200, "")
        rest = (await resp.read()).decode()
        aborted = await (await client.get("/sim/aborted")).json()
        return [first.decode()[6:-2]] + [f[6:] for f in rest.split("\n\n")[:-1]], aborted
    events, aborted = run(sim.build_app(QWEN, delay=0.2), go)
    chunks = check_stream_bytes(vllm, events)
    assert aborted == ["a1", "generate-tokens-a1"]
    tails = [c.choices[0] for c in chunks[-3:-1]]
    assert [(t.index, t.finish_reason, t.token_ids) for t in tails] == \
        [(0, "abort", []), (1, "abort", [])]
    assert chunks[-1].usage.completion_tokens == sum(
        len(c.choices[0].token_ids) for c in chunks[:-1])


async def held(client, engine_id: str) -> None:
    """Wait until the simulator holds ``engine_id`` (``hold_after``): it has sent what it will send."""
    while engine_id not in (await (await client.get("/sim/stats")).json())["held"]:
        await asyncio.sleep(0.01)


def test_abort_non_stream(vllm):
    """An abort while the request is held after 2 tokens: those 2, finish_reason abort."""
    async def go(client):
        await client.post("/sim/config", json={"hold_after": 2})
        task = asyncio.create_task(client.post("/inference/v1/generate", json=body(
            request_id="q"), headers={}))
        await held(client, "generate-tokens-q")
        await client.post("/inference/v1/abort_requests",
                          json={"request_ids": ["generate-tokens-q"]})
        resp = await task
        return await resp.text()
    res = vllm.p.GenerateTokensResponse.model_validate_json(
        run(sim.build_app(QWEN), go))
    (choice,) = res.choices
    assert choice.finish_reason == "abort" and choice.token_ids == ANSWER[:2]


def test_release_goes_on():
    async def go(client):
        await client.post("/sim/config", json={"hold_after": 3})
        task = asyncio.create_task(client.post("/inference/v1/generate", json=body(request_id="r")))
        await held(client, "generate-tokens-r")
        assert await (await client.post("/sim/release")).json() == {"released": ["generate-tokens-r"]}
        return await (await task).json()
    (choice,) = run(sim.build_app(QWEN), go)["choices"]
    assert choice["token_ids"] == ANSWER and choice["finish_reason"] == "stop"


def test_disconnect_and_per_event_writes():
    """Each event is written as it is made: held after one event, the client has exactly
    that event; leaving then is seen as a disconnect."""
    async def go(client):
        await client.post("/sim/config", json={"hold_after": 1})
        resp = await client.post("/inference/v1/generate", json=body(
            stream=True, request_id="d1"))
        await held(client, "generate-tokens-d1")
        first = b""
        while not first.endswith(b"\n\n"):
            first += await resp.content.readany()
        await asyncio.sleep(0)
        rest = resp.content.read_nowait()  # nothing more was sent
        resp.close()
        while not (gone := await (await client.get("/sim/disconnected")).json()):
            await asyncio.sleep(0.01)
        seen = await (await client.get("/sim/requests")).json()
        return first, rest, gone, seen
    first, rest, gone, seen = run(sim.build_app(QWEN), go)
    assert first.startswith(b"data: {") and first.count(b"data:") == 1
    assert json.loads(first[6:])["choices"][0]["token_ids"] == ANSWER[:1]
    assert rest == b""
    assert gone == ["generate-tokens-d1"]
    assert seen == [body(stream=True, request_id="d1")]


@pytest.mark.parametrize("model,prompt", [
    ("deepseek-r1", "<｜begin▁of▁sentence｜>sys<｜User｜>{}<｜Assistant｜><think>\n"),
    ("gpt-oss", "<|start|>user<|message|>{}<|end|><|start|>assistant"),
    ("qwen3", "no template here: {}"),
])
def test_echo_other_templates(vllm, model, prompt):
    folder = str(MODELS / model)
    tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
    ids = tok.encode(prompt.format("Echo me, please"), add_special_tokens=False).ids

    async def go(client):
        resp = await client.post("/inference/v1/generate", json=body(token_ids=ids))
        return vllm.p.GenerateTokensResponse.model_validate_json(await resp.text())
    (choice,) = run(sim.build_app(folder), go).choices
    eos = json.loads(Path(folder, "config.json").read_text())["eos_token_id"]
    assert choice.token_ids[-1] == eos
    assert tok.decode(choice.token_ids[:-1]).endswith("Echo me, please")


def test_prefix_cache_reports_cached_blocks_and_prefills_the_rest(vllm):
    """The prefix-cache model: a repeated prompt finds its full 16-token blocks (its answer's too,
    for the next turn), reported as vLLM does with --enable-prompt-tokens-details; a prompt that
    shares nothing finds nothing; the prefill wait covers only the tokens not found."""
    first = list(range(1000, 1040))  # 2 full blocks and 8 tokens

    async def go(client):
        out = []

        async def ask(prompt):
            resp = await client.post("/inference/v1/generate", json=body(token_ids=prompt))
            out.append(vllm.p.GenerateTokensResponse.model_validate_json(await resp.text()))
            return out[-1].choices[0].token_ids

        answer = await ask(first)
        await ask(first)
        await ask(first + answer + list(range(5000, 5020)))
        await ask(list(range(7000, 7040)))
        out.append(answer)
        stream = await client.post("/inference/v1/generate", json=body(
            token_ids=first, stream=True, stream_options={"include_usage": True}))
        events = [line[6:] for line in (await stream.text()).split("\n\n") if line.startswith("data: {")]
        out.append(vllm.p.GenerateTokensStreamResponse.model_validate_json(events[-1]))
        return out

    app = sim.build_app(QWEN, prefix_cache_blocks=100, prompt_tokens_details=True)
    cold, warm, next_turn, other, answer, streamed = run(app, go)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (cold, warm, next_turn, other, streamed)]
    # The next turn holds the first prompt and its answer: their full blocks are all cached.
    assert len(first) + len(answer) >= 48
    assert cached == [0, 32, (len(first) + len(answer)) // 16 * 16, 0, 32]


def test_prefix_cache_evicts_the_least_recent_blocks():
    cache = sim.PrefixCache(4)
    a, b = list(range(64)), list(range(100, 164))  # 4 blocks each
    cache.store(a)
    assert cache.cached_tokens(a) == 64
    cache.store(b)  # a's blocks are evicted
    assert cache.cached_tokens(a) == 0 and cache.cached_tokens(b) == 64
    assert cache.cached_tokens(b[:16] + a[16:]) == 16  # a chain: a later block counts only after its parents
    assert sim.PrefixCache(0).cached_tokens(a) == 0


def test_prefill_wait_is_for_uncached_tokens_only():
    """The wait before the first token, at 1 ms per uncached token (no clock: the simulator's
    sleep is replaced by a recorder)."""
    waits = []
    real_sleep = asyncio.sleep

    async def recorded(seconds, *args):
        if seconds >= 0.01:
            waits.append(round(seconds, 6))
        await real_sleep(0)

    prompt = list(range(2000, 2064))  # 4 blocks

    async def go(client):
        for _ in range(2):
            await (await client.post("/inference/v1/generate", json=body(token_ids=prompt))).read()

    asyncio.sleep = recorded
    try:
        run(sim.build_app(QWEN, prefix_cache_blocks=100, prefill_us_per_token=1000), go)
    finally:
        asyncio.sleep = real_sleep
    assert waits == [0.064]  # the second time, every block was cached: no wait


def test_cli_arguments():
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    args = parser.parse_args(["--model", QWEN, "--tokens-per-event", "random:3",
                              "--finish-only-tail", "--error-after", "4"])
    assert (args.host, args.port, args.mode, args.delay) == ("127.0.0.1", 8100, "echo", 0.0)
    assert args.tokens_per_event == "random:3" and args.finish_only_tail
    assert args.error_after == 4 and args.http_error is None


def output_processor_events(steps: list[int], interval: int) -> list[int]:
    """vLLM's own OutputProcessor with SamplingParams.stream_interval: tokens per event it sends
    for engine steps of these sizes (the oracle for the simulator's stream_interval)."""
    import time

    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

    processor = OutputProcessor(None, log_stats=False)
    params = SamplingParams(max_tokens=1000, output_kind=RequestOutputKind.DELTA, stream_interval=interval,
                            detokenize=False)
    request = EngineCoreRequest("r", PROMPT, None, params, None, time.time(), None, None, None)
    request.external_req_id = "r"
    queue = RequestOutputCollector(params.output_kind, "r")
    processor.add_request(request, None, None, 0, queue)
    events, token = [], 100
    for i, n in enumerate(steps):
        finish = FinishReason.STOP if i == len(steps) - 1 else None
        processor.process_outputs([EngineCoreOutput(request_id="r", new_token_ids=list(range(token, token + n)),
                                                     finish_reason=finish)])
        token += n
        out = queue.get_nowait()
        if out is not None:
            events.append(len(out.outputs[0].token_ids))
    return events


@pytest.mark.parametrize("tokens_per_event", [1, "random:7", "random:11"])
@pytest.mark.parametrize("interval", [2, 3, 4, 8])
def test_stream_interval_sends_the_events_vllms_output_processor_sends(vllm, interval, tokens_per_event):
    """sampling_params.stream_interval N (the filter's --stream-interval): the engine steps the
    simulator would send one by one are grouped as vLLM's OutputProcessor groups them."""
    async def go(client, sp):
        return await stream(client, body(stream=True, sampling_params=sp))
    _, events = run(sim.build_app(QWEN, tokens_per_event=tokens_per_event), lambda c: go(c, {}))
    steps = [len(c.choices[0].token_ids) for c in check_stream_bytes(vllm, events)]
    _, events = run(sim.build_app(QWEN, tokens_per_event=tokens_per_event), lambda c: go(c, {"stream_interval": interval}))
    chunks = check_stream_bytes(vllm, events)
    assert [len(c.choices[0].token_ids) for c in chunks] == output_processor_events(steps, interval)
    assert tokens_by_choice(chunks) == {0: ANSWER}
    if tokens_per_event == 1:  # one token per step: fewer events than steps
        assert len(chunks) < len(steps)


def test_lockstep_steps_every_request_at_once(vllm):
    """--lockstep: one engine step for every request at once, as one GPU decodes its batch; without
    it each request waits a whole delay from its own arrival. The second of two streams starts half
    a step after the first's first event: in lockstep its first event comes at a shared step, beside
    one of the first's, and so does each of its events. (Not when the step comes: on a busy machine
    the request can reach the simulator after the next step, and wait for the one after it.)"""
    delay = 0.2

    async def arrivals(client, started: asyncio.Event | None = None) -> tuple[float, list[float]]:
        loop = asyncio.get_running_loop()
        begin = loop.time()
        resp = await client.post("/inference/v1/generate", json=body(stream=True))
        assert resp.status == 200
        times = []
        async for line in resp.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                times.append(loop.time())
                if started:
                    started.set()
        return begin, times

    async def two(client) -> tuple[float, float]:
        started = asyncio.Event()
        first = asyncio.ensure_future(arrivals(client, started))
        await started.wait()  # the first's phase: its first event
        await asyncio.sleep(delay / 2)
        (_, a), (begin, b) = await asyncio.gather(first, arrivals(client))
        assert len(a) == len(b) == len(ANSWER)
        gaps = [min(abs(t - s) for s in a) for t in b]
        return b[0] - begin, gaps[0], sorted(gaps)[len(gaps) // 2]

    wait, _, _ = run(sim.build_app(QWEN, delay=delay), two)
    assert wait >= delay  # its own timer: a whole delay before its first event
    wait, first, gap = run(sim.build_app(QWEN, delay=delay, lockstep=True), two)
    assert first < delay / 8 and gap < delay / 8, (wait, first, gap)  # the shared steps


@pytest.fixture
def engine_steps(monkeypatch):
    """The simulator's engine module with its steps' sleeps recorded, not slept (each lets every woken
    task run on, as a step's time would): (module, the seconds asked in order, the real sleep)."""
    from derender.sim import engine as engine_module

    slept = []
    real_sleep = asyncio.sleep

    async def recorded(seconds, *args):
        slept.append(round(seconds, 6))
        for _ in range(20):
            await real_sleep(0)

    monkeypatch.setattr(engine_module.asyncio, "sleep", recorded)
    return engine_module, slept, real_sleep


def test_prefill_chunks_share_the_decode_steps_and_stretch_them(engine_steps):
    """--max-num-batched-tokens (vLLM's chunked prefill): each step computes one token per decoding
    sequence and a chunk of the waiting prompts with the rest of the budget, first come first served;
    a step lasts the decode step plus its prompt tokens' time. The steps' sleeps are recorded, not slept."""
    engine_module, slept, real_sleep = engine_steps

    async def go():
        engine = engine_module.Engine(100, 1000.0)  # 100 tokens a step, 1 ms per prompt token
        done = []

        async def decode(name):
            with engine.running(1):
                for _ in range(6):
                    await engine.step(1, 0.01)
            done.append(name)

        async def prefill(name, tokens):
            await engine.prefill(tokens, 0.01)
            done.append((name, engine.done))

        await asyncio.gather(decode("a"), decode("b"), prefill("p", 250), prefill("q", 30))
        return engine, done

    engine, done = asyncio.run(go())
    # Two sequences decode: 98 prompt tokens a step; p's 250 take three steps (98, 98, 54), q's 30 share
    # the third (54 + 30 = 84), then the steps are the decode step alone.
    assert slept == [0.108, 0.108, 0.094, 0.01, 0.01, 0.01]
    assert ("p", 3) in done and ("q", 3) in done and done[-2:] == ["a", "b"]
    assert engine.stats() == {"budget": 100, "steps": 6, "prefill_steps": 3, "prompt_tokens": 280,
                              "prefill_seconds": 0.28, "waiting_prompts": 0}


def test_a_prompt_whose_client_left_is_no_longer_prefilled(engine_steps):
    engine_module, slept, real_sleep = engine_steps

    async def go():
        engine = engine_module.Engine(100, 1000.0)
        task = asyncio.ensure_future(engine.prefill(1000, 0.0))
        await real_sleep(0)
        await real_sleep(0)  # the first chunk's step is under way
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.step(2, 0.0)  # the step under way, then one more
        return engine

    engine = asyncio.run(go())
    # The chunk under way when the client left is computed; the next step has none of that prompt.
    assert slept == [0.1, 0.0] and engine.prompt_tokens == 100 and engine.stats()["waiting_prompts"] == 0
