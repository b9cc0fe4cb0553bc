"""Render-tier mode (``derender serve --render-url``) against the real ``vllm launch render``.

Two filters share one simulator (script mode): the local one (vLLM's objects in the
filter) and the render-tier one (rendering and derendering by vLLM's render server,
Qwen3 with ``qwen3`` + ``hermes``). For the parity suite's Qwen3 cases the same token ids
go through both, and the client streams must fold to the same messages (content,
reasoning, tool calls with their arguments as JSON and ids by shape, finish and stop
reasons, logprobs, usage), as vLLM's own parity test compares its derender path, and
event by event but for what the render tier does differently by design (``events_compared``:
it writes null fields, sends empty deltas as they come and the role with the first delta). A recording proxy between the filter and the
render server checks the protocol itself: one ``stream_state`` per choice index echoed
unchanged, the request and the full prompt ids on every call, the usage event sent and
``[DONE]`` not.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import aiohttp
import httpx
import numpy as np
import pytest
from aiohttp import web
from parity_cases import ANSWERS, CASES, STOP_TEXT, Case, cases_for
from parity_compare import assemble, id_shape
from stack import DERENDER, Proc, free_port, http_get, http_ok, start_envoy, start_sim, tcp_open, wait_for

FLAGS = ["--served-model-name", "qwen3", "--max-model-len", "8192", "--reasoning-parser", "qwen3",
         "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
STOP_CASES = [name for name in cases_for("qwen3") if "stop string" in name]
TIER_CASES = [name for name in cases_for("qwen3") if name not in STOP_CASES]


class Recorder:
    """An HTTP proxy in front of the render server that keeps every /derender call."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.calls: list[tuple[str, dict, int, dict]] = []  # path, request, status, response
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        if "X-Request-Id" in request.headers:
            headers["X-Request-Id"] = request.headers["X-Request-Id"]
        async with self.session.request(request.method, self.target + request.path_qs, data=body, headers=headers) as r:
            data, status, ctype = await r.read(), r.status, r.content_type
        if request.path.endswith("/derender"):
            self.calls.append((request.path, json.loads(body), status, json.loads(data)))
        return web.Response(body=data, status=status, content_type=ctype)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start():
            self.session = aiohttp.ClientSession()
            app = web.Application(client_max_size=64 << 20)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def start(self) -> Recorder:
        self.thread.start()
        return self

    def stop(self) -> None:
        async def close():
            await self.session.close()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Stacks:
    """One simulator; the local stack and the render-tier stack in front of it."""

    def __init__(self, qwen3_dir: str, script) -> None:
        self.script = script
        self.procs: list[Proc] = []
        try:
            self._start(qwen3_dir)
        except Exception:
            self.stop()
            raise

    def _proc(self, name: str, argv: list[str]) -> Proc:
        proc = Proc(name, argv).start()
        self.procs.append(proc)  # stopped by stop() even if it never gets ready
        return proc

    def _start(self, qwen3_dir: str) -> None:
        render_port, local_port, tier_port = free_port(), free_port(), free_port()
        self.render_url = f"http://127.0.0.1:{render_port}"
        self.recorder = Recorder(self.render_url).start()
        render = self._proc("vllm-render", [sys.executable, "-m", "vllm.entrypoints.cli.main", "launch", "render",
                                            qwen3_dir, *FLAGS, "--host", "127.0.0.1", "--port", str(render_port)])
        sim, self.sim_url = start_sim(qwen3_dir, "--mode", "script", "--script", str(self.script.path))
        self.procs.append(sim)
        serve = [*DERENDER, "serve", "--workers", "1", "--producer", self.sim_url]
        local = self._proc("filter", [*serve, "--model", qwen3_dir, *FLAGS, "--port", str(local_port)])
        metrics_port = free_port()
        self.tier_metrics = f"http://127.0.0.1:{metrics_port}/metrics"  # the tier filter's failures are counted
        tier = self._proc("filter-tier", [*serve, "--render-url", self.recorder.url, "--port", str(tier_port),
                                          "--metrics-port", str(metrics_port)])
        for proc, port in ((tier, tier_port), (local, local_port)):  # all of them load at once
            proc.wait(lambda port=port: tcp_open(port), 600)
        render.wait(lambda: http_ok(self.render_url + "/health"), 600)
        # Envoy waits up to MESSAGE_TIMEOUT for each ext_proc answer; this machine is shared.
        envoy, self.local = start_envoy(local_port, self.sim_url, MESSAGE_TIMEOUT="60s")
        self.procs.append(envoy)
        envoy, self.tier = start_envoy(tier_port, self.sim_url, MESSAGE_TIMEOUT="60s")
        self.procs.append(envoy)

    def sim_config(self, **knobs) -> None:
        defaults = {"mode": "script", "tokens_per_event": 1, "delay": 0.0, "finish_only_tail": False, "split_writes": 1}
        r = httpx.post(self.sim_url + "/sim/config", json={**defaults, **knobs}, timeout=10)
        assert r.status_code == 200, r.text

    def sim_requests(self) -> list[dict]:
        return json.loads(http_get(self.sim_url + "/sim/requests")[1])

    def sim_received(self) -> int:
        return json.loads(http_get(self.sim_url + "/sim/stats")[1])["received"]

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        if hasattr(self, "recorder"):
            self.recorder.stop()


