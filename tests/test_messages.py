"""Anthropic Messages through the real Envoy, with the official ``anthropic`` SDK as the client.

Event-by-event parity with vLLM's coupled ``AnthropicServingMessages`` is in
``test_parity.py`` (the ``messages:`` rows); here: what a Claude-Code-style client
does with it (``messages.create``, ``messages.stream``, ``count_tokens``, its key
header), bad input, faults, and that the streamed and the batch answer agree.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest
from agent_turns import IM_END, THINKING, encode, tool_call_answer
from agent_turns import QUESTION as QUESTION_TEXT
from agent_turns import WEATHER_TOOL as WEATHER
from stack import wait_for

QUESTION = [{"role": "user", "content": QUESTION_TEXT}]

def sdk(stack, **kw) -> anthropic.Anthropic:
    # The SDK appends /v1/messages itself: its base URL is Envoy's root.
    return anthropic.Anthropic(base_url=stack.envoy_url, api_key="unused", max_retries=0, timeout=60, **kw)


def tool_answer(stack, tokenizer, tokens_per_event: int = 1) -> list[int]:
    ids = tool_call_answer(tokenizer)
    stack.script.set({"index": 0, "token_ids": ids})
    stack.sim_config(tokens_per_event=tokens_per_event)
    return ids


def test_create_and_stream_give_a_client_the_same_thinking_and_tool_call(agents, qwen3_tokenizer):
    tool_answer(agents, qwen3_tokenizer)
    client = sdk(agents)
    message = client.messages.create(model="qwen3", max_tokens=512, messages=QUESTION, tools=[WEATHER])
    assert message.type == "message" and message.role == "assistant" and message.model == "qwen3"
    assert message.stop_reason == "tool_use"
    kinds = [b.type for b in message.content]
    assert kinds == ["thinking", "tool_use"], kinds
    assert message.content[0].thinking.strip() == THINKING
    call = message.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris 🗼"} and call.id

    with client.messages.stream(model="qwen3", max_tokens=512, messages=QUESTION, tools=[WEATHER]) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert streamed.stop_reason == "tool_use"
    # vLLM 0.33.0 streams the "\n\n" between </think> and <tool_call> as a text block of its own,
    # which its non-streaming answer omits (seen on its coupled server: test_parity's messages rows
    # match it event for event). A client loses nothing: whitespace only. Everything else agrees.
    blocks = [b for b in streamed.content if not (b.type == "text" and not b.text.strip())]
    assert [b.type for b in blocks] == kinds
    assert [b for b in streamed.content if b.type == "text"] == [] or [b.text for b in streamed.content if b.type == "text"] == ["\n\n"]
    assert blocks[0].thinking == message.content[0].thinking
    assert (blocks[1].name, blocks[1].input) == (call.name, call.input)
    assert streamed.usage.output_tokens == message.usage.output_tokens
    assert streamed.usage.input_tokens == message.usage.input_tokens


def test_count_tokens_is_the_rendered_prompt_and_never_reaches_the_producer(agents, qwen3_tokenizer):
    tool_answer(agents, qwen3_tokenizer)
    client = sdk(agents)
    system = "You are terse. 简洁。"
    before = agents.sim_received()
    counted = client.messages.count_tokens(model="qwen3", system=system, messages=QUESTION, tools=[WEATHER])
    assert agents.sim_received() == before
    message = client.messages.create(model="qwen3", system=system, max_tokens=64, messages=QUESTION, tools=[WEATHER])
    assert counted.input_tokens == message.usage.input_tokens == len(agents.sim_requests()[-1]["token_ids"])


def test_plain_text_stream_through_the_sdk(sim, qwen3_tokenizer):
    """No parsers (the plain stack): text deltas in order, end_turn, usage."""
    text = "Robot: 🤖 done. 你好，世界！"
    sim.sim_config(mode="echo", tokens_per_event="random:3")
    client = sdk(sim)
    with client.messages.stream(model="qwen3", max_tokens=200, messages=[{"role": "user", "content": text}]) as stream:
        got = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert got == qwen3_tokenizer.decode(encode(qwen3_tokenizer, text))
    assert final.stop_reason == "end_turn" and final.content[0].text == got
    assert final.usage.output_tokens > 0


def test_system_messages_inside_messages_and_a_tool_result_turn(agents, qwen3_tokenizer, qwen3_dir):
    """Claude Code's habits: system roles inside ``messages`` (vllm#44000), a tool_result turn:
    the producer gets the prompt vLLM's own /v1/messages/render makes of the same request."""
    agents.script.set({"index": 0, "token_ids": encode(qwen3_tokenizer, "<think>\n\n</think>\n\nIt is 18°C.") + [IM_END]})
    client = sdk(agents)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18°C, sunny"}]},
        {"role": "system", "content": "Reminder: answer in one line."},
    ]
    message = client.messages.create(model="qwen3", max_tokens=64, system="Be brief.", messages=history, tools=[WEATHER])
    assert [b.text.strip() for b in message.content if b.type == "text"] == ["It is 18°C."]
    sent = agents.sim_requests()[-1]["token_ids"]
    prompt = qwen3_tokenizer.decode(sent, skip_special_tokens=False)
    assert "18°C, sunny" in prompt and "Reminder: answer in one line." in prompt
    assert sent == vllm_render(qwen3_dir, {"model": "qwen3", "max_tokens": 64, "system": "Be brief.",
                                           "messages": history, "tools": [WEATHER]})


