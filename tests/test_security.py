"""Security, through the real Envoy: API keys, headers the producer must not see, bounded
bodies, and no prompt or completion text in the logs by default."""

from __future__ import annotations

import json
import os
import uuid

import httpx
import openai
import pytest
from stack import start_envoy, start_filter, wait_for

IM_END = 151645
KEYS = ("env-key-1", "env-key-2")


def sim_received(stack) -> int:
    return httpx.get(stack.sim_url + "/sim/stats", timeout=10).json()["received"]


def sim_headers(stack) -> list[dict]:
    return [{k.lower(): v for k, v in h.items()} for h in httpx.get(stack.sim_url + "/sim/headers", timeout=10).json()]


def chat(stream: bool = False, content: str = "hi", **kw) -> dict:
    return {"model": "qwen3", "messages": [{"role": "user", "content": content}], "stream": stream, **kw}


def events_of(data: bytes) -> list:
    return [
        "[DONE]" if b[6:] == "[DONE]" else json.loads(b[6:])
        for b in data.decode().split("\n\n")
        if b.startswith("data: ")
    ]


# -- API keys -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(plain_stack, qwen3_dir):
    """A filter that requires a key (from $DERENDER_API_KEYS) and its Envoy, on the plain stack's producer."""
    os.environ["DERENDER_API_KEYS"] = ",".join(KEYS)
    try:
        flt, port = start_filter(["--model", qwen3_dir, "--served-model-name", "qwen3", "--max-model-len", "4096",
                                  "--workers", "1"], plain_stack.sim_url)
    finally:
        del os.environ["DERENDER_API_KEYS"]
    envoy, base = start_envoy(port, plain_stack.sim_url)
    yield base
    envoy.stop()
    flt.stop()


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", "Basic " + KEYS[0], KEYS[0], "Bearer " + KEYS[0] + "x", "Bearer"],
    ids=["none", "wrong-key", "basic-scheme", "no-scheme", "longer-key", "empty-key"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_request_without_a_valid_key_is_refused_before_the_producer(sim, keyed, authorization, stream):
    sim.sim_config(mode="echo")
    before = sim_received(sim)
    headers = {"authorization": authorization} if authorization else {}
    r = httpx.post(keyed + "/v1/chat/completions", json=chat(stream), headers=headers, timeout=30)
    assert r.status_code == 401
    assert r.json() == {"error": {"message": "Unauthorized", "type": "AuthenticationError", "param": None, "code": 401}}
    assert sim_received(sim) == before


@pytest.mark.parametrize("key", KEYS)
def test_each_key_is_accepted_and_never_forwarded(sim, keyed, key):
    sim.sim_config(mode="echo")
    client = openai.OpenAI(base_url=keyed + "/v1", api_key=key, max_retries=0, timeout=30)
    reply = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hello there"}])
    assert reply.choices[0].message.content == "hello there"
    chunks = list(client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "again"}], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "again"
    assert all("authorization" not in h for h in sim_headers(sim)[-2:])


