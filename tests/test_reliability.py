"""A bad day, through the real Envoy: producer faults, filter faults, slow clients, bad input.

Every fault case checks what the client got (every token that reached it, then
a clear error, never raw producer events), that nothing hangs, and that the
filter goes on serving: a healthy stream running at the same time completes
with all its text. Expected text always comes from the tokenizer decoding the
token ids, never from the filter's output.

The simulator's ``fault`` knob (see ``derender.sim.FAULTS``) makes the producer
misbehave at event ``fault_after`` for the requests that follow.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
import urllib.error
from pathlib import Path

import httpx
import psutil
import pytest
from stack import free_port, http_get, http_post, start_envoy, start_filter, start_sim, wait_for

IM_END = 151645
RAW_MARKERS = (b'"output_mode"', b'"token_ids":[', b'"request_id":"generate-tokens')  # producer event fields


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def chat(stream: bool = True, **kw) -> dict:
    return {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": stream, **kw}


def events_of(data: bytes) -> list:
    events = []
    for block in data.decode("utf-8", "replace").split("\n\n"):
        if block.startswith("data: "):
            payload = block[6:]
            events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    return events


def text_of(events: list, field: str = "content") -> str:
    return "".join(
        c["delta"].get(field) or "" for e in events if isinstance(e, dict) and "choices" in e for c in e["choices"]
    )


def answer_of(events: list) -> str:
    """Reasoning and content together (with a reasoning parser, an answer without
    ``</think>`` is all reasoning)."""
    return "".join(
        (c["delta"].get("reasoning") or "") + (c["delta"].get("content") or "")
        for e in events
        if isinstance(e, dict) and "choices" in e
        for c in e["choices"]
    )


def assert_nothing_raw(data: bytes) -> None:
    for marker in RAW_MARKERS:
        assert marker not in data, f"producer field {marker!r} reached the client"



def engine_id(events: list) -> str:
    """The producer's id for this request (Envoy's x-request-id rides in the chunk id)."""
    first = next(e for e in events if isinstance(e, dict) and "id" in e)
    return "generate-tokens-" + first["id"].removeprefix("chatcmpl-")


class HealthyStream:
    """A normal stream in flight while a fault happens elsewhere.

    ``hold``: the producer holds it after a few tokens until ``check`` (for a filter whose stall
    watch would not end a held stream), so it provably overlaps whatever happens meanwhile;
    otherwise it is a slow stream, and ``check`` only sees it end well.
    """

    def __init__(self, stack, script, tok, base_url: str | None = None, hold: bool = False, words: int = 10) -> None:
        self.stack = stack
        self.ids = encode(tok, "healthy " * words + "stream: 🤖 你好 done")
        self.expected = tok.decode(self.ids)
        self.url = (base_url or stack.base_url) + "/chat/completions"
        self.data = b""
        self.error: BaseException | None = None
        self.held: str | None = None
        script.set({"index": 0, "token_ids": self.ids + [IM_END]})
        before = stack.sim_received()
        if hold:
            stack.sim_config(hold_after=3)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        wait_for(lambda: stack.sim_received() > before, what="the healthy stream to reach the producer")
        self.engine = "generate-tokens-" + stack.sim_requests()[-1]["request_id"].removeprefix("chatcmpl-")
        if hold:
            [self.held] = wait_for(stack.sim_held, what="the healthy stream held by the producer")
            stack.sim_config()  # later requests are not held

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=chat(), timeout=60) as r:
                self.data = r.read()
        except BaseException as exc:  # noqa: BLE001 (reported by check())
            self.error = exc

    def running(self) -> bool:
        """Whether the producer is still generating it."""
        return self.engine in json.loads(http_get(self.stack.sim_url + "/sim/stats")[1])["running"]

    def check(self) -> None:
        if self.held is not None:
            assert self.stack.sim_held() == [self.held], "the healthy stream did not last through the fault"
            self.stack.sim_release()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the healthy stream hung"
        assert self.error is None, self.error
        events = events_of(self.data)
        assert events[-1] == "[DONE]" and answer_of(events) == self.expected


@pytest.fixture()
def faulty(sim, script, qwen3_tokenizer):
    """The stack with a slow producer (so faults happen mid-stream) and a healthy stream in flight
    through the fault (held by the producer until the test is over)."""
    sim.sim_config(delay=0.04)
    healthy = HealthyStream(sim, script, qwen3_tokenizer, hold=True)
    yield sim
    sim.sim_config()  # faults off
    healthy.check()


# -- producer faults ------------------------------------------------------------------------
MALFORMED = ["garbage", "truncated_json", "unknown_output_mode", "out_of_vocab", "unknown_index"]


@pytest.mark.parametrize("fault", MALFORMED)
def test_malformed_producer_stream(faulty, script, qwen3_tokenizer, fault):
    ids = encode(qwen3_tokenizer, "alpha beta gamma delta epsilon zeta eta theta")
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    faulty.sim_config(delay=0.04, fault=fault, fault_after=3)
    with httpx.stream("POST", faulty.base_url + "/chat/completions", json=chat(), timeout=30) as r:
        assert r.status_code == 200
        data = r.read()
    assert_nothing_raw(data)
    events = events_of(data)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 502 and "producer" in error["message"]
    assert text_of(events[:-2]) == qwen3_tokenizer.decode(ids[:3])  # every token before the fault
    # The producer went on generating: the filter aborts it.
    wait_for(lambda: engine_id(events) in faulty.sim_aborted(), what="the producer request to be aborted")


@pytest.mark.parametrize("fault", MALFORMED)
def test_malformed_producer_response_non_streaming(sim, script, qwen3_tokenizer, fault):
    script.set({"index": 0, "token_ids": encode(qwen3_tokenizer, "one two three") + [IM_END]})
    sim.sim_config(fault=fault, fault_after=0)
    r = httpx.post(sim.base_url + "/chat/completions", json=chat(stream=False), timeout=30)
    assert r.status_code == 502, r.text
    assert_nothing_raw(r.content)
    error = r.json()["error"]
    assert error["code"] == 502 and "producer" in error["message"]


# A non-streaming request with stop strings is streamed from the producer (the filter stops it at
# the stop string): its status went out with the producer's headers, so a fault mid-stream reaches
# the client as an OpenAI error object with status 200, and nothing raw.
@pytest.mark.parametrize("fault", [*MALFORMED, "error event"])
def test_fault_in_a_non_streaming_answer_with_stop_strings(sim, script, qwen3_tokenizer, fault):
    ids = encode(qwen3_tokenizer, "alpha beta gamma delta epsilon zeta eta theta")
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    if fault == "error event":
        sim.sim_config(delay=0.04, error_after=3)
    else:
        sim.sim_config(delay=0.04, fault=fault, fault_after=3)
    before = len(sim.sim_aborted())
    try:
        r = httpx.post(sim.base_url + "/chat/completions", json=chat(stream=False, stop=["omega"]), timeout=30)
    finally:
        sim.sim_config()
    assert sim.sim_requests()[-1]["stream"] is True
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert_nothing_raw(r.content)
    error = r.json()["error"]
    if fault == "error event":  # the producer's own error
        assert error["code"] == 500 and error["message"] == "Internal server error"
    else:  # the producer went on generating: the filter aborts it
        assert error["code"] == 502 and "producer" in error["message"]
        wait_for(lambda: len(sim.sim_aborted()) > before, what="the producer request to be aborted")


def test_non_streaming_answer_with_stop_strings_stops_the_producer(sim, script, qwen3_tokenizer):
    """The answer comes when the stop string does, not when the producer would have reached its end."""
    ids = encode(qwen3_tokenizer, "one two three STOP " + "and more " * 300)
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    sim.sim_config(delay=0.02)
    before = len(sim.sim_aborted())
    try:
        r = httpx.post(sim.base_url + "/chat/completions", json=chat(stream=False, stop=["STOP"]), timeout=60)
    finally:
        sim.sim_config()
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["message"]["content"] == "one two three "
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["choices"][0]["stop_reason"] == "STOP"
    engine = "generate-tokens-" + answer["id"].removeprefix("chatcmpl-")
    wait_for(lambda: engine in sim.sim_aborted()[before:], what="the producer request to be aborted at the stop string")


@pytest.fixture(scope="module")
def two_replicas(plain_stack, qwen3_dir, script):
    """One Envoy balancing its producer cluster over the stack's simulator and a second one, while the
    filter's ``--producer`` names only the first: a load-balanced address, as the filter sees it."""
    second, second_url = start_sim(qwen3_dir, "--mode", "script", "--script", str(script.path))
    envoy, base = start_envoy(plain_stack.filter_port, plain_stack.sim_url, second_url)
    yield base, second_url
    envoy.stop()
    second.stop()