@pytest.fixture(scope="module")
def stacks(qwen3_dir, script):
    s = Stacks(qwen3_dir, script)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def answers(qwen3_dir):
    return ANSWERS["qwen3"](qwen3_dir)


# -- the two paths and what is compared -----------------------------------------------------------
def sse(response: httpx.Response) -> list:
    return ["[DONE]" if line == "data: [DONE]" else json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def call(base: str, path: str, body: dict) -> tuple[int, list | dict]:
    if not body.get("stream"):
        r = httpx.post(base + path, json=body, timeout=120)
        return r.status_code, r.json()
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(r.read())
        assert r.headers["content-type"].startswith("text/event-stream")
        return 200, sse(r)


def both(stacks: Stacks, path: str, body: dict) -> tuple[list | dict, list | dict]:
    """The local answer, then the render tier's, for the same scripted generation."""
    answers = []
    for base in (stacks.local, stacks.tier):
        status, result = call(base, path, body)
        assert status == 200, (base, result)
        answers.append(result)
    return answers[0], answers[1]


def f32(value):
    """Floats at float32 precision: the simulator writes logprobs as given (-0.09), the engine path
    goes through float32 (-0.09000000357627869), as a GPU producer's numbers do."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, dict):
        return {k: f32(v) for k, v in value.items()}
    if isinstance(value, list):
        return [f32(v) for v in value]
    return value


def usage(value: dict | None) -> dict | None:
    """The token counts. Left out: null fields (the render tier writes them, the coupled server
    does not) and ``completion_tokens_details``: vLLM's /derender does not count reasoning tokens."""
    if value is None:
        return None
    return {k: v for k, v in value.items() if v is not None and k != "completion_tokens_details"}


def fold(events: list) -> dict:
    """The parity suite's fold of a chat stream; one id per stream, of the coupled server's shape."""
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    ids = {e["id"] for e in events if isinstance(e, dict)}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-"), ids
    folded = f32(assemble(events))
    folded["usage"] = usage(folded["usage"])
    return folded


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def events_compared(events: list) -> list:
    """A chat stream event by event, but for what vLLM's render tier does differently by design.

    Its ``/derender`` answers every producer event, so against the local (coupled) stream it
    (1) writes null fields, (2) sends events with empty deltas (while a parser holds tokens
    back; with ``continuous_usage_stats`` they carry usage), (3) sends the role with the first
    delta instead of alone (the coupled server's role chunk has ``"content": ""`` and, with
    continuous usage, zero completion tokens), and (4) counts no reasoning tokens. So: nulls,
    ids, timestamps and ``completion_tokens_details`` go, ``"content": ""`` goes, events with
    nothing but empty deltas go (usage-only ones but the last too), and a role-only delta is
    merged into the choice's next delta. Everything else (every delta's text, every tool-call
    fragment, logprobs, token ids, finish and stop reasons, the order) must be the same.
    """
    kept: list = []
    for e in events:
        if not isinstance(e, dict):
            kept.append(e)
            continue
        e = _without_nulls({k: v for k, v in e.items() if k not in ("id", "created", "system_fingerprint")})
        choices = []
        for c in e.get("choices", []):
            delta = c.get("delta", {})
            if delta.get("content") == "":
                del delta["content"]
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    call["id"] = id_shape(call["id"])
            if delta or set(c) - {"index", "delta"}:
                choices.append(c)
        if not choices and not e.get("usage"):
            continue
        e["choices"] = choices
        if e.get("usage"):
            e["usage"] = usage(e["usage"])
        kept.append(f32(e))
    usage_only = [i for i, e in enumerate(kept) if isinstance(e, dict) and not e["choices"]]
    kept = [e for i, e in enumerate(kept) if not usage_only or i not in usage_only[:-1]]
    out: list = []
    roles: dict[int, str] = {}
    carried: dict = {}
    for e in kept:
        if not isinstance(e, dict):
            out.append(e)
            continue
        choices = []
        for c in e["choices"]:
            if set(c) == {"index", "delta"} and set(c["delta"]) == {"role"}:
                roles[c["index"]] = c["delta"]["role"]
                continue
            if c["index"] in roles:
                c["delta"] = {"role": roles.pop(c["index"]), **c["delta"]}
            choices.append(c)
        if e["choices"] and not choices:  # a role-only event: what else it says goes with the next one
            carried.update({k: v for k, v in e.items() if k not in ("choices", "usage")})
            continue
        out.append({**carried, **e, "choices": choices})
        carried = {}
    return out


def fold_full(body: dict) -> dict:
    """A non-streaming chat.completion, per choice, with per-run values by shape."""
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    choices = []
    for c in body["choices"]:
        m = c["message"]
        calls = [{"id": id_shape(t["id"]), "name": t["function"]["name"], "arguments": json.loads(t["function"]["arguments"])}
                 for t in m.get("tool_calls") or ()]
        choices.append({"index": c["index"], "role": m["role"], "content": m.get("content"), "reasoning": m.get("reasoning"),
                        "tool_calls": calls, "finish_reason": c["finish_reason"], "stop_reason": c.get("stop_reason"),
                        "logprobs": c.get("logprobs"), "token_ids": c.get("token_ids")})
    return {"choices": f32(choices), "usage": usage(body["usage"])}


def check_shape(case: Case, message: dict) -> None:
    """The case is what it says (no case passes on two empty answers)."""
    e = case.expect
    if "reasoning" in e:
        assert bool(message["reasoning"]) == e["reasoning"], message
    if "tools" in e:
        assert [t["name"] for t in message["tool_calls"]] == e["tools"], message
    if e.get("logprobs"):
        assert message["logprobs"] and any(lp["top_logprobs"] for lp in message["logprobs"])
    assert message["content"] or message["reasoning"] or message["tool_calls"] or e.get("reasoning") is False


def setup_case(stacks: Stacks, case: Case) -> dict:
    stacks.script.set(*case.script())
    stacks.sim_config(finish_only_tail=case.tail, delay=case.delay)
    return {"model": "qwen3", "stream": True, **case.body}


# -- parity: local vs render tier ---------------------------------------------------------------------
@pytest.mark.parametrize("case_name", TIER_CASES)
def test_render_tier_matches_local(stacks, answers, case_name):
    case = CASES[case_name](answers)
    body = setup_case(stacks, case)
    local, tier = both(stacks, "/v1/chat/completions", body)
    sent = stacks.sim_requests()[-2:]
    assert sent[0]["token_ids"] == sent[1]["token_ids"], "the render tier rendered another prompt"
    mine, theirs = fold(local), fold(tier)
    check_shape(case, mine["choices"][0])
    assert len(mine["choices"]) == len(case.choices)
    assert theirs == mine
    assert events_compared(tier) == events_compared(local)

    if case.sdk:
        from openai import OpenAI

        client = OpenAI(base_url=stacks.tier + "/v1", api_key="unused", max_retries=0, timeout=120)
        extra = {k: v for k, v in body.items() if k not in ("model", "messages", "stream", "n", "tools", "stream_options")}
        kwargs = {k: v for k, v in body.items() if k in ("n", "tools", "stream_options")}
        chunks = client.chat.completions.create(model="qwen3", messages=body["messages"], stream=True, extra_body=extra, **kwargs)
        assert fold([c.model_dump(exclude_unset=True) for c in chunks] + ["[DONE]"]) == mine

    if case.full:
        full = {**body, "stream": False}
        full.pop("stream_options", None)
        local, tier = both(stacks, "/v1/chat/completions", full)
        assert fold_full(tier) == fold_full(local)


def test_stream_state_protocol(stacks, answers):
    """What vLLM's streaming derender asks of its client, checked on the wire (n=2, tools, usage)."""
    case = CASES["n=2 interleaved"](answers)
    body = setup_case(stacks, case)
    before = len(stacks.recorder.calls)
    status, events = call(stacks.tier, "/v1/chat/completions", body)
    assert status == 200
    calls = stacks.recorder.calls[before:]
    prompt = stacks.sim_requests()[-1]["token_ids"]
    events_sent = sum(len(c.chunks) for c in case.choices) + 1  # every producer event, the usage one too
    assert len(calls) == events_sent
    last: dict[int, dict] = {}
    for path, request, status, response in calls:
        assert path == "/v1/chat/completions/derender" and status == 200
        assert request["stream"] is True and request["prompt_token_ids"] == prompt
        assert request["chat_request"] == body  # the client's request, on every call
        choices = request["generate_chunk"]["choices"]
        assert len(choices) <= 1
        if not choices:  # the usage event: no choice, no state
            assert request["generate_chunk"]["usage"] and request["stream_state"] is None
            continue
        index = choices[0]["index"]
        assert request["stream_state"] == last.get(index)  # echoed unchanged, one per index
        last[index] = response["stream_state"]
    assert sorted(last) == [0, 1]
    assert not any(r["generate_chunk"] == "[DONE]" for _, r, _, _ in calls)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]


