"""Streaming chat completions end to end: the openai SDK -> real Envoy 1.40 -> filter -> simulator.

Expected text always comes from the tokenizer decoding the whole token sequence,
never from the filter's own output.
"""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest

from stack import http_get, wait_for

IM_END = 151645
TEXT = "Robot: 🤖 done. 你好，世界！Ünïcödé ✓ — naïve café 🧑‍🚀🚀"


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    return events


def stream_text(client, **kw) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hi"}], stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_echo_mode_plain_ascii(sim, client, qwen3_tokenizer):
    sim.sim_config(mode="echo")
    message = "The quick brown fox jumps over the lazy dog, 12 times."
    chunks = list(client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": message}], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == qwen3_tokenizer.decode(encode(qwen3_tokenizer, message))
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_multibyte_characters_are_split_across_tokens(qwen3_tokenizer):
    """Precondition for the next test: some tokens are incomplete UTF-8 on their own."""
    ids = encode(qwen3_tokenizer, TEXT)
    assert any("\ufffd" in qwen3_tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("tokens_per_event", [1, 2, 3, "random:7"])
@pytest.mark.parametrize("split_writes", [1, 5])
def test_cjk_and_emoji_across_events_and_writes(sim, client, script, qwen3_tokenizer, tokens_per_event, split_writes):
    ids = encode(qwen3_tokenizer, TEXT)
    script.set({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    sim.sim_config(tokens_per_event=tokens_per_event, split_writes=split_writes)
    text, chunks = stream_text(client)
    assert text == qwen3_tokenizer.decode(ids)
    assert all("\ufffd" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_non_streaming(sim, client, script, qwen3_tokenizer):
    ids = encode(qwen3_tokenizer, TEXT)
    script.set({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    r = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hi"}])
    assert r.object == "chat.completion"
    assert r.choices[0].message.content == qwen3_tokenizer.decode(ids)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(ids) + 1
    prompt = sim.sim_requests()[-1]["token_ids"]
    assert r.usage.prompt_tokens == len(prompt)


def test_non_streaming_with_a_stop_string_through_the_sdk(sim, client, script, qwen3_tokenizer):
    """Streamed from the producer (the filter stops it there), one chat.completion to the client."""
    ids = encode(qwen3_tokenizer, "The answer is 42. END and then much more text that never arrives")
    script.set({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    r = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hi"}], stop=["END"])
    assert sim.sim_requests()[-1]["stream"] is True
    assert r.object == "chat.completion"
    assert r.choices[0].message.content == "The answer is 42. "
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(sim.sim_requests()[-1]["token_ids"])


def test_framing_role_usage_and_done(sim, script, qwen3_tokenizer):
    ids = encode(qwen3_tokenizer, "Hello there")
    script.set({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", sim.base_url + "/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(ids) + 1
    finals = [e for e in events[1:-2] if e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "stop"
    assert "<|im_end|>" not in "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:-2])


def test_finish_only_tail_and_length(sim, client, script, qwen3_tokenizer):
    ids = encode(qwen3_tokenizer, "one two three four five")
    script.set({"index": 0, "token_ids": ids, "finish_reason": "length", "stop_reason": None})
    sim.sim_config(finish_only_tail=True)
    text, chunks = stream_text(client)
    assert text == qwen3_tokenizer.decode(ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_max_tokens_cuts_the_answer(sim, client, script, qwen3_tokenizer):
    ids = encode(qwen3_tokenizer, "one two three four five six seven")
    script.set({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    text, chunks = stream_text(client, max_tokens=3)
    assert text == qwen3_tokenizer.decode(ids[:3])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert sim.sim_requests()[-1]["sampling_params"]["max_tokens"] == 3


# -- bad input: an OpenAI error with the right status, nothing forwarded -----------------
def _post_raw(stack, data: bytes, headers=None) -> httpx.Response:
    return httpx.post(stack.base_url + "/chat/completions", content=data, headers={"content-type": "application/json", **(headers or {})}, timeout=30)


@pytest.mark.parametrize(
    "data, status",
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (json.dumps({"model": "qwen3"}).encode(), 400),  # no messages
        (json.dumps({"model": "qwen3", "messages": "hi"}).encode(), 400),
        (json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(), 400),
        (json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "n": 0}).encode(), 400),
        (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404),
        (json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "word " * 5000}]}).encode(), 400),
    ],
    ids=["invalid-json", "not-an-object", "no-messages", "messages-wrong-type", "wrong-type", "n-zero", "unknown-model", "prompt-too-long"],
)
def test_bad_input_is_refused_before_the_producer(sim, data, status):
    before = sim.sim_received()
    r = _post_raw(sim, data)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    assert sim.sim_received() == before


def test_unknown_model_message_matches_vllm(sim, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert "gpt-4" in str(info.value)


def test_producer_endpoint_is_not_exposed(sim):
    before = sim.sim_received()
    r = httpx.post(sim.envoy_url + "/inference/v1/generate", json={"token_ids": [1, 2, 3]}, timeout=10)
    assert r.status_code == 404
    assert "error" in r.json()
    assert sim.sim_received() == before


# What a plain `vllm serve` of this model answers and the filter does not (the README's list).
NOT_SERVED = [("GET", "/version"), ("GET", "/load"), ("GET", "/metrics"), ("POST", "/v1/chat/completions/render"),
              ("POST", "/v1/completions/render"), ("POST", "/v1/load_lora_adapter"), ("POST", "/reset_prefix_cache"),
              ("POST", "/sleep"), ("POST", "/v1/embeddings")]


@pytest.mark.parametrize("method, path", NOT_SERVED)
def test_what_is_not_served_is_an_openai_404(sim, method, path):
    before = sim.sim_received()
    r = httpx.request(method, sim.envoy_url + path, json={"model": "qwen3"}, timeout=10)
    assert r.status_code == 404
    assert r.json() == {"error": {"message": f"Route {method} {path} is not served here", "type": "NotFoundError",
                                  "param": None, "code": 404}}
    assert sim.sim_received() == before


def test_image_input_to_a_text_model_is_vllms_400(sim, qwen3_dir):
    """Image parts for the text-only Qwen3: the 400 vLLM's own chat server gives, before any producer."""
    from reference import CoupledChat, Step

    png = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAA"
           "AABJRU5ErkJggg==")
    body = {"model": "qwen3", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": png}}]}]}
    before = sim.sim_received()
    r = httpx.post(sim.envoy_url + "/v1/chat/completions", json=body, timeout=30)
    assert sim.sim_received() == before
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    try:  # vLLM's chat server raises; its app's exception handler answers with this
        CoupledChat(qwen3_dir, "--served-model-name", "qwen3", "--max-model-len", "4096").run(body, [Step(0, [])])
    except ValueError as exc:
        coupled = create_error_response(exc)
    assert r.status_code == coupled.error.code == 400
    assert r.json() == coupled.model_dump()


def test_a_400_keeps_the_keep_alive_connection(sim):
    """Bad input costs the client no reconnect: the 400, then the next request on the same
    connection is served (Envoy closed it after every 400 before)."""
    host, port = sim.envoy_url.removeprefix("http://").split(":")
    bad = b"{not json"
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        reader = conn.makefile("rb")
        statuses = []
        for request in (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(bad), bad),
                        b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"):
            conn.sendall(request)
            status = reader.readline().split()[1]
            headers = {}
            while (line := reader.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode().partition(":")
                headers[key.strip().lower()] = value.strip()
            assert headers.get("connection") != "close", headers
            reader.read(int(headers["content-length"]))
            statuses.append(int(status))
    assert statuses == [400, 200]


def test_models_and_health(sim, client):
    assert [m.id for m in client.models.list().data] == ["qwen3"]
    assert http_get(sim.envoy_url + "/health")[0] == 200


# -- producer faults ------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [True, False])
def test_producer_http_error_keeps_its_status(sim, client, script, qwen3_tokenizer, stream):
    script.set({"index": 0, "token_ids": encode(qwen3_tokenizer, "x") + [IM_END]})
    sim.sim_config(http_error=503)
    with pytest.raises(openai.APIStatusError) as info:
        r = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hi"}], stream=stream)
        if stream:
            list(r)
    assert info.value.status_code == 503
    assert info.value.body and "message" in info.value.body


def test_producer_error_mid_stream(sim, script, qwen3_tokenizer):
    ids = encode(qwen3_tokenizer, "alpha beta gamma delta epsilon zeta eta theta")
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    sim.sim_config(error_after=3)
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", sim.base_url + "/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 500 and error["message"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:-2])
    assert text == qwen3_tokenizer.decode(ids[:3])


def test_producer_unreachable(qwen3_dir):
    from stack import free_port, start_envoy, start_filter

    dead = f"http://127.0.0.1:{free_port()}"
    flt, port = start_filter(["--model", qwen3_dir, "--served-model-name", "qwen3"], dead)
    try:
        envoy, base = start_envoy(port, dead)
        try:
            r = httpx.post(base + "/v1/chat/completions", json={"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
            assert r.status_code == 503
            assert r.json()["error"]["code"] == 503
        finally:
            envoy.stop()
    finally:
        flt.stop()


def test_client_disconnect_aborts_the_producer_request(sim, script, qwen3_tokenizer):
    ids = encode(qwen3_tokenizer, "word " * 300)
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    sim.sim_config(delay=0.02)
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", sim.base_url + "/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        next(lines)
    request_id = first["id"].removeprefix("chatcmpl-")
    wait_for(lambda: f"generate-tokens-{request_id}" in sim.sim_aborted(), "the producer request to be aborted", timeout=10)


def test_client_gone_before_a_non_streaming_answer_aborts_the_producer_request(sim, script, qwen3_tokenizer):
    """The coupled server aborts a request whose client left, streamed or not: so does the filter,
    for an answer that has not come yet (the producer holds it after 2 tokens)."""
    script.set({"index": 0, "token_ids": encode(qwen3_tokenizer, "never seen whole") + [IM_END]})
    sim.sim_config(hold_after=2)
    try:
        host, port = sim.envoy_url.removeprefix("http://").split(":")
        body = json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]}).encode()
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            [engine] = wait_for(sim.sim_held, "the producer holding the request")
        wait_for(lambda: engine in sim.sim_aborted(), "the producer request to be aborted")
        # The simulator lets go of a held request when its hold loop next looks (every 50 ms), after
        # the abort has been recorded: on a busy host /sim/stats can still list it for a moment.
        wait_for(lambda: engine not in sim.sim_held(), "the producer to let the aborted request go")
    finally:
        sim.sim_config()


def test_echo_repeats_the_final_assistant_message(sim, script, qwen3_tokenizer):
    ids = encode(qwen3_tokenizer, " a time")
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    body = {
        "model": "qwen3",
        "messages": [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "echo": True,
        "stream": True,
    }
    with httpx.stream("POST", sim.base_url + "/chat/completions", json=body, timeout=30) as r:
        events = sse_events(r)
    contents = [e["choices"][0]["delta"].get("content") for e in events[1:-1]]
    assert contents[0] == "Once upon"
    assert "".join(c or "" for c in contents) == "Once upon" + qwen3_tokenizer.decode(ids)


def test_max_tokens_equal_to_vllms_default_reaches_the_producer(sim, client, script, qwen3_tokenizer):
    """vLLM drops sampling fields equal to their defaults from its JSON; 16 must still arrive."""
    script.set({"index": 0, "token_ids": encode(qwen3_tokenizer, "x y z") + [IM_END]})
    client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=16)
    assert sim.sim_requests()[-1]["sampling_params"]["max_tokens"] == 16


@pytest.mark.parametrize(
    "data",
    [b"{not json", b"[1, 2]", b'{"model": "qwen3"}', b'{"model": "qwen3", "messages": "hi"}', b"\xff\xfe"],
    ids=["invalid-json", "not-an-object", "no-messages", "messages-wrong-type", "not-utf8"],
)
def test_validation_errors_are_vllms_own(sim, data):
    """The same 400 body as vLLM's own /v1/chat/completions router and error handlers give."""
    import argparse

    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.openai.chat_completion import api_router
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    app = FastAPI()
    app.include_router(api_router.router)
    init_exception_handler(app)
    app.state.args = argparse.Namespace(log_error_stack=False)
    expected = TestClient(app).post("/v1/chat/completions", content=data, headers={"content-type": "application/json"})
    got = _post_raw(sim, data)
    assert (got.status_code, got.json()) == (expected.status_code, expected.json())


def test_a_crash_in_vllms_request_validator_is_a_400_here(sim):
    """`tools: [{}]` with a named `tool_choice`: vLLM's own validator reads `tool["function"]` and its
    KeyError is vLLM's 500. The body is the client's fault: here a 400 naming the field, in the same
    shape, and no producer sees it (docs/parity.md pins the difference)."""
    import argparse

    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.openai.chat_completion import api_router
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    data = json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "tools": [{}],
                       "tool_choice": {"type": "function", "function": {"name": "x"}}}).encode()
    app = FastAPI()
    app.include_router(api_router.router)
    init_exception_handler(app)
    app.state.args = argparse.Namespace(log_error_stack=False)
    vllms = TestClient(app, raise_server_exceptions=False).post(
        "/v1/chat/completions", content=data, headers={"content-type": "application/json"})
    assert vllms.status_code == 500, vllms.text
    before = sim.sim_received()
    got = _post_raw(sim, data)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert (error["type"], error["code"]) == ("BadRequestError", 400)
    assert "'function'" in error["message"]
    assert sim.sim_received() == before


def test_stream_interval_asks_the_producer_for_fewer_events(qwen3_dir, script, qwen3_tokenizer):
    """`--stream-interval 4`, as `vllm serve --stream-interval 4`: every streaming producer request
    asks for an event every 4 tokens (the simulator groups them as vLLM's output processor does);
    the client gets the same text in fewer, larger chunks. A non-streaming request asks nothing."""
    from stack import Stack

    s = Stack(qwen3_dir, ["--served-model-name", "qwen3", "--max-model-len", "4096", "--stream-interval", "4"],
              ["--mode", "script", "--script", str(script.path)]).start()
    try:
        ids = encode(qwen3_tokenizer, TEXT)
        script.set({"index": 0, "token_ids": ids + [IM_END]})
        body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream("POST", s.base_url + "/chat/completions", json=body, timeout=60) as r:
            events = sse_events(r)
        assert s.sim_requests()[-1]["sampling_params"]["stream_interval"] == 4
        content = [e["choices"][0]["delta"].get("content") for e in events if e != "[DONE]" and e["choices"]]
        assert "".join(c or "" for c in content) == qwen3_tokenizer.decode(ids)
        # vLLM's grouping: the first token at once, then every 4 (the last event holds the rest).
        expected_events = 2 + (len(ids) + 1 - 1 + 3) // 4
        assert len([c for c in content if c is not None]) < len(ids) and events[-1] == "[DONE]"
        assert len(events) <= expected_events + 1, (len(events), expected_events)
        r = httpx.post(s.base_url + "/chat/completions", json={**body, "stream": False}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == qwen3_tokenizer.decode(ids)
        assert "stream_interval" not in s.sim_requests()[-1]["sampling_params"]
    finally:
        s.stop()


def test_kv_transfer_params_go_to_the_producer_and_its_answer_back(sim, script, qwen3_tokenizer):
    """Disaggregated prefill: the client's ``kv_transfer_params`` reach the producer's GenerateRequest
    (vLLM's render hoists them), and the producer's own (where its KV blocks wait; the simulator answers
    as a NIXL-connected prefill producer) come back in the answer, where vLLM's coupled server puts the
    engine's: ``kv_transfer_params`` of the chat completion and of the completion."""
    asked = {"do_remote_decode": True, "do_remote_prefill": False}
    script.set({"index": 0, "token_ids": encode(qwen3_tokenizer, "Hi") + [IM_END]})
    for path, body in [("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/completions", {"prompt": "hi there"})]:
        r = httpx.post(sim.base_url + path, timeout=30,
                       json={"model": "qwen3", "max_tokens": 1, "kv_transfer_params": asked, **body})
        assert r.status_code == 200, r.text
        sent = sim.sim_requests()[-1]
        assert sent["kv_transfer_params"] == asked
        got = r.json()["kv_transfer_params"]
        assert got["do_remote_prefill"] is True and got["remote_engine_id"].startswith("derender-sim")
        assert got["remote_request_id"].startswith("generate-tokens-")
        assert got["remote_block_ids"] == [list(range((len(sent["token_ids"]) + 15) // 16))]  # one KV group
    r = httpx.post(sim.base_url + "/chat/completions", timeout=30,
                   json={"model": "qwen3", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["kv_transfer_params"] is None  # a plain request: none, as vLLM answers


@pytest.mark.parametrize("header, body_priority, sent", [("5", 0, 5), ("-2", 3, -2), ("high", 3, 3), (None, 4, 4)])
def test_priority_header_and_session_id_as_vllm_reads_them(sim, script, qwen3_tokenizer, header, body_priority, sent):
    """vLLM's coupled server takes an integer ``X-Vllm-Priority`` header over the body's ``priority``;
    the generate endpoint reads only the body's, so the filter puts the header's there. ``X-Session-ID``
    goes on to the producer as sent, which reads it there."""
    script.set({"index": 0, "token_ids": encode(qwen3_tokenizer, "Hi") + [IM_END]})
    headers = {"x-session-id": "conversation-7", **({"x-vllm-priority": header} if header is not None else {})}
    for path, body in [("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/completions", {"prompt": "hi"})]:
        r = httpx.post(sim.base_url + path, headers=headers, timeout=30,
                       json={"model": "qwen3", "max_tokens": 1, "priority": body_priority, **body})
        assert r.status_code == 200, r.text
        assert sim.sim_requests()[-1]["priority"] == sent
        assert sim.sim_headers()[-1]["x-session-id"] == "conversation-7"


def test_prompt_embeds_get_vllms_400_and_reach_no_producer(sim):
    """The generate wire has no room for prompt embeddings (``token_ids`` needs at least one id): vLLM's
    own answer for a server started without ``--enable-prompt-embeds``, before any producer."""
    before = len(sim.sim_requests())
    r = httpx.post(sim.base_url + "/completions", timeout=30,
                   json={"model": "qwen3", "prompt_embeds": "AAAA", "max_tokens": 2})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("You must set `--enable-prompt-embeds` to input `prompt_embeds`.")
    assert len(sim.sim_requests()) == before