def test_an_abort_reaches_the_replica_that_runs_the_request(sim, script, qwen3_tokenizer, two_replicas):
    """Stop strings abort the producer: each abort goes to the replica Envoy picked, not to --producer."""
    base, second_url = two_replicas
    replicas = {"first": sim.sim_url, "second": second_url}
    ids = encode(qwen3_tokenizer, "one two three STOP " + "and more " * 300)
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    for url in replicas.values():
        assert http_post(url + "/sim/config", {"delay": 0.02})[0] == 200
    received = lambda url: json.loads(http_get(url + "/sim/stats")[1])["received"]
    aborted = lambda url: json.loads(http_get(url + "/sim/aborted")[1])
    running = lambda url: json.loads(http_get(url + "/sim/stats")[1])["running"]
    filter_log = next(p for p in sim.procs if p.name == "filter").log
    served = []
    try:
        for stream in (True, False, True, False):
            before = {name: received(url) for name, url in replicas.items()}
            r = httpx.post(base + "/v1/chat/completions", json=chat(stream=stream, stop=["STOP"]), timeout=60)
            assert r.status_code == 200, r.text
            assert "x-derender-upstream" not in r.headers  # the producer's address stays inside
            events = events_of(r.content) if stream else [r.json()]
            assert (text_of(events) if stream else events[0]["choices"][0]["message"]["content"]) == "one two three "
            name = next(n for n, url in replicas.items() if received(url) > before[n])
            other = next(url for n, url in replicas.items() if n != name)
            engine = engine_id(events)
            wait_for(lambda: engine in aborted(replicas[name]) and engine not in running(replicas[name]),
                     what=f"the abort of {engine} at the {name} replica, which runs it")
            # The filter logs each abort once all its calls are over (fallbacks included): so this
            # line is all it did for the request, one call, at that replica, taken.
            attempts = wait_for(lambda: [line for line in filter_log.read_text(errors="replace").splitlines()
                                         if engine in line and "abort" in line], what="the filter's abort log")
            assert len(attempts) == 1 and attempts[0].endswith(f"at {replicas[name]}: ok"), attempts
            assert engine not in aborted(other)
            served.append((name, engine))
    finally:
        for url in replicas.values():
            http_post(url + "/sim/config", {"delay": 0.0})
    assert {name for name, _ in served} == {"first", "second"}, served  # Envoy's round robin used both
    # Seconds later, after every other request: still only the replica that ran each one.
    for name, engine in served:
        assert [n for n, url in replicas.items() if engine in aborted(url)] == [name], engine
        assert sum(engine in line for line in filter_log.read_text(errors="replace").splitlines()
                   if "abort" in line) == 1, engine