# -- what the render tier refuses, and what it cuts -----------------------------------------------------
def test_streaming_stop_strings_are_refused_before_the_producer(stacks, answers):
    case = CASES[STOP_CASES[0]](answers)
    body = setup_case(stacks, case)
    before = stacks.sim_received()
    status, error = call(stacks.tier, "/v1/chat/completions", body)
    assert status == 400 and "stop strings are not supported by streaming derender" in error["error"]["message"]
    assert stacks.sim_received() == before


def test_non_streaming_stop_strings_are_cut_as_locally(stacks, answers):
    case = CASES[STOP_CASES[0]](answers)
    body = {**setup_case(stacks, case), "stream": False}
    local, tier = both(stacks, "/v1/chat/completions", body)
    mine, theirs = fold_full(local), fold_full(tier)
    assert mine["choices"][0]["stop_reason"] == "STOP" and "three" not in mine["choices"][0]["content"]
    assert "stop" not in stacks.sim_requests()[-1]["sampling_params"] or not stacks.sim_requests()[-1]["sampling_params"]["stop"]
    # The producer generated past the stop string (it is not told them): only usage may differ.
    assert [{**c, "logprobs": None} for c in theirs["choices"]] == [{**c, "logprobs": None} for c in mine["choices"]]


def test_completions_match_local(stacks, answers):
    ids = answers.encode(STOP_TEXT.replace("STOP ", "")) + [151643]
    second = ids[4:]
    stacks.script.set({"index": 0, "token_ids": ids, "chunks": [2] * (len(ids) // 2) + [1] * (len(ids) % 2)},
                      {"index": 1, "token_ids": second, "chunks": [3] * (len(second) // 3) + [1] * (len(second) % 3)})
    stacks.sim_config()
    body = {"model": "qwen3", "prompt": "Count:", "max_tokens": 100, "n": 2, "logprobs": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    local, tier = both(stacks, "/v1/completions", body)

    def texts(events: list) -> dict:
        out: dict[int, dict] = {}
        for e in events[:-1]:
            for c in e["choices"]:
                o = out.setdefault(c["index"], {"text": "", "finish_reason": None, "tokens": [], "top": []})
                o["text"] += c["text"]
                o["finish_reason"] = o["finish_reason"] or c["finish_reason"]
                o["tokens"] += (c.get("logprobs") or {}).get("tokens") or []
                o["top"] += (c.get("logprobs") or {}).get("top_logprobs") or []
        return {"choices": out, "usage": usage(events[-2]["usage"]), "ids": {e["id"] for e in events[:-1]}}

    mine, theirs = f32(texts(local)), f32(texts(tier))
    assert mine["choices"][0]["text"] == answers.tokenizer.decode(ids[:-1])
    assert theirs["ids"] == {next(iter(theirs["ids"]))} and next(iter(theirs["ids"])).startswith("cmpl-")
    del mine["ids"], theirs["ids"]
    assert theirs == mine
    full = {**body, "stream": False}
    full.pop("stream_options")
    local, tier = both(stacks, "/v1/completions", full)
    strip = lambda r: [{"text": c["text"], "finish_reason": c["finish_reason"], "tokens": c["logprobs"]["tokens"]} for c in r["choices"]]
    assert strip(tier) == strip(local) and usage(tier["usage"]) == usage(local["usage"])


def test_default_max_tokens_reaches_the_producer(stacks, answers):
    """vLLM's render JSON leaves out max_tokens when it is 16 (the default); a producer would
    then fill it from max_model_len. Both filters must send 16."""
    ids = answers.encode("one two three four five six seven eight nine ten " * 3) + [151643]
    assert len(ids) > 16
    stacks.script.set({"index": 0, "token_ids": ids})
    stacks.sim_config()
    local, tier = both(stacks, "/v1/completions", {"model": "qwen3", "prompt": "Count:"})
    assert [r["sampling_params"].get("max_tokens") for r in stacks.sim_requests()[-2:]] == [16, 16]
    assert tier["choices"][0]["text"] == local["choices"][0]["text"] == answers.tokenizer.decode(ids[:16])
    assert tier["choices"][0]["finish_reason"] == local["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/v1/completions", {"model": "qwen3", "prompt": ["one", "two"]}, 400),
        ("/v1/completions", {"model": "qwen3", "prompt": "hi", "echo": True}, 400),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404),
        ("/v1/chat/completions", {"model": "qwen3", "messages": "hi"}, 400),
    ],
    ids=["two-prompts", "echo", "unknown-model", "invalid"],
)
def test_refusals(stacks, path, body, status):
    before = stacks.sim_received()
    got, error = call(stacks.tier, path, body)
    assert got == status and error["error"]["code"] == status and error["error"]["message"]
    if path == "/v1/chat/completions":  # the same answer from either side
        local_status, local_error = call(stacks.local, path, body)
        assert local_status == got and local_error["error"]["param"] == error["error"]["param"]
        if status == 404:
            assert local_error == error
    assert stacks.sim_received() == before


def test_models_and_tokenize(stacks):
    from openai import OpenAI

    client = OpenAI(base_url=stacks.tier + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["qwen3"]
    assert client.models.retrieve("qwen3").id == "qwen3"
    for path, body in [("/tokenize", {"model": "qwen3", "prompt": STOP_TEXT}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/detokenize", {"tokens": [9707, 1879]})]:
        local, tier = (httpx.post(base + path, json=body, timeout=30) for base in (stacks.local, stacks.tier))
        assert tier.status_code == local.status_code == 200 and tier.json() == local.json()


def test_client_disconnect_aborts_the_producer(stacks, answers):
    ids = answers.encode("word " * 300) + [151645]
    stacks.script.set({"index": 0, "token_ids": ids})
    stacks.sim_config(delay=0.02)
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", stacks.tier + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
    engine_id = "generate-tokens-" + first["id"].removeprefix("chatcmpl-")
    wait_for(lambda: engine_id in json.loads(http_get(stacks.sim_url + "/sim/aborted")[1]), "the producer request to be aborted",
             timeout=10)
    stacks.sim_config()


def test_tier_answers_carry_the_render_id(stacks, answers):
    """The chunks carry the id the render step gave (chatcmpl-...), one ``created`` per stream."""
    case = CASES["plain chunks=1"](answers)
    body = setup_case(stacks, case)
    status, events = call(stacks.tier, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert status == 200
    chunks = [e for e in events if isinstance(e, dict)]
    assert len({e["id"] for e in chunks}) == 1 and len({e["created"] for e in chunks}) == 1
    assert chunks[0]["id"].startswith("chatcmpl-")


def test_producer_stall_ends_the_tier_stream_with_an_error_event(stacks, answers):
    """The stall watch works in render-tier mode too: a tier filter of its own with a 1.5 s
    --stall-timeout (Envoy's idle timeout stays 300 s), a producer silent after 5 tokens."""
    import time

    port = free_port()
    tier = Proc("filter-tier-stall", [*DERENDER, "serve", "--workers", "1", "--producer", stacks.sim_url,
                                      "--render-url", stacks.recorder.url, "--port", str(port), "--stall-timeout", "1.5"]).start()
    envoy = None
    try:
        tier.wait(lambda: tcp_open(port), 120)
        envoy, base = start_envoy(port, stacks.sim_url, MESSAGE_TIMEOUT="60s")
        ids = answers.encode("alpha beta gamma delta epsilon zeta eta theta")
        stacks.script.set({"index": 0, "token_ids": ids + [151645]})
        stacks.sim_config(delay=0.02, fault="stall", fault_after=5)
        started = time.monotonic()
        status, events = call(base, "/v1/chat/completions",
                              {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert status == 200 and time.monotonic() - started < 30
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == 504 and "nothing for 1.5 s" in error["message"], error
        said = "".join((c["delta"].get("reasoning") or "") + (c["delta"].get("content") or "")
                       for e in events[:-2] for c in e["choices"])
        assert said == answers.tokenizer.decode(ids[:5])
        engine_id = "generate-tokens-" + events[0]["id"].removeprefix("chatcmpl-")
        assert engine_id in json.loads(http_get(stacks.sim_url + "/sim/aborted")[1])
    finally:
        stacks.sim_config()
        if envoy is not None:
            envoy.stop()
        tier.stop()


def _failures(metrics_url: str) -> dict[tuple[str, str], float]:
    """derender_producer_errors_total and derender_parser_errors_total, by name and label."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=10).text
    return {(s.name, next(iter(s.labels.values()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in ("derender_producer_errors_total", "derender_parser_errors_total")}


@pytest.mark.parametrize("knobs, counter, label, stream", [
    ({"http_error": 500}, "derender_producer_errors_total", "status", True),
    ({"http_error": 500}, "derender_producer_errors_total", "status", False),
    ({"error_after": 2}, "derender_producer_errors_total", "error", True),
    ({"fault": "truncated_json", "fault_after": 2}, "derender_parser_errors_total", "stream", True),
], ids=["status-stream", "status", "error-event", "bad-event"])
def test_render_tier_failures_are_counted_as_local_ones_are(stacks, answers, knobs, counter, label, stream):
    """A producer failure in render-tier mode moves the same counter as in local mode."""
    stacks.script.set({"index": 0, "token_ids": answers.encode("one two three four five six") + [151645]})
    before = _failures(stacks.tier_metrics)
    stacks.sim_config(**knobs)
    try:
        call(stacks.tier, "/v1/chat/completions",
             {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
    finally:
        stacks.sim_config()
    wait_for(lambda: _failures(stacks.tier_metrics).get((counter, label), 0) == before.get((counter, label), 0) + 1,
             f"{counter}{{{label}}} counted once")
