"""No token lost, none invented, for any split of the producer's byte stream; bad requests refused.

Property tests (hypothesis):
- ``SSEDecoder``: any framing (LF, CRLF, CR, comments, multi-line data) and any
  split of the bytes gives back exactly the events' payloads; an event over the
  bound is an error whatever the split, after the events before it.
- The whole response path of the filter (``ChatExchange.response_chunk``: SSE
  reassembly, per-choice detokenizer and vLLM's chat stream generator), in
  process with vLLM's real objects: for token ids from any text, grouped into
  engine steps any way, n = 1 or 2, cut into body chunks anywhere, each choice's
  content is the tokenizer's decode of the whole id sequence and usage counts
  every token; for ANY ids the client bytes equal those of the unsplit stream.
- Request validation, through the real Envoy: a hypothesis-made body gets a 4xx
  OpenAI error (and nothing reaches the producer) or a valid answer; never a
  5xx, never a hang.
Plus one end-to-end stream whose producer writes one byte at a time.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pydantic_core
import pytest
from derender.translate.sse import SSEDecoder, SSEError
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

IM_END = 151645  # Qwen3's EOS
QWEN3_TOKENS = 151669  # ids the tokenizer knows (special tokens included)


# -- SSE reassembly ---------------------------------------------------------------------------
def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(max(c, 0), len(data)) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:])]


def decode_all(pieces: list[bytes], max_event_bytes: int = 64 << 20) -> list[bytes]:
    decoder = SSEDecoder(max_event_bytes)
    out: list[bytes] = []
    for piece in pieces:
        out += decoder.feed(piece)
    return out + decoder.close()


payload_line = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
sse_event = st.tuples(
    st.lists(payload_line, min_size=1, max_size=3),  # data lines (joined by LF)
    st.sampled_from([b"\n", b"\r\n", b"\r"]),  # line ending
    st.sampled_from([b"data: ", b"data:"]),
    st.booleans(),  # a comment line first
)


def frame(lines: list[bytes], eol: bytes, prefix: bytes, comment: bool) -> bytes:
    head = b": keep-alive" + eol if comment else b""
    return head + b"".join(prefix + line + eol for line in lines) + eol


def data_value(line: bytes, prefix: bytes) -> bytes:
    """What a data line carries: one space after the colon is not part of it."""
    return line[1:] if prefix == b"data:" and line.startswith(b" ") else line


@settings(max_examples=400, deadline=None)
@given(st.lists(sse_event, max_size=8), st.lists(st.integers(0, 2000), max_size=30), st.booleans())
def test_sse_any_split_gives_the_same_events(events, cuts, unterminated_last):
    data = b"".join(frame(*e) for e in events)
    expected = [b"\n".join(data_value(line, prefix) for line in lines) for lines, _, prefix, _ in events]
    expected = [p for p in expected if p]  # an event with empty data is not dispatched (SSE spec)
    if unterminated_last and events:  # a last event without its blank line still counts
        eol = events[-1][1]
        data = data[: -len(eol)]
    assert decode_all(split_at(data, cuts)) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(payload_line, max_size=5), st.integers(1, 300), st.lists(st.integers(0, 3000), max_size=30))
def test_sse_event_bound_holds_for_any_split(before, extra, cuts):
    limit = 256
    data = b"".join(b"data: " + p + b"\n\n" for p in before) + b"data: " + b"x" * (limit + extra)
    decoder = SSEDecoder(limit)
    got: list[bytes] = []
    with pytest.raises(SSEError) as info:
        for piece in split_at(data, cuts):
            got += decoder.feed(piece)
        got += decoder.close()
    assert got + info.value.payloads == [p for p in before if p]
    with pytest.raises(SSEError):  # and it stays failed
        decoder.feed(b"data: more\n\n")


@settings(max_examples=200, deadline=None)
@given(st.lists(payload_line, max_size=4), st.binary(min_size=1, max_size=20), st.lists(st.integers(0, 500), max_size=20))
def test_sse_garbage_line_is_an_error_never_a_lost_event(before, garbage, cuts):
    """Bytes that are not an SSE field, glued to an event, fail the stream instead of hiding it."""
    garbage = garbage.replace(b"\r", b"").replace(b"\n", b"")
    glued = garbage + b"data: {}"
    assume(garbage and not glued.startswith(b":") and glued.partition(b":")[0] not in (b"data", b"event", b"id", b"retry"))
    data = b"".join(b"data: " + p + b"\n\n" for p in before) + glued + b"\n\n"
    decoder = SSEDecoder()
    got: list[bytes] = []
    with pytest.raises(SSEError) as info:
        for piece in split_at(data, cuts):
            got += decoder.feed(piece)
        got += decoder.close()
    assert got + info.value.payloads == [p for p in before if p]


# -- the filter's response path, in process ---------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_model(qwen3_dir):
    from derender.translate.model import Model, ModelSpec

    return Model(ModelSpec(model=qwen3_dir, served_model_name=("qwen3",), max_model_len=4096))


def chat_body(n: int) -> dict:
    return {
        "model": "qwen3",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "n": n,
        "stream_options": {"include_usage": True},
    }


def render(model, n: int):
    from derender.translate.render import render_chat

    return asyncio.run(render_chat(model, json.dumps(chat_body(n)).encode(), None))


@pytest.fixture(scope="module")
def coupled(qwen3_dir):
    """vLLM's own coupled chat server for the same model (its OutputProcessor and detokenizer)."""
    from reference import CoupledChat

    return CoupledChat(qwen3_dir, "--served-model-name", "qwen3", "--max-model-len", "4096")