def test_an_abort_falls_back_to_the_configured_producers(sim, two_replicas):
    """A replica that cannot be reached (or no replica named): the abort goes to --producer, or to every
    producer of a cluster; a reachable replica gets it alone."""
    from derender.routing.producer import Producer
    from derender.routing.clusters import ClusterProducers

    _, second_url = two_replicas
    gone = f"127.0.0.1:{free_port()}"

    async def aborts() -> list[bool]:
        one, cluster = Producer(sim.sim_url), ClusterProducers([sim.sim_url, second_url])
        try:
            return [
                await one.abort("generate-tokens-one-fallback", "test", gone),
                await cluster.abort("generate-tokens-all-fallback", "test", gone),
                await cluster.abort("generate-tokens-all-unknown", "test", None),
                await cluster.abort("generate-tokens-exact", "test", second_url.removeprefix("http://")),
            ]
        finally:
            for producer in (one, *cluster.producers):
                await producer.close()

    assert asyncio.run(aborts()) == [True] * 4
    first, second = (json.loads(http_get(url + "/sim/aborted")[1]) for url in (sim.sim_url, second_url))
    assert "generate-tokens-one-fallback" in first and "generate-tokens-one-fallback" not in second
    assert all(i in first and i in second for i in ("generate-tokens-all-fallback", "generate-tokens-all-unknown"))
    assert "generate-tokens-exact" in second and "generate-tokens-exact" not in first


def test_replica_address_from_envoy():
    from derender.routing.producer import replica_url

    assert replica_url("https://producers.svc:8000", "10.1.2.3:8000") == "https://10.1.2.3:8000"
    assert replica_url("http://producers:8000", "[fd00::5]:8000") == "http://[fd00::5]:8000"
    for bad in (None, "", "-", "10.1.2.3", "producer:8000", "10.1.2.3:8000/path", "10.1.2.3:8000 x"):
        assert replica_url("http://producers:8000", bad) is None, bad


