"""``--responses-store``: stored Responses in a real Redis, shared by two filter processes.

Two filters (each with its own Envoy, as two replicas behind a load balancer) on one
producer and one ``redis-server`` (Debian's, started here): a response stored through one
is found, continued (``previous_response_id``) and refused for cancel through the other,
as vLLM's in-memory store answers in one process; the store going away is a 503 before
anything reaches the producer, and it serves again when the store is back.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from agent_turns import FINAL, QUESTION, TOOL_RESULT, two_turns
from agent_turns import WEATHER_FUNCTION as WEATHER
from stack import start_envoy, start_filter, wait_for

FLAGS = ["--served-model-name", "qwen3", "--max-model-len", "4096", "--reasoning-parser", "qwen3",
         "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--workers", "1"]


@pytest.fixture(scope="module")
def fleet(agent_stack, redis_server, qwen3_dir):
    """Two filters sharing the store, each behind its own Envoy, on the agent stack's producer."""
    procs, bases = [], []
    try:
        for _ in range(2):
            flt, port = start_filter(["--model", qwen3_dir, *FLAGS, "--responses-store", redis_server.url],
                                     agent_stack.sim_url)
            envoy, base = start_envoy(port, agent_stack.sim_url)
            procs += [flt, envoy]
            bases.append(base + "/v1")
        yield bases
    finally:
        for proc in reversed(procs):
            proc.stop()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)


def coupled_second_prompt(model_dir: str, stack) -> list[int]:
    """The second turn's prompt ids in vLLM's coupled Responses server with its own store on
    (``VLLM_ENABLE_RESPONSES_API_STORE``): the same two answers, the same requests."""
    import asyncio
    import json

    from reference import CoupledChat, ScriptedEngine, Step, coupled_responses
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    lines = [json.loads(line) for line in stack.script.path.read_text().splitlines()]
    coupled = CoupledChat(model_dir, *[f for f in FLAGS if f not in ("--workers", "1")])
    engine = ScriptedEngine(coupled.vllm_config, coupled.state.online_renderer.renderer,
                            [Step(0, lines[0]["token_ids"], finish_reason="stop")])
    serving = coupled_responses(coupled, engine)
    serving.enable_store = True

    async def turns():
        first = await serving.create_responses(ResponsesRequest.model_validate(
            {"model": "qwen3", "input": QUESTION, "tools": [WEATHER], "instructions": "Be brief."}))
        call = next(item for item in first.output if item.type == "function_call")
        engine.steps = [Step(0, lines[1]["token_ids"], finish_reason="stop")]
        await serving.create_responses(ResponsesRequest.model_validate(
            {"model": "qwen3", "previous_response_id": first.id, "tools": [WEATHER], "stream": False,
             "input": [{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}]}))
        return engine.captured.prompt_token_ids

    return asyncio.run(turns())


def test_a_response_stored_through_one_filter_is_continued_through_another(fleet, agent_stack, qwen3_tokenizer, qwen3_dir):
    two_turns(agent_stack, qwen3_tokenizer)
    one, other = client(fleet[0]), client(fleet[1])
    first = one.responses.create(model="qwen3", input=QUESTION, tools=[WEATHER], instructions="Be brief.")
    assert first.status == "completed"
    found = other.responses.retrieve(first.id)
    assert found.model_dump() == first.model_dump()

    call = next(item for item in first.output if item.type == "function_call")
    with other.responses.stream(model="qwen3", previous_response_id=first.id, tools=[WEATHER],
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}]) as stream:
        second = stream.get_final_response()
    assert second.output_text.strip() == FINAL
    sent = agent_stack.sim_requests()[-1]["token_ids"]
    prompt = qwen3_tokenizer.decode(sent, skip_special_tokens=False)
    assert QUESTION in prompt and TOOL_RESULT in prompt  # the first turn, from the store
    assert sent == coupled_second_prompt(qwen3_dir, agent_stack)  # as one vLLM with its in-memory store
    assert one.responses.retrieve(second.id).output_text == second.output_text

    with pytest.raises(openai.BadRequestError) as info:  # vLLM's answer for a finished response
        one.responses.cancel(first.id)
    assert "Cannot cancel a synchronous response." in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve("resp_" + "0" * 16)


def test_store_false_is_not_stored(fleet, agent_stack, qwen3_tokenizer):
    two_turns(agent_stack, qwen3_tokenizer)
    response = client(fleet[0]).responses.create(model="qwen3", input=QUESTION, store=False)
    with pytest.raises(openai.NotFoundError):
        client(fleet[1]).responses.retrieve(response.id)


def test_background_is_refused_clearly(fleet, agent_stack):
    before = agent_stack.sim_received()
    with pytest.raises(openai.BadRequestError) as info:
        client(fleet[0]).responses.create(model="qwen3", input=QUESTION, background=True)
    assert info.value.body["param"] == "background"
    assert agent_stack.sim_received() == before


def test_the_store_going_away_is_a_503_before_the_producer_then_serves_again(fleet, agent_stack, redis_server, qwen3_tokenizer):
    two_turns(agent_stack, qwen3_tokenizer)
    kept = client(fleet[0]).responses.create(model="qwen3", input=QUESTION)
    redis_server.stop()
    try:
        before = agent_stack.sim_received()
        for stream in (False, True):
            r = httpx.post(fleet[1] + "/responses", json={"model": "qwen3", "input": QUESTION, "stream": stream}, timeout=60)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "ServiceUnavailableError" and "store" in r.json()["error"]["message"]
        r = httpx.post(fleet[0] + "/responses", json={"model": "qwen3", "input": "and tomorrow?",
                                                      "previous_response_id": kept.id}, timeout=60)
        assert r.status_code == 503
        assert httpx.get(fleet[0] + f"/responses/{kept.id}", timeout=30).status_code == 503
        assert agent_stack.sim_received() == before  # nothing generated that could not be stored
        # A response nobody asked to store needs no store.
        assert client(fleet[1]).responses.create(model="qwen3", input=QUESTION, store=False).status == "completed"
    finally:
        redis_server.start()
    wait_for(lambda: httpx.post(fleet[0] + "/responses", json={"model": "qwen3", "input": QUESTION}, timeout=60).status_code == 200,
             "the filters to use the store again", timeout=30)