def engine_steps(choices: list[list[int]], sizes: list[int], finish_only_tail: bool) -> list[tuple[int, list[int], bool]]:
    """(choice index, ids, final) per engine step: ``choices`` grouped by ``sizes`` (cycled),
    interleaved step by step as the engine interleaves them."""
    per_choice = []
    for index, ids in enumerate(choices):
        groups, at, k = [], 0, 0
        while at < len(ids):
            size = sizes[k % len(sizes)] if sizes else 1
            groups.append(ids[at : at + size])
            at, k = at + size, k + 1
        steps = [(index, g, False) for g in groups]
        if finish_only_tail or not steps:
            steps.append((index, [], True))
        else:
            steps[-1] = (index, groups[-1], True)
        per_choice.append(steps)
    return [steps[t] for t in range(max(len(s) for s in per_choice)) for steps in per_choice if t < len(steps)]


def producer_stream(choices: list[list[int]], sizes: list[int], finish_only_tail: bool) -> bytes:
    """vLLM's token events for ``choices`` (ids ending in EOS) by ``engine_steps``, then usage and [DONE]."""
    frames = []
    for index, ids, final in engine_steps(choices, sizes, finish_only_tail):
        choice = {"index": index, "finish_reason": "stop" if final else None, "stop_reason": None,
                  "token_ids": ids, "routed_experts": None, "sampling_mask": None,
                  "weight_versions": None, "logprobs": None}
        chunk = {"request_id": "generate-tokens-p", "usage": None, "output_mode": "tokens", "choices": [choice]}
        frames.append(pydantic_core.to_json(chunk))
    total = sum(len(ids) for ids in choices)
    usage = {"prompt_tokens": 9, "total_tokens": 9 + total, "completion_tokens": total}
    frames.append(pydantic_core.to_json({"request_id": "generate-tokens-p", "usage": usage, "output_mode": "tokens", "choices": []}))
    frames.append(b"[DONE]")
    return b"".join(b"data: " + f + b"\n\n" for f in frames)


class NoAborts:
    """A producer client that fails the test if anything asks it to abort."""

    stall_timeout = 240.0

    def abort_soon(self, request_id: str, why: str, upstream: str | None = None) -> None:
        raise AssertionError(f"abort asked for {request_id}: {why}")