@pytest.fixture(scope="module")
def dead_producer_envoy(plain_stack):
    """An Envoy whose producer cluster points at a port nobody listens on (same filter)."""
    envoy, base = start_envoy(plain_stack.filter_port, f"http://127.0.0.1:{free_port()}")
    yield base
    envoy.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_producer_refuses_connection(sim, dead_producer_envoy, stream):
    r = httpx.post(dead_producer_envoy + "/v1/chat/completions", json=chat(stream=stream), timeout=30)
    assert r.status_code == 503
    assert_nothing_raw(r.content)
    error = r.json()["error"]
    assert error["code"] == 503 and error["message"]
    # The filter goes on serving the producer that is up.
    sim.sim_config(mode="echo")
    ok = httpx.post(sim.base_url + "/chat/completions", json=chat(stream=False), timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "hi"


def read_until_content(lines, count: int) -> tuple[list, bytes]:
    """Read SSE lines until ``count`` chunks with text (content or reasoning) arrived."""
    events, raw = [], b""
    for line in lines:
        raw += line.encode() + b"\n"
        if line.startswith("data: "):
            assert line != "data: [DONE]", "the stream ended early"
            events.append(json.loads(line[6:]))
            if sum(1 for e in events if e["choices"] and answer_of([e])) == count:
                return events, raw
    raise AssertionError("the stream ended early")


def test_producer_dies_mid_stream(faulty, script, qwen3_tokenizer):
    """The producer drops the connection without ending the body, after 4 tokens reached the client."""
    ids = encode(qwen3_tokenizer, "alpha beta gamma delta epsilon zeta eta theta")
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    faulty.sim_config(delay=0.04, fault="stall", fault_after=4)
    with httpx.stream("POST", faulty.base_url + "/chat/completions", json=chat(), timeout=30) as r:
        lines = r.iter_lines()
        events, raw = read_until_content(lines, 4)
        faulty.sim_config(delay=0.04, fault="die")  # the stalled request dies now
        with pytest.raises(httpx.RemoteProtocolError):  # the body is cut: no [DONE], no clean end
            for line in lines:
                raw += line.encode() + b"\n"
    assert_nothing_raw(raw)
    assert text_of(events) == qwen3_tokenizer.decode(ids[:4])


def test_producer_dies_before_answering(sim, script, qwen3_tokenizer):
    script.set({"index": 0, "token_ids": encode(qwen3_tokenizer, "one two") + [IM_END]})
    sim.sim_config(fault="die", fault_after=0)
    r = httpx.post(sim.base_url + "/chat/completions", json=chat(stream=False), timeout=30)
    assert r.status_code == 503
    assert_nothing_raw(r.content)
    assert r.json()["error"]["code"] == 503


@pytest.fixture(scope="module")
def short_idle_envoy(plain_stack):
    """The same filter and producer behind an Envoy whose stream idle timeout is 2 s."""
    envoy, base = start_envoy(plain_stack.filter_port, plain_stack.sim_url, IDLE_TIMEOUT="2s")
    yield base
    envoy.stop()


def test_producer_stalls_mid_stream(faulty, script, qwen3_tokenizer, short_idle_envoy):
    """Nothing for longer than the idle timeout: Envoy cuts the stream, the filter aborts the request."""
    ids = encode(qwen3_tokenizer, "alpha beta gamma delta epsilon zeta eta theta")
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    faulty.sim_config(delay=0.04, fault="stall", fault_after=4)
    with httpx.stream("POST", short_idle_envoy + "/v1/chat/completions", json=chat(), timeout=60) as r:
        lines = r.iter_lines()
        events, raw = read_until_content(lines, 4)
        with pytest.raises(httpx.RemoteProtocolError):
            for line in lines:
                raw += line.encode() + b"\n"
    assert_nothing_raw(raw)
    assert text_of(events) == qwen3_tokenizer.decode(ids[:4])
    wait_for(lambda: engine_id(events) in faulty.sim_aborted(), what="the stalled request to be aborted")


def test_producer_stalls_before_answering(sim, script, qwen3_tokenizer, short_idle_envoy):
    script.set({"index": 0, "token_ids": encode(qwen3_tokenizer, "one two") + [IM_END]})
    sim.sim_config(fault="stall", fault_after=0)
    r = httpx.post(short_idle_envoy + "/v1/chat/completions", json=chat(stream=False), timeout=60)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == r.status_code
    # The producer's id for it: Envoy's x-request-id, which the filter sent as the request id.
    engine = "generate-tokens-" + sim.sim_requests()[-1]["request_id"].removeprefix("chatcmpl-")
    wait_for(lambda: engine in sim.sim_aborted(), what="the stalled request to be aborted")


# -- filter faults --------------------------------------------------------------------------
PLUGIN = '''
from vllm.tool_parsers import ToolParserManager
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser


@ToolParserManager.register_module("raising_hermes")
class RaisingHermes(Hermes2ProToolParser):
    """hermes, except that it raises on a call to the tool "explode", as a buggy parser would."""

    def extract_tool_calls_streaming(self, previous_text, current_text, *args, **kwargs):
        if '"explode"' in current_text:
            raise RuntimeError("parser failed on odd input")
        return super().extract_tool_calls_streaming(previous_text, current_text, *args, **kwargs)
'''


class Spare:
    """A filter of its own (qwen3 + a tool parser that raises on odd input) and its Envoy,
    sharing the plain stack's producer; it may be killed and restarted. ``flags``: more of them."""

    def __init__(self, qwen3_dir: str, plugin: str, producer: str, flags: tuple[str, ...] = ()) -> None:
        self.flags = ["--model", qwen3_dir, "--served-model-name", "qwen3", "--max-model-len", "4096",
                      "--reasoning-parser", "qwen3", "--tool-call-parser", "raising_hermes",
                      "--enable-auto-tool-choice", "--tool-parser-plugin", plugin,
                      "--workers", "1", *flags]  # one process: a failing stream and a healthy one share it
        self.producer = producer
        self.filter, self.port = start_filter(self.flags, producer)
        self.envoy, self.base = start_envoy(self.port, producer)

    def restart_filter(self) -> None:
        self.filter, _ = start_filter(self.flags, self.producer, port=self.port)

    def stop(self) -> None:
        self.envoy.stop()
        self.filter.stop()


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plugin") / "raising_hermes.py"
    path.write_text(PLUGIN)
    return str(path)


@pytest.fixture(scope="module")
def spare(plain_stack, qwen3_dir, plugin):
    s = Spare(qwen3_dir, plugin, plain_stack.sim_url)
    yield s
    s.stop()


STALL_TIMEOUT = "1.5"


@pytest.fixture(scope="module")
def staller(plain_stack, qwen3_dir, plugin):
    """A spare filter whose stall watch ends a stream after 1.5 s of producer silence (Envoy's
    stream idle timeout stays 300 s); only the stall test uses it, so no other stream is judged
    by so short a timeout."""
    s = Spare(qwen3_dir, plugin, plain_stack.sim_url, ("--stall-timeout", STALL_TIMEOUT))
    yield s
    s.stop()


TOOLS = [{"type": "function", "function": {"name": "explode", "parameters": {"type": "object", "properties": {}}}}]


def test_parser_raising_ends_only_its_stream(spare, sim, script, qwen3_tokenizer):
    sim.sim_config(delay=0.04)
    healthy = HealthyStream(sim, script, qwen3_tokenizer, base_url=spare.base + "/v1", hold=True)
    answer = '<think>\nok\n</think>\n\nSure.<tool_call>\n{"name": "explode", "arguments": {}}\n</tool_call>'
    ids = encode(qwen3_tokenizer, answer)
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    with httpx.stream("POST", spare.base + "/v1/chat/completions", json=chat(tools=TOOLS), timeout=30) as r:
        assert r.status_code == 200
        data = r.read()
    assert_nothing_raw(data)
    events = events_of(data)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "parser failed on odd input"
    assert text_of(events, "reasoning") == "\nok\n" and text_of(events).strip() == "Sure."
    wait_for(lambda: engine_id(events) in sim.sim_aborted(), what="the failed stream's producer request to be aborted")
    healthy.check()  # the other stream on the same filter went on


def test_producer_stall_ends_with_an_error_event(staller, sim, script, qwen3_tokenizer):
    """Silent past the filter's --stall-timeout (1.5 s) but well within Envoy's idle timeout: the
    filter aborts the producer request, and the client gets every token so far, an error event and
    [DONE], a clean end instead of Envoy's cut. A stream of ~8 s of tokens on the same process
    is still being generated when the stalled one has ended, then completes."""
    spare = staller
    sim.sim_config(delay=0.04)
    healthy = HealthyStream(sim, script, qwen3_tokenizer, base_url=spare.base + "/v1", words=200)
    ids = encode(qwen3_tokenizer, "alpha beta gamma delta epsilon zeta eta theta")
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    sim.sim_config(delay=0.04, fault="stall", fault_after=5)
    try:
        started = time.monotonic()
        with httpx.stream("POST", spare.base + "/v1/chat/completions", json=chat(), timeout=60) as r:
            assert r.status_code == 200
            data = r.read()
        took = time.monotonic() - started
    finally:
        sim.sim_config()
    assert_nothing_raw(data)
    events = events_of(data)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 504 and f"nothing for {STALL_TIMEOUT} s" in error["message"], error
    assert answer_of(events[:-2]) == qwen3_tokenizer.decode(ids[:5])  # every token before the stall
    assert took < 30, "the stall was not cut by the filter"
    assert healthy.running(), "the healthy stream did not overlap the stall"
    wait_for(lambda: engine_id(events) in sim.sim_aborted(), what="the stalled request to be aborted")
    assert healthy.engine not in sim.sim_aborted()
    healthy.check()


def test_filter_killed_mid_stream_then_restarted(spare, sim, script, qwen3_tokenizer):
    ids = encode(qwen3_tokenizer, "word " * 200)
    script.set({"index": 0, "token_ids": ids + [IM_END]})
    sim.sim_config(delay=0.03)
    with httpx.stream("POST", spare.base + "/v1/chat/completions", json=chat(), timeout=30) as r:
        lines = r.iter_lines()
        events, raw = read_until_content(lines, 5)
        spare.filter.stop(signal.SIGKILL)  # the whole filter (all its workers), no goodbye
        with pytest.raises(httpx.RemoteProtocolError):
            for line in lines:
                raw += line.encode() + b"\n"
    assert_nothing_raw(raw)  # Envoy never lets raw producer events through
    assert answer_of(events) == qwen3_tokenizer.decode(ids[:5])

    # While it is down: a clean OpenAI-shaped error, and nothing reaches the producer.
    sim.sim_config()
    before = sim.sim_received()
    for stream in (False, True):
        r = httpx.post(spare.base + "/v1/chat/completions", json=chat(stream=stream), timeout=30)
        assert r.status_code == 502  # the README: 502 while the filter is down
        assert_nothing_raw(r.content)
        error = r.json()["error"]
        assert error["code"] == r.status_code and "derender filter failed or is unreachable" in error["message"], error
    assert sim.sim_received() == before

    spare.restart_filter()
    short = encode(qwen3_tokenizer, "back again")
    script.set({"index": 0, "token_ids": short + [IM_END]})

    def served():
        r = httpx.post(spare.base + "/v1/chat/completions", json=chat(stream=False), timeout=30)
        return r if r.status_code == 200 else None

    r = wait_for(served, "the restarted filter to serve", 60)
    message = r.json()["choices"][0]["message"]  # (with a reasoning parser, no </think>: all reasoning)
    assert (message.get("reasoning") or "") + (message.get("content") or "") == qwen3_tokenizer.decode(short)


# -- client faults --------------------------------------------------------------------------
def uss(pid: int) -> int:
    """Private memory of a process tree (the filter's supervisor and workers), bytes."""
    root = psutil.Process(pid)
    return sum(p.memory_full_info().uss for p in [root, *root.children(recursive=True)])


# Socket buffers of the slow-reader test: set, so the kernel does not grow them (autotuning lets
# a loopback receive buffer grow to tcp_rmem's maximum, 32 MiB here: room for the whole answer).
SOCKET_BUFFER = 64 << 10
SOL_SOCKET, SO_SNDBUF, SO_RCVBUF = socket.SOL_SOCKET, socket.SO_SNDBUF, socket.SO_RCVBUF


def _small_socket_buffers(config: dict) -> None:
    """Envoy's client-side and producer-side sockets with fixed small kernel buffers."""
    options = [{"level": SOL_SOCKET, "name": name, "int_value": SOCKET_BUFFER, "state": "STATE_PREBIND"}
               for name in (SO_SNDBUF, SO_RCVBUF)]
    for listener in config["static_resources"]["listeners"]:
        listener["socket_options"] = options  # accepted sockets inherit them
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "producer")
    cluster["upstream_bind_config"] = {"source_address": {"address": "127.0.0.1", "port_value": 0},
                                       "socket_options": options}


