"""What the real-engine tests compare (``tests/test_real_vllm.py``, ``tests/test_real_handoff.py``): a chat
answer asked of the engine's own coupled server and through Envoy + the filter, the fields that must
match, a stream put together, and the engine's log of its producer endpoint's calls."""

from __future__ import annotations

import json

import httpx

# How the engine logs a call of its producer endpoint.
GENERATE_LOG = '"POST /inference/v1/generate HTTP/1.1" 200'


def ask(base: str, body: dict):
    """POST a chat completion; the JSON answer, or the list of SSE events (without [DONE])."""
    with httpx.Client(timeout=120) as client:
        r = client.post(base + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(x) for x in lines[:-1]]


# What must match. Ids, timestamps and system_fingerprint differ by nature; fields
# that only one vLLM version has (kv_transfer_params, weight_versions, ...) are left out.
CHOICE_KEYS = ("index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids")
MESSAGE_KEYS = ("role", "content", "reasoning", "tool_calls")


def essential(answer: dict) -> dict:
    choices = []
    for c in answer["choices"]:
        message = {k: c["message"].get(k) for k in MESSAGE_KEYS}
        choices.append({**{k: c.get(k) for k in CHOICE_KEYS}, "message": message})
    out = {k: answer.get(k) for k in ("object", "model", "usage", "prompt_token_ids")}
    return {**out, "choices": choices}


def assembled(events: list[dict]) -> dict:
    """A stream put together: per choice its role, text, token ids, logprobs, finish and
    stop reasons; the prompt ids and the final usage. How tokens are grouped into chunks
    is left out: both servers merge engine steps when their reader lags, so it depends
    on timing."""
    choices: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            o = choices.setdefault(c["index"], {"role": None, "content": "", "token_ids": [], "logprobs": [], "finish_reason": None, "stop_reason": None})
            o["role"] = o["role"] or c["delta"].get("role")
            o["content"] += c["delta"].get("content") or ""
            o["token_ids"] += c.get("token_ids") or []
            o["logprobs"] += (c.get("logprobs") or {}).get("content") or []
            if c["finish_reason"]:
                o["finish_reason"], o["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    return {"prompt_token_ids": events[0].get("prompt_token_ids"), "usage": events[-1].get("usage"), "choices": choices}


def generate_calls(engine) -> int:
    proc, _ = engine
    return proc.log.read_text(errors="replace").count(GENERATE_LOG)


def compare(engine, envoy_url: str, body: dict, forgive=None) -> dict:
    """Ask the engine directly and through Envoy + filter; require the same answer. Returns the engine's.

    ``forgive(got, want)``, if given, may make known differences equal before the comparison."""
    _, engine_url = engine
    calls = generate_calls(engine)
    want = ask(engine_url, body)
    got = ask(envoy_url, body)
    # The filter's request really went to the engine's token-in/token-out endpoint.
    assert generate_calls(engine) == calls + 1
    if body.get("stream"):
        got, want = assembled(got), assembled(want)
    if forgive is not None:
        forgive(got, want)
    if body.get("stream"):
        for g, w in zip(got["choices"].values(), want["choices"].values()):
            assert (g["content"], g["token_ids"]) == (w["content"], w["token_ids"])
        assert got == want
    else:
        for g, w in zip(got["choices"], want["choices"]):
            assert (g["message"]["content"], g["token_ids"]) == (w["message"]["content"], w["token_ids"])
        assert essential(got) == essential(want)
    return want