def through_filter(model, rendered, pieces: list[bytes]) -> bytes:
    """The filter's response path for one stream, fed these body chunks as Envoy would."""
    from derender.endpoints.chat import ChatExchange

    exchange = ChatExchange(model, NoAborts(), None)  # nothing may need aborting here
    exchange.rendered = rendered
    assert not exchange.response_headers(200).buffer

    async def chunks() -> list[bytes]:
        return [await exchange.response_chunk(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]

    return b"".join(asyncio.run(chunks()))


def client_events(data: bytes) -> list:
    events = []
    for block in data.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[6:]
            events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    return events


def normalized(events: list) -> list:
    return [e if e == "[DONE]" else {k: v for k, v in e.items() if k != "created"} for e in events]


def contents(events: list, n: int) -> list[str]:
    texts = [""] * n
    for e in events:
        if e != "[DONE]":
            assert "error" not in e, e
            for c in e["choices"]:
                texts[c["index"]] += c["delta"].get("content") or ""
    return texts


text = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("abc XYZ.,!?\n\t你好世界こんにちは🤖🚀👍🏽🧑\u200d🚀éüñ\u0301مرحباनमस्ते")),
        st.characters(exclude_categories=("Cs",)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    texts=st.lists(text, min_size=1, max_size=2),
    sizes=st.lists(st.integers(1, 5), max_size=6),
    finish_only_tail=st.booleans(),
    data=st.data(),
)
def test_no_token_lost_or_invented_for_any_split(qwen3_model, qwen3_tokenizer, texts, sizes, finish_only_tail, data):
    ids = [qwen3_tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    assume(all(ids))
    stream = producer_stream([i + [IM_END] for i in ids], sizes, finish_only_tail)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=60), label="cuts")
    rendered = render(qwen3_model, len(ids))
    events = client_events(through_filter(qwen3_model, rendered, split_at(stream, cuts)))
    assert events[-1] == "[DONE]"
    assert contents(events, len(ids)) == [qwen3_tokenizer.decode(i) for i in ids]
    assert events[-2]["usage"]["completion_tokens"] == sum(len(i) + 1 for i in ids)
    finals = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
    assert finals == ["stop"] * len(ids)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ids=st.lists(st.lists(st.integers(0, QWEN3_TOKENS - 1), min_size=1, max_size=25), min_size=1, max_size=2),
    sizes=st.lists(st.integers(1, 4), max_size=5),
    data=st.data(),
)
def test_any_ids_any_split_same_bytes_as_unsplit(qwen3_model, coupled, ids, sizes, data):
    """Arbitrary ids (special tokens, half characters): the split never changes what the client gets,
    and each choice's text is what vLLM's coupled server sends for the same ids."""
    stream = producer_stream([i + [IM_END] for i in ids], sizes, False)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=80), label="cuts")
    rendered = render(qwen3_model, len(ids))
    whole = client_events(through_filter(qwen3_model, rendered, [stream]))
    split = client_events(through_filter(qwen3_model, rendered, split_at(stream, cuts)))
    assert normalized(split) == normalized(whole)
    assert whole[-1] == "[DONE]" and whole[-2]["usage"]["completion_tokens"] == sum(len(i) + 1 for i in ids)
    # And what it gets is what vLLM's coupled server sends for the same engine steps.
    from reference import Step

    steps = [Step(index, list(step_ids), "stop" if final else None)
             for index, step_ids, final in engine_steps([i + [IM_END] for i in ids], sizes, False)]
    theirs, _ = coupled.run(chat_body(len(ids)), steps)
    assert contents(whole, len(ids)) == contents(theirs, len(ids))


def test_one_byte_at_a_time_in_process(qwen3_model, qwen3_tokenizer):
    ids = qwen3_tokenizer.encode("Robot: 🤖 done. 你好，世界！🧑‍🚀", add_special_tokens=False).ids
    stream = producer_stream([ids + [IM_END]], [1, 2], False)
    rendered = render(qwen3_model, 1)
    bytewise = client_events(through_filter(qwen3_model, rendered, split_at(stream, list(range(len(stream))))))
    whole = client_events(through_filter(qwen3_model, rendered, [stream]))
    assert normalized(bytewise) == normalized(whole)
    assert contents(bytewise, 1) == [qwen3_tokenizer.decode(ids)]


# -- end to end: a producer that writes one byte at a time ------------------------------------
def test_one_byte_writes_through_envoy(sim, script, qwen3_tokenizer):
    ids = qwen3_tokenizer.encode("Robot: 🤖 你好！", add_special_tokens=False).ids
    script.set({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    sim.sim_config(split_writes=1 << 20)  # every event written byte by byte
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", sim.base_url + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = client_events(r.read())
    assert events[-1] == "[DONE]"
    assert contents(events, 1) == [qwen3_tokenizer.decode(ids)]
    assert events[-2]["usage"]["completion_tokens"] == len(ids) + 1


# -- request validation fuzz, through Envoy ---------------------------------------------------
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=12))
json_value = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
def mostly(valid, *bad):
    """Usually a valid value, sometimes a wrong one: requests with several fields still get served."""
    return st.one_of(valid, valid, valid, *(bad or (json_value,)))


valid_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["x", "get_weather"])},
    optional={"parameters": st.just({"type": "object", "properties": {"x": {"type": "string"}}}),
              "description": st.text(max_size=10)})})