@pytest.fixture(scope="module")
def small_buffer_envoy(plain_stack):
    """The same filter and producer behind an Envoy that buffers at most 1 MiB per connection
    (the shipped config allows 16 MiB: the same mechanism, a larger bound), with small kernel
    socket buffers on both sides."""
    envoy, base = start_envoy(plain_stack.filter_port, plain_stack.sim_url, BODY_LIMIT_BYTES=1 << 20,
                              edit=_small_socket_buffers)
    yield envoy, base
    envoy.stop()


def _max_socket_buffer(kind: str) -> int:
    """The most the kernel lets one TCP socket buffer (``kind``: rmem or wmem) grow to."""
    return int(Path(f"/proc/sys/net/ipv4/tcp_{kind}").read_text().split()[2])


def test_slow_reader_is_held_back_by_flow_control(sim, script, qwen3_tokenizer, small_buffer_envoy):
    """A client that stops reading: Envoy's buffer fills, Envoy stops reading the producer, the
    filter gets nothing more to translate, nobody's memory grows; then every token arrives.

    Decided on the producer's state: it is held back once its writes wait on a full socket
    buffer. For that to happen the answer must be larger than every buffer on the way: Envoy's
    1 MiB per connection, the fixed 64 KiB kernel buffers of Envoy's and the client's sockets,
    and the producer's own send buffer, which the kernel may grow to tcp_wmem's maximum.
    """
    envoy_proc, base = small_buffer_envoy
    ids = encode(qwen3_tokenizer, "slow reader " * 2000)[:4000]
    script.set({"index": 0, "token_ids": ids, "finish_reason": "length"})
    filter_pid = sim.proc("filter").proc.pid
    envoy = psutil.Process(envoy_proc.proc.pid)
    envoy_before = envoy.memory_info().rss
    # 16 x 4000 one-token events, usage on each: ~16 MB from the producer, ~20 MB to the client.
    n = 16
    producer_bytes = n * len(ids) * 250  # an event is ~250 bytes
    buffers = _max_socket_buffer("wmem") + (1 << 20) + 6 * SOCKET_BUFFER
    assert producer_bytes > 2 * buffers, "the answer must not fit in the buffers on its way"
    body = chat(n=n, max_tokens=len(ids), stream_options={"include_usage": True, "continuous_usage_stats": True})
    client = httpx.Client(transport=httpx.HTTPTransport(socket_options=[(SOL_SOCKET, SO_RCVBUF, SOCKET_BUFFER)]),
                          timeout=120)

    def stats() -> dict:
        return httpx.get(sim.sim_url + "/sim/stats", timeout=10).json()

    with client, client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        chunks = r.iter_raw(1 << 16)
        data = next(chunks)

        def held_back():  # the producer's writes wait, and it sends nothing more
            first = stats()
            if not first["blocked"]:
                return None
            time.sleep(1)
            second = stats()
            sent = sum(first["running"].values())
            return sent if second["blocked"] and sum(second["running"].values()) == sent else None

        sent = wait_for(held_back, "the producer to be held back", 120)
        filter_held, envoy_held = uss(filter_pid), envoy.memory_info().rss
        time.sleep(3)  # still not reading
        assert sum(stats()["running"].values()) == sent < n * len(ids), "the producer was not held back"
        filter_growth, envoy_growth = uss(filter_pid) - filter_held, envoy.memory_info().rss - envoy_held
        assert filter_growth < 16 << 20 and envoy_growth < 16 << 20, (filter_growth, envoy_growth)
        assert envoy.memory_info().rss - envoy_before < 32 << 20
        for chunk in chunks:  # now read it all
            data += chunk
    events = events_of(data)
    assert events[-1] == "[DONE]"
    texts = [""] * n
    for e in events[:-1]:
        for c in e["choices"]:  # (the last event is the usage-only one)
            texts[c["index"]] += c["delta"].get("content") or ""
    assert texts == [qwen3_tokenizer.decode(ids)] * n
    print(f"\nslow reader: producer held at {sent} of {n * len(ids)} tokens; the client got {len(data) >> 20} MiB;"
          f" growth while held: filter USS {filter_growth >> 10} KiB, Envoy RSS {envoy_growth >> 10} KiB")