def vllm_render(model_dir: str, body: dict) -> list[int]:
    """The prompt ids of vLLM's render server (``ServingRender.render_messages_request``), same flags."""
    from reference import CoupledChat
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    coupled = CoupledChat(model_dir, "--served-model-name", "qwen3", "--max-model-len", "4096",
                          "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    result = asyncio.run(coupled.state.serving_render.render_messages_request(AnthropicMessagesRequest.model_validate(body)))
    return list(result.token_ids)


@pytest.mark.parametrize(
    "body, status, says",
    [
        ({"model": "qwen3", "messages": QUESTION}, 400, "max_tokens"),
        ({"model": "qwen3", "max_tokens": "many", "messages": QUESTION}, 400, "max_tokens"),
        ({"model": "qwen3", "max_tokens": 10, "messages": "hi"}, 400, "messages"),
        ({"model": "qwen3", "max_tokens": 10, "messages": QUESTION,
          "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]}, 400, "input_schema"),
    ],
    ids=["missing-max-tokens", "max-tokens-wrong-type", "messages-not-a-list", "hosted-tool"],
)
def test_bad_input_gets_vllms_400_and_nothing_reaches_the_producer(agents, body, status, says):
    """vLLM answers a body that fails validation before its Messages handler runs: its
    request-validation handler's 400, in the OpenAI shape."""
    before = agents.sim_received()
    r = httpx.post(agents.base_url + "/messages", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and says in error["message"]
    assert agents.sim_received() == before
    if "max_tokens" in body:  # (the SDK itself refuses a call without it)
        with pytest.raises(anthropic.BadRequestError):
            sdk(agents).messages.create(**body)


def test_unknown_model_is_an_anthropic_not_found_error(agents):
    before = agents.sim_received()
    with pytest.raises(anthropic.NotFoundError) as info:
        sdk(agents).messages.create(model="claude-sonnet-9", max_tokens=10, messages=QUESTION)
    assert info.value.body == {"type": "error", "error": {"type": "not_found_error", "message": info.value.body["error"]["message"]}}
    assert "claude-sonnet-9" in info.value.body["error"]["message"]
    assert agents.sim_received() == before


def test_a_producer_failure_mid_stream_closes_the_block_and_sends_an_error_event(agents, qwen3_tokenizer):
    """As vLLM's converter does when its engine fails: the open block is closed, then ``error``."""
    tool_answer(agents, qwen3_tokenizer)
    agents.sim_config(error_after=5)
    with httpx.stream("POST", agents.base_url + "/messages", timeout=60,
                      json={"model": "qwen3", "max_tokens": 200, "messages": QUESTION, "stream": True}) as r:
        assert r.status_code == 200
        frames = [f for f in r.read().decode().split("\n\n") if f]
    names = [f.split("\n", 1)[0].removeprefix("event: ") for f in frames]
    assert names[0] == "message_start" and names[-1] == "error"
    assert names[-2] == "content_block_stop" and "message_stop" not in names
    error = json.loads(frames[-1].split("data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] in ("api_error", "invalid_request_error", "overloaded_error")


def test_a_client_that_goes_away_aborts_the_producer_request(agents, qwen3_tokenizer):
    ids = encode(qwen3_tokenizer, "word " * 400)
    agents.script.set({"index": 0, "token_ids": ids + [IM_END]})
    agents.sim_config(delay=0.02)
    before = len(agents.sim_aborted())
    with httpx.stream("POST", agents.base_url + "/messages", timeout=60,
                      json={"model": "qwen3", "max_tokens": 1000, "messages": QUESTION, "stream": True}) as r:
        for line in r.iter_lines():
            if "content_block_delta" in line:
                break
    wait_for(lambda: len(agents.sim_aborted()) > before, "the producer request's abort", timeout=30)
    assert agents.sim_aborted()[-1].startswith("generate-tokens-")


def test_render_tier_mode_refuses_messages_clearly():
    from derender.endpoints import messages
    from derender.endpoints.router import Backend

    TIER_HAS_NO_MESSAGES = messages.NOT_IN_TIER
    backend = Backend(["m"], producer=None, render_url="http://127.0.0.1:1")  # type: ignore[arg-type]
    reply = asyncio.run(backend.exchange(messages.ENDPOINT, None).request_body(b"{}"))
    assert reply.status == 501
    assert json.loads(reply.body) == {"type": "error", "error": {"type": "api_error", "message": TIER_HAS_NO_MESSAGES}}