bad_tool = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "retrieval"]) | json_value,
     "function": st.fixed_dictionaries({"name": st.text(max_size=8) | json_value},
                                       optional={"parameters": json_value})},
)
message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "system", "assistant"]), st.sampled_from(["tool", "developer", "wizard"]), json_value),
     "content": mostly(st.text(min_size=1, max_size=30), json_value)},
    optional={"name": st.text(max_size=5)},
)
wild_request = st.fixed_dictionaries(
    {"model": mostly(st.just("qwen3"), st.text(max_size=6), json_value),
     "messages": mostly(st.lists(message, min_size=1, max_size=3), st.just([]), json_value)},
    optional={
        "stream": mostly(st.booleans()),
        "max_tokens": mostly(st.integers(1, 8), st.integers(-3, 0), st.sampled_from([4096, 10**9]), json_value),
        "max_completion_tokens": mostly(st.integers(1, 8), st.integers(-3, 0), json_value),
        "n": mostly(st.integers(1, 3), st.sampled_from([-1, 0, 10**9, "2", 1.5, None])),  # a producer refuses 257..16384 itself
        "temperature": mostly(st.floats(0, 2), st.floats(allow_nan=False), json_value),
        "top_p": mostly(st.floats(0.01, 1), st.floats(-1, 2), json_value),
        "stop": mostly(st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1, max_size=5), max_size=3)),
        "logprobs": mostly(st.booleans()),
        "top_logprobs": mostly(st.integers(0, 20), st.integers(-2, 25), json_value),
        "tools": mostly(st.lists(valid_tool, min_size=1, max_size=2), st.lists(bad_tool, min_size=1, max_size=2), json_value),
        "tool_choice": mostly(st.sampled_from(["none", "required"]), st.sampled_from(["auto", "sometimes"]),
                              st.just({"type": "function", "function": {"name": "x"}}), json_value),
        "response_format": mostly(st.sampled_from([{"type": "text"}, {"type": "json_object"}]), st.just({"type": "xml"}), json_value),
        "stream_options": mostly(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
        "seed": mostly(st.integers(0, 2**31), st.integers(-(2**65), 2**65), json_value),
        "chat_template_kwargs": mostly(st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()})),
        "reasoning_effort": mostly(st.sampled_from(["low", "medium", "high"]), st.just("extreme"), json_value),
        "unknown_field": json_value,
    },
)


@st.composite
def valid_request(draw) -> dict:
    """A coherent request with a random subset of the options: most of these are served."""
    text = st.text(min_size=1, max_size=30)
    messages = draw(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "assistant"]), "content": text}), max_size=2))
    body: dict = {"model": "qwen3", "messages": [*messages, {"role": "user", "content": draw(text)}]}
    body["stream"] = stream = draw(st.booleans())
    if stream and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    options = {
        "max_tokens": st.integers(1, 8), "n": st.integers(1, 3), "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1), "stop": st.lists(st.text(min_size=1, max_size=5), max_size=3),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
        "seed": st.integers(0, 2**31), "chat_template_kwargs": st.fixed_dictionaries({"enable_thinking": st.booleans()}),
        "reasoning_effort": st.sampled_from(["low", "medium", "high"]), "unknown_field": json_scalar,
    }
    for name, values in options.items():
        if draw(st.booleans()):
            body[name] = draw(values)
    if draw(st.booleans()):
        body["logprobs"], body["top_logprobs"] = True, draw(st.integers(0, 20))
    if draw(st.booleans()):
        body["tools"] = draw(st.lists(valid_tool, min_size=1, max_size=2))
        body["tool_choice"] = draw(st.sampled_from(["none", {"type": "function", "function": {"name": body["tools"][0]["function"]["name"]}}]))
    return body


request = st.one_of(valid_request(), wild_request)


def mangle(raw: bytes, how: int, at: int) -> bytes:
    """Byte-level damage: truncated, invalid UTF-8, deep nesting, or left alone."""
    at = at % (len(raw) + 1)
    if how == 1:
        return raw[:at]
    if how == 2:
        return raw[:at] + b"\xff\xfe" + raw[at:]
    if how == 3:
        return b'{"model":"qwen3","messages":' + b"[" * 5000 + b"]" * 5000 + b"}"
    return raw


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=request, how=st.sampled_from([0, 0, 0, 1, 2, 3]), at=st.integers(0, 10**6))
@example(body={"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "sometimes",
               "tools": [{"type": "function", "function": {"name": "x", "parameters": {}}}]}, how=0, at=0)
@example(body={"model": "qwen3", "messages": [], "stream": False, "tools": [{}],  # vLLM's validator: KeyError
               "tool_choice": {"type": "function", "function": {"name": "x"}}}, how=0, at=0)
def test_request_fuzz_is_refused_cleanly_or_served(sim, body, how, at):
    sim.sim_config(mode="echo")
    raw = mangle(json.dumps(body).encode(), how, at)
    before = sim.sim_received()
    with httpx.Client(timeout=60) as http:
        r = http.post(sim.base_url + "/chat/completions", content=raw, headers={"content-type": "application/json"})
        data = r.read()
    assert r.status_code < 500, (r.status_code, data[:500])
    event(f"status {r.status_code}")
    if r.status_code >= 400:
        error = json.loads(data)["error"]
        assert error["code"] == r.status_code and isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and error["type"]
        assert sim.sim_received() == before, "a refused request reached the producer"
        return
    assert r.status_code == 200
    if r.headers["content-type"].startswith("text/event-stream"):
        events = client_events(data)
        assert events and events[-1] == "[DONE]"
        assert all(e.get("object") == "chat.completion.chunk" for e in events[:-1]), events
    else:
        assert json.loads(data)["object"] == "chat.completion"
    assert sim.sim_received() == before + 1