def test_sdk_reports_a_bad_key_as_an_authentication_error(sim, keyed):
    client = openai.OpenAI(base_url=keyed + "/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 401 and "Unauthorized" in str(info.value)


def test_key_guards_the_v1_paths_only(sim, keyed):
    """As vLLM's --api-key: /v1/... needs the key, /health does not."""
    assert httpx.get(keyed + "/v1/models", timeout=10).status_code == 401
    ok = httpx.get(keyed + "/v1/models", headers={"authorization": "bearer " + KEYS[1]}, timeout=10)  # scheme: any case
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "qwen3"
    assert httpx.get(keyed + "/health", timeout=10).status_code == 200


def test_no_key_configured_means_open(sim):
    """The plain stack has no keys: any Authorization (or none) is served, as by vLLM without --api-key."""
    sim.sim_config(mode="echo")
    for headers in ({}, {"authorization": "Bearer whatever"}):
        r = httpx.post(sim.base_url + "/chat/completions", json=chat(), headers=headers, timeout=30)
        assert r.status_code == 200


def test_key_sources_and_precedence(monkeypatch):
    """--api-key (repeatable) wins over $DERENDER_API_KEYS, as --api-key wins over $VLLM_API_KEY in vLLM."""
    from derender.ops import auth
    from derender.cli import build_parser

    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b"])
    assert args.api_key == ["a", "b"]
    monkeypatch.setenv("DERENDER_API_KEYS", " e1, e2 ,")
    from derender.options import settings

    from_env = auth.ApiKeys(auth.resolve(None))
    assert len(from_env) == 2 and from_env.keys == settings(build_parser().parse_args(["serve"])).api_keys
    assert from_env.check({":path": "/v1/models", "authorization": "Bearer e2"}) is None
    from_flags = auth.ApiKeys(settings(args).api_keys)
    assert len(from_flags) == 2
    assert from_flags.check({":path": "/v1/models", "authorization": "Bearer e1"}).status == 401
    assert from_flags.check({":path": "/v1/models", "authorization": "Bearer b"}) is None
    assert from_flags.check({":path": "/v1/models", ":method": "OPTIONS"}) is None
    # Two sets of keys at once, each checking its own (no process-wide switch).
    assert from_env.check({":path": "/v1/models", "authorization": "Bearer b"}).status == 401
    monkeypatch.delenv("DERENDER_API_KEYS")
    assert auth.resolve(None) == ()
    assert auth.ApiKeys(()).check({":path": "/v1/models"}) is None


# -- headers the producer must not see ------------------------------------------------------
# The client credentials the README promises never reach a producer (named here, not taken from
# the filter's own list, so that a header dropped from that list fails this test).
CREDENTIALS = ("authorization", "cookie", "proxy-authorization", "x-api-key")


@pytest.mark.parametrize("path", ["/chat/completions", "/messages"])
def test_client_credentials_never_reach_the_producer(sim, path):
    sim.sim_config(mode="echo")
    secret = {name: f"secret-{name}-{uuid.uuid4().hex}" for name in CREDENTIALS}
    for stream in (False, True):
        body = chat(stream) if path == "/chat/completions" else {**chat(stream), "max_tokens": 20}
        r = httpx.post(sim.base_url + path, json=body, headers={**secret, "x-request-id": "rid-" + str(stream)}, timeout=30)
        assert r.status_code == 200
    seen = sim_headers(sim)[-2:]
    for headers in seen:
        assert not set(CREDENTIALS) & set(headers), headers
        assert not any(value in json.dumps(headers) for value in secret.values())
    assert [h["x-request-id"] for h in seen] == ["rid-False", "rid-True"]  # other headers do pass


def test_anthropic_clients_authenticate_with_x_api_key(sim, keyed):
    """The anthropic SDK sends its key as x-api-key: the same keys, checked the same way; a wrong
    one gets Anthropic's authentication_error before anything reaches the producer."""
    import anthropic

    sim.sim_config(mode="echo")
    good = anthropic.Anthropic(base_url=keyed, api_key=KEYS[1], max_retries=0, timeout=30)
    reply = good.messages.create(model="qwen3", max_tokens=20, messages=[{"role": "user", "content": "hello there"}])
    assert reply.content[0].text == "hello there"
    assert "x-api-key" not in sim_headers(sim)[-1]
    before = sim_received(sim)
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=keyed, api_key="nope", max_retries=0, timeout=30).messages.create(
            model="qwen3", max_tokens=20, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "Unauthorized"}}
    r = httpx.post(keyed + "/v1/chat/completions", json=chat(), headers={"x-api-key": "nope"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["message"] == "Unauthorized"  # OpenAI shape on OpenAI paths
    assert sim_received(sim) == before


# -- bounded bodies -------------------------------------------------------------------------
def test_request_body_is_bounded(sim):
    before = sim_received(sim)
    big = json.dumps(chat(content="a" * (17 << 20))).encode()  # envoy/local.yaml: 16 MiB
    r = httpx.post(sim.base_url + "/chat/completions", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413
    assert sim_received(sim) == before


def test_streamed_response_event_is_bounded(sim, script, qwen3_tokenizer):
    """A producer line that never ends: the filter stops at 64 MiB with an error event."""
    ids = qwen3_tokenizer.encode("one two three four", add_special_tokens=False).ids
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    sim.sim_config(fault="flood", fault_after=2)
    with httpx.stream("POST", sim.base_url + "/chat/completions", json=chat(True), timeout=120) as r:
        data = r.read()
    events = events_of(data)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 502 and "longer than" in events[-2]["error"]["message"]
    assert "".join(c["delta"].get("content") or "" for e in events[:-2] for c in e["choices"]) == qwen3_tokenizer.decode(ids[:2])
    assert len(data) < 1 << 20  # nothing of the flood reached the client


def test_buffered_response_is_bounded(sim, script, qwen3_tokenizer):
    """A non-streaming producer body beyond Envoy's buffer: a clean error, not unbounded buffering."""
    script.set({"index": 0, "token_ids": qwen3_tokenizer.encode("one", add_special_tokens=False).ids + [IM_END]})
    sim.sim_config(fault="flood")
    r = httpx.post(sim.base_url + "/chat/completions", json=chat(), timeout=120)
    assert r.status_code == 500  # the README: Envoy's buffer limit answers 500
    assert r.json()["error"]["code"] == r.status_code and len(r.content) < 4096
    sim.sim_config(mode="echo")
    assert httpx.post(sim.base_url + "/chat/completions", json=chat(), timeout=30).status_code == 200


# -- logs -----------------------------------------------------------------------------------
def test_no_prompt_or_completion_text_in_logs(sim):
    """The filter logs one line per request (ids, counts, status) and never the text in it."""
    sim.sim_config(mode="echo")
    canary = f"canary-{uuid.uuid4().hex}"
    ids = []
    for stream in (False, True):
        rid = f"log-{uuid.uuid4().hex}"
        r = httpx.post(sim.base_url + "/chat/completions", json=chat(stream, content=f"secret {canary}"), headers={"x-request-id": rid}, timeout=30)
        assert r.status_code == 200
        answer = (
            "".join(c["delta"].get("content") or "" for e in events_of(r.content)[:-1] for c in e["choices"])
            if stream
            else r.json()["choices"][0]["message"]["content"]
        )
        assert canary in answer  # the echo answer carries it too
        ids.append(rid)
    rid = f"log-{uuid.uuid4().hex}"  # a refused request whose error message quotes the input
    bad = {"model": "qwen3", "messages": [{"role": "user", "content": [{"type": "text", "text": canary, "bogus": 1}], "x": {canary: 1}}], "temperature": canary}
    r = httpx.post(sim.base_url + "/chat/completions", json=bad, headers={"x-request-id": rid}, timeout=30)
    assert r.status_code == 400 and canary in r.text  # the client is told what was wrong with its input
    ids.append(rid)
    filter_log, envoy_log = sim.proc("filter").log, sim.proc("envoy").log
    wait_for(lambda: all(i in filter_log.read_text(errors="replace") for i in ids), "every request in the filter's log")
    text = filter_log.read_text(errors="replace")
    assert canary not in text
    assert canary not in envoy_log.read_text(errors="replace")


def test_logs_name_the_client_path_and_a_refused_request_model(sim):
    """Envoy's access log shows the path the client asked for (every producer request is
    rewritten to /inference/v1/generate), and a refused request's log line names its model."""
    sim.sim_config(mode="echo")
    rids = {path: f"path-{uuid.uuid4().hex}" for path in ("/chat/completions", "/messages", "/completions")}
    bodies = {"/chat/completions": chat(), "/messages": {**chat(), "max_tokens": 10},
              "/completions": {"model": "qwen3", "prompt": "hi", "max_tokens": 5}}
    for path, rid in rids.items():
        assert httpx.post(sim.base_url + path, json=bodies[path], headers={"x-request-id": rid}, timeout=30).status_code == 200
    refused = f"refused-{uuid.uuid4().hex}"
    r = httpx.post(sim.base_url + "/chat/completions", json={**chat(), "temperature": "hot"}, headers={"x-request-id": refused}, timeout=30)
    assert r.status_code == 400
    envoy_log, filter_log = sim.proc("envoy").log, sim.proc("filter").log
    wait_for(lambda: all(rid in envoy_log.read_text(errors="replace") for rid in rids.values()), "the access log lines")
    lines = envoy_log.read_text(errors="replace").splitlines()
    for path, rid in rids.items():
        line = next(line for line in lines if rid in line)
        assert f'"POST /v1{path} HTTP/1.1" 200' in line, line
    wait_for(lambda: refused in filter_log.read_text(errors="replace"), "the refused request's log line")
    line = next(line for line in filter_log.read_text(errors="replace").splitlines() if refused in line)
    assert "model=qwen3" in line and "status=400" in line, line