# -- bad input: a clear OpenAI error, nothing forwarded ----------------------------------------
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "x", "parameters": {"type": "object", "properties": {}}}}
BAD = {
    "huge-n": (json.dumps({"model": "qwen3", "messages": MSG, "n": 10**9}).encode(), 400, "n must be"),
    "max-tokens-beyond-model": (json.dumps({"model": "qwen3", "messages": MSG, "max_tokens": 10**6}).encode(), 400, "max_tokens"),
    "prompt-beyond-model": (json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "word " * 5000}]}).encode(), 400, "context"),
    "invalid-utf8": (b'{"model":"qwen3","messages":[{"role":"user","content":"\xff\xfe hi"}]}', 400, "JSON"),
    "deeply-nested": (b'{"model":"qwen3","messages":' + b"[" * 100000 + b"]" * 100000 + b"}", 400, "recursion"),
    "wrong-type-temperature": (json.dumps({"model": "qwen3", "messages": MSG, "temperature": "hot"}).encode(), 400, "temperature"),
    "wrong-type-messages": (json.dumps({"model": "qwen3", "messages": {"role": "user"}}).encode(), 400, "messages"),
    "wrong-type-content": (json.dumps({"model": "qwen3", "messages": [{"role": "user", "content": 5}]}).encode(), 400, "content"),
    "nan": (b'{"model":"qwen3","messages":[{"role":"user","content":"hi"}],"temperature":NaN}', 400, "temperature"),
    "tool-parameters-not-an-object": (
        json.dumps({"model": "qwen3", "messages": MSG, "tools": [{"type": "function", "function": {"name": "x", "parameters": "s"}}]}).encode(), 400, "parameters"),
    "tool-without-name": (
        json.dumps({"model": "qwen3", "messages": MSG, "tools": [{"type": "function", "function": {"parameters": {}}}]}).encode(), 400, "name"),
    "tool-of-unknown-type": (
        json.dumps({"model": "qwen3", "messages": MSG, "tools": [{"type": "retrieval", "function": {"name": "x"}}]}).encode(), 400, "function"),
    "tool-choice-unknown": (json.dumps({"model": "qwen3", "messages": MSG, "tools": [TOOL], "tool_choice": "sometimes"}).encode(), 400, "tool_choice"),
    "tool-choice-names-a-missing-tool": (
        json.dumps({"model": "qwen3", "messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "y"}}}).encode(), 400, "tool_choice"),
    "tool-choice-auto-without-a-tool-parser": (
        json.dumps({"model": "qwen3", "messages": MSG, "tools": [TOOL], "tool_choice": "auto"}).encode(), 400, "auto"),
    "reasoning-effort-unknown": (json.dumps({"model": "qwen3", "messages": MSG, "reasoning_effort": "extreme"}).encode(), 400, "reasoning_effort"),
    "response-format-unknown": (json.dumps({"model": "qwen3", "messages": MSG, "response_format": {"type": "xml"}}).encode(), 400, "response_format"),
    "chat-template-kwargs-not-an-object": (json.dumps({"model": "qwen3", "messages": MSG, "chat_template_kwargs": "x"}).encode(), 400, "chat_template_kwargs"),
    "logprobs-beyond-max": (json.dumps({"model": "qwen3", "messages": MSG, "logprobs": True, "top_logprobs": 25}).encode(), 400, "logprobs"),
    "logit-bias-out-of-vocab": (json.dumps({"model": "qwen3", "messages": MSG, "logit_bias": {"999999": 1}}).encode(), 400, "logit_bias"),
    "stop-token-out-of-vocab": (json.dumps({"model": "qwen3", "messages": MSG, "stop_token_ids": [10**7]}).encode(), 400, "stop_token_ids"),
}


JSON_CASES = [name for name, (raw, *_) in BAD.items() if raw.startswith(b'{"model": ')]  # parseable: can stream


@pytest.mark.parametrize("name, stream", [(name, False) for name in BAD] + [(name, True) for name in JSON_CASES])
def test_bad_input_is_refused_before_the_producer(sim, name, stream):
    raw, status, mentions = BAD[name]
    if stream:  # the same mistake in a streaming request: still a status, not a 200 stream
        raw = json.dumps({**json.loads(raw), "stream": True}).encode()
    before = sim.sim_received()
    r = httpx.post(sim.base_url + "/chat/completions", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["type"]
    assert mentions.lower() in (error["message"] + str(error["param"])).lower(), error
    assert sim.sim_received() == before, "a refused request reached the producer"


# -- shutdown ---------------------------------------------------------------------------------
def test_sigterm_drains_open_streams_and_refuses_new_ones(plain_stack, qwen3_dir, sim, script, qwen3_tokenizer):
    """A filter told to stop (a rolling update, a scale-down) with its default forked workers:
    the stream in flight runs to [DONE], a new request gets an OpenAI error at once, health checks
    read NOT_SERVING, and the filter exits once the stream is done, well before --drain-timeout."""
    drains(plain_stack, qwen3_dir, sim, script, qwen3_tokenizer)


def drains(plain_stack, qwen3_dir, sim, script, qwen3_tokenizer, flags: tuple[str, ...] = (), edit=None) -> None:
    """``test_sigterm_drains_open_streams_and_refuses_new_ones`` on a filter with ``flags`` added, behind
    an Envoy whose config ``edit`` changes (test_response_leg.py: the response leg)."""
    from derender.extproc import health

    flt, port = start_filter(["--model", qwen3_dir, "--served-model-name", "qwen3", "--max-model-len", "4096",
                              "--drain-timeout", "60", *flags], plain_stack.sim_url)
    envoy, base = start_envoy(port, plain_stack.sim_url, edit=edit)
    try:
        assert health.check(f"127.0.0.1:{port}")
        # In flight, held by the producer, until healthy.check() releases it.
        healthy = HealthyStream(sim, script, qwen3_tokenizer, base_url=base + "/v1", hold=True)
        os.killpg(flt.proc.pid, signal.SIGTERM)
        wait_for(lambda: not health.check(f"127.0.0.1:{port}", timeout=1), what="the filter to stop serving health checks")
        r = httpx.post(base + "/v1/chat/completions", json=chat(stream=False), timeout=30)
        assert r.status_code == 502 and r.json()["error"]["message"].startswith("the derender filter failed or is unreachable")
        assert flt.proc.poll() is None, "the filter left before its stream was done"
        healthy.check()  # still held (so still open), then released: all of it, then [DONE]
        assert flt.proc.wait(timeout=30) == 0
        log = flt.log.read_text(errors="replace")
        assert "draining 1 open streams" in log and "drained in" in log
    finally:
        sim.sim_config()
        envoy.stop()
        flt.stop()


@pytest.fixture(scope="module")
def two_connection_envoy(plain_stack):
    """The same filter and producer behind an Envoy whose overload manager takes at most 2 client
    connections at once (the shipped default is 10000, ``derender up --max-connections``)."""
    envoy, base = start_envoy(plain_stack.filter_port, plain_stack.sim_url, MAX_CONNECTIONS=2)
    yield base
    envoy.stop()


def test_past_the_connection_limit_a_new_connection_is_closed_while_open_streams_finish(
        sim, script, qwen3_tokenizer, two_connection_envoy):
    """Two streams held open by the producer fill the limit: a third connection is closed with no
    answer (nothing reaches the filter or the producer); the two streams then finish whole, and once
    they are done a new connection is served."""
    base = two_connection_envoy
    ids = encode(qwen3_tokenizer, "Two streams held open, then released whole.")
    script.set({"index": 0, "token_ids": ids + [IM_END], "finish_reason": "stop", "stop_reason": None})
    sim.sim_config(hold_after=2)
    received = sim.sim_received()
    results: list[tuple[int, bytes]] = []

    def one() -> None:
        with httpx.stream("POST", base + "/v1/chat/completions", json=chat(), timeout=60) as r:
            results.append((r.status_code, r.read()))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(sim.sim_held()) == 2, "both streams held by the producer")
        host, port = base.removeprefix("http://").split(":")
        body = json.dumps(chat()).encode()
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            try:
                conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
                answer = conn.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                answer = b""
        assert answer == b"", answer
        assert sim.sim_received() == received + 2  # the refused one reached no producer
    finally:
        sim.sim_release()
        for t in threads:
            t.join(30)
    want = qwen3_tokenizer.decode(ids)
    assert len(results) == 2
    for status, data in results:
        assert status == 200 and text_of(events_of(data)) == want and data.rstrip().endswith(b"data: [DONE]")
    sim.sim_config()

    def served() -> bool:
        # The two clients have closed their connections, but Envoy counts a connection gone only once
        # its event loop has read the close: until then a new one is still past the limit and reset.
        try:
            return http_post(base + "/v1/chat/completions", chat(stream=False), timeout=30)[0] == 200
        except (ConnectionError, urllib.error.URLError):
            return False

    assert wait_for(served, "a new connection served once Envoy has counted the two closed")
