"""OpenAI Responses through the real Envoy: the official ``openai`` SDK and the OpenAI Agents SDK.

Event-by-event parity with vLLM's coupled ``OpenAIServingResponses`` is in
``test_parity.py`` (the ``responses:`` rows); here: what agent clients do with it,
the streamed and the batch answer agreeing, vLLM's store-off behaviour, bad input
and faults.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from agent_turns import FINAL, IM_END, QUESTION, THINKING, TOOL_RESULT, encode, tool_call_answer, two_turns
from agent_turns import WEATHER_FUNCTION as WEATHER
from stack import wait_for

def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)


def parts(response) -> dict:
    """What a client uses of a response: reasoning, text, function calls."""
    reasoning = "".join(c.text for item in response.output if item.type == "reasoning" for c in item.content or ())
    calls = [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]
    return {"reasoning": reasoning, "text": response.output_text, "calls": calls}


def test_create_and_stream_give_a_client_the_same_reasoning_and_call(agents, qwen3_tokenizer):
    two_turns(agents, qwen3_tokenizer)
    client = sdk(agents)
    response = client.responses.create(model="qwen3", input=QUESTION, tools=[WEATHER], instructions="Be brief.")
    assert response.status == "completed" and response.model == "qwen3"
    assert parts(response) == {"reasoning": f"\n{THINKING}\n", "text": "", "calls": [("get_weather", {"city": "Paris 🗼"})]}
    assert response.usage.output_tokens == len(tool_call_answer(qwen3_tokenizer))

    with client.responses.stream(model="qwen3", input=QUESTION, tools=[WEATHER], instructions="Be brief.") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.reasoning_text.delta" in kinds
    # vLLM 0.33.0 streams the "\n\n" between </think> and <tool_call> as a message item of its
    # own (seen on its coupled server; test_parity's responses rows match it event for event),
    # which the batch answer omits: whitespace, nothing a client loses.
    streamed = parts(final)
    assert streamed["text"].strip() == ""
    assert {**streamed, "text": ""} == parts(response)
    assert final.usage.output_tokens == response.usage.output_tokens
    assert final.usage.input_tokens == response.usage.input_tokens == len(agents.sim_requests()[-1]["token_ids"])


def test_a_whole_history_resent_each_turn_renders_the_tool_result(agents, qwen3_tokenizer):
    """Codex-style clients re-send the whole history (no previous_response_id)."""
    two_turns(agents, qwen3_tokenizer)
    client = sdk(agents)
    first = client.responses.create(model="qwen3", input=QUESTION, tools=[WEATHER])
    call = next(item for item in first.output if item.type == "function_call")
    history = [{"role": "user", "content": QUESTION}, *[item.model_dump(exclude_none=True) for item in first.output
                                                         if item.type == "function_call"],
               {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}]
    second = client.responses.create(model="qwen3", input=history, tools=[WEATHER])
    assert second.output_text.strip() == FINAL
    prompt = qwen3_tokenizer.decode(agents.sim_requests()[-1]["token_ids"], skip_special_tokens=False)
    assert TOOL_RESULT in prompt and QUESTION in prompt


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk_runs_a_tool_agent_to_completion(agents, qwen3_tokenizer, api):
    from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    two_turns(agents, qwen3_tokenizer)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        calls.append(city)
        return TOOL_RESULT

    client = openai.AsyncOpenAI(base_url=agents.base_url, api_key="unused", max_retries=0, timeout=60)
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                  model=kind(model="qwen3", openai_client=client))
    before = agents.sim_received()
    result = asyncio.run(Runner.run(agent, QUESTION))
    assert calls == ["Paris 🗼"]
    assert result.final_output.strip() == FINAL
    assert agents.sim_received() == before + 2  # two model turns


def test_streamed_agent_run_through_responses(agents, qwen3_tokenizer):
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    two_turns(agents, qwen3_tokenizer)

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        return TOOL_RESULT

    client = openai.AsyncOpenAI(base_url=agents.base_url, api_key="unused", max_retries=0, timeout=60)
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                  model=OpenAIResponsesModel(model="qwen3", openai_client=client))

    async def run():
        result = Runner.run_streamed(agent, QUESTION)
        kinds = [event.type async for event in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert result.final_output.strip() == FINAL
    assert "raw_response_event" in kinds


def test_store_is_off_as_in_vllm(agents, qwen3_tokenizer):
    """vLLM 0.33 without VLLM_ENABLE_RESPONSES_API_STORE: store is ignored; a stored response
    cannot be found, continued or cancelled (its 404)."""
    two_turns(agents, qwen3_tokenizer)
    client = sdk(agents)
    response = client.responses.create(model="qwen3", input=QUESTION, tools=[WEATHER], store=True)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(response.id)
    assert info.value.body["message"] == f"Response with id '{response.id}' not found."
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel(response.id)
    before = agents.sim_received()
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="qwen3", input="and tomorrow?", previous_response_id=response.id)
    assert response.id in info.value.body["message"]
    assert agents.sim_received() == before
    assert httpx.delete(agents.base_url + f"/responses/{response.id}", timeout=10).status_code == 405


@pytest.mark.parametrize(
    "body, says",
    [
        ({"model": "qwen3", "input": 5}, "input"),
        ({"model": "qwen3", "input": "hi", "tools": [{"type": "function", "name": "x", "parameters": "s"}]}, "parameters"),
        ({"model": "qwen3", "input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
        ({"model": "qwen3", "input": "hi", "tools": [{"type": "retrieval"}]}, "tools"),
    ],
    ids=["input-wrong-type", "tool-parameters-not-an-object", "max-output-tokens-wrong-type", "unknown-tool-type"],
)
def test_bad_input_gets_a_400_and_nothing_reaches_the_producer(agents, body, says):
    before = agents.sim_received()
    r = httpx.post(agents.base_url + "/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and says in error["message"]
    assert agents.sim_received() == before


def test_unknown_model_is_vllms_404(agents):
    before = agents.sim_received()
    with pytest.raises(openai.NotFoundError) as info:
        sdk(agents).responses.create(model="gpt-9", input="hi")
    assert "gpt-9" in str(info.value)
    assert agents.sim_received() == before


def test_a_producer_failure_mid_stream_ends_with_vllms_error_event(agents, qwen3_tokenizer):
    two_turns(agents, qwen3_tokenizer)
    agents.sim_config(error_after=5)
    with httpx.stream("POST", agents.base_url + "/responses", timeout=60,
                      json={"model": "qwen3", "input": QUESTION, "tools": [WEATHER], "stream": True}) as r:
        assert r.status_code == 200
        frames = [f for f in r.read().decode().split("\n\n") if f]
    names = [f.split("\n", 1)[0].removeprefix("event: ") for f in frames]
    assert names[0] == "response.created" and names[-1] == "error", names
    assert "response.completed" not in names
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    assert events[-1]["type"] == "error" and events[-1]["code"] in ("500", "502", "503")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_vllm_itself_cuts_a_responses_stream_when_its_engine_fails(qwen3_dir, qwen3_tokenizer):
    """Why the filter writes that error event itself: vLLM 0.33.0's responses_stream_generator
    meets a GenerationError by validating the chat-shaped error JSON as a Responses event, which
    raises, so its server cuts the stream with no event (nothing a client can use)."""
    import pydantic
    from reference import CoupledChat, ScriptedEngine, Step, coupled_responses
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.exceptions import GenerationError

    coupled = CoupledChat(qwen3_dir, "--served-model-name", "qwen3", "--max-model-len", "4096",
                          "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")

    class Failing(ScriptedEngine):
        async def generate(self, *args, **kwargs):
            async for out in super().generate(*args, **kwargs):
                yield out
            raise GenerationError("boom")

    ids = encode(qwen3_tokenizer, "<think>\nhm")
    engine = Failing(coupled.vllm_config, coupled.state.online_renderer.renderer, [Step(0, ids)])
    serving = coupled_responses(coupled, engine)

    async def run():
        stream = await serving.create_responses(ResponsesRequest.model_validate(
            {"model": "qwen3", "input": "hi", "stream": True}))
        return [event.type async for event in stream]

    with pytest.raises(pydantic.ValidationError):
        asyncio.run(run())


def test_a_client_that_goes_away_aborts_the_producer_request(agents, qwen3_tokenizer):
    agents.script.set({"token_ids": encode(qwen3_tokenizer, "word " * 400) + [IM_END]})
    agents.sim_config(delay=0.02)
    before = len(agents.sim_aborted())
    with httpx.stream("POST", agents.base_url + "/responses", timeout=60,
                      json={"model": "qwen3", "input": QUESTION, "stream": True}) as r:
        for line in r.iter_lines():
            if ".delta" in line:
                break
    wait_for(lambda: len(agents.sim_aborted()) > before, "the producer request's abort", timeout=30)


@pytest.mark.parametrize("tool", [{"type": "mcp", "server_label": "files", "server_url": "http://127.0.0.1:1/mcp"},
                                  {"type": "code_interpreter", "container": {"type": "auto"}}], ids=["mcp", "code_interpreter"])
def test_builtin_tools_that_run_inside_the_request_are_refused(agents, tool):
    before = agents.sim_received()
    with pytest.raises(openai.BadRequestError) as info:
        sdk(agents).responses.create(model="qwen3", input=QUESTION, tools=[WEATHER, tool])
    assert info.value.body["param"] == "tools" and f"tools[1] is a built-in tool ('{tool['type']}')" in info.value.body["message"]
    assert agents.sim_received() == before


def test_hosted_tools_beside_functions_are_left_to_vllm(agents, qwen3_tokenizer, qwen3_dir):
    """Codex-style tool lists mix functions with hosted tools: vLLM without a tool server renders
    the functions only; the prompt is the one vLLM's /v1/responses/render makes."""
    from reference import CoupledChat
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    two_turns(agents, qwen3_tokenizer)
    tools = [WEATHER, {"type": "web_search"}, {"type": "image_generation"}]
    response = sdk(agents).responses.create(model="qwen3", input=QUESTION, tools=tools)
    assert parts(response)["calls"] == [("get_weather", {"city": "Paris 🗼"})]
    coupled = CoupledChat(qwen3_dir, "--served-model-name", "qwen3", "--max-model-len", "4096",
                          "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    rendered = asyncio.run(coupled.state.serving_render.render_responses_request(
        ResponsesRequest.model_validate({"model": "qwen3", "input": QUESTION, "tools": tools})))
    assert agents.sim_requests()[-1]["token_ids"] == list(rendered.token_ids)


APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch to the files."}


@pytest.mark.parametrize("stream", [False, True])
def test_codex_grammar_custom_tools_get_vllms_400_and_text_ones_are_served(agents, qwen3_tokenizer, stream):
    """Codex with an OpenAI model catalog sends ``apply_patch`` as a custom tool with a Lark grammar:
    vLLM 0.33's own request model refuses it, and the client gets that 400 (the oracle: vLLM's
    ``ResponsesRequest`` in process) with nothing sent to a producer. A free-form text custom tool
    (Codex's default tools, too) is served."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    grammar = {**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'}}
    body = {"model": "qwen3", "input": "fix the bug", "tools": [grammar], "stream": stream}
    with pytest.raises(Exception) as vllm_says:
        ResponsesRequest.model_validate(body)
    before = agents.sim_received()
    r = httpx.post(agents.base_url + "/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    want = create_error_response(vllm_says.value).error
    assert (error["message"], error["param"], error["code"]) == (want.message, "tools", 400), (error, want)
    assert "grammar format are not supported" in error["message"]
    assert agents.sim_received() == before

    agents.script.set({"index": 0, "token_ids": encode(qwen3_tokenizer, "<think>\nA patch.\n</think>\n\nDone.") + [IM_END]})
    text = {**APPLY_PATCH, "format": {"type": "text"}}
    response = sdk(agents).responses.create(model="qwen3", input="fix the bug", tools=[text])
    assert response.status == "completed" and response.output_text.strip() == "Done.", response
    assert agents.sim_received() == before + 1
