"""Chunk-for-chunk parity with vLLM 0.33.0's coupled ``/v1/chat/completions``.

For every case the same token ids, cut into the same engine steps, go through two paths:
1. the filter: client -> real Envoy -> filter -> simulator replaying the script;
2. the reference (``tests/reference.py``): vLLM's own ``OpenAIServingChat`` with its
   real ``InputProcessor`` / ``OutputProcessor``, only the GPU engine core scripted.
Both are built from the same ``vllm serve`` flags. Compared: the prompt token ids the
producer got (render parity) and the sampling params, the assembled message per choice,
the sequence of non-empty deltas, and every SSE event after normalizing only the
per-run values (``id``, ``created``, ``system_fingerprint``, tool-call ids by shape).

One stack and one reference per model config, for all its cases. Set
``DERENDER_PARITY_TABLE=path.md`` to write the case x model table.
"""

from __future__ import annotations

import json
import os

import pytest
from parity_cases import CASES, LEAK, STOP_DESYNC, STOP_KEPT, Case, cases_for, upstream, with_image
from parity_compare import (
    ParityTable,
    assemble,
    assemble_anthropic,
    assemble_responses,
    normalize_anthropic,
    normalize_message,
    normalize_responses,
    deltas,
    normalize_events,
    normalize_response,
)
from stack import wait_for
from parity_paths import (
    MODELS,
    Served,
    Servers,
    producer_steps,
    through_envoy,
    through_sdk,
)
from reference import Step, named_events, run_responses

COMMAND = "DERENDER_PARITY_TABLE=parity_table.md .venv/bin/python -m pytest tests/test_parity.py -q"
# Sampling params the producer must get as the coupled engine would (stop strings stay with the filter).
PARAMS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "logprobs",
          "skip_special_tokens", "spaces_between_special_tokens", "stop_token_ids", "ignore_eos",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words")


def pytest_generate_tests(metafunc):
    # (model, case) pairs where the model config has the feature, grouped by model so that
    # one model's stack serves all its cases (see ``Servers``).
    if "model" in metafunc.fixturenames:
        pairs = [(model, name) for model in MODELS
                 for name in [*cases_for(model), *(MESSAGES + n for n in cases_for(model) if n in MESSAGES_CASES),
                              *(RESPONSES + n for n in cases_for(model) if n in RESPONSES_CASES)]]
        ids = [f"{m}-{n}" + "".join(f" [{bug}]" for bug in ((n in CASES) and upstream(n, m) or ())) for m, n in pairs]
        metafunc.parametrize(("model", "case_name"), pairs, ids=ids)


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory):
    """The model configs, served in the order the selected cases need them."""
    order = [item.callspec.params["model"] for item in request.session.items
             if item.module is request.module and hasattr(item, "callspec")]
    pool = Servers(tmp_path_factory, list(dict.fromkeys(order)))
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def table():
    table = ParityTable()
    yield table
    if path := os.environ.get("DERENDER_PARITY_TABLE"):
        table.write(path, [*CASES, *(MESSAGES + n for n in MESSAGES_CASES), *(RESPONSES + n for n in RESPONSES_CASES)], COMMAND)


def as_tuples(steps: list[Step]) -> list[tuple]:
    return [(s.index, s.token_ids, s.finish_reason, s.stop_reason) for s in steps]


# -- checks ----------------------------------------------------------------------------------
def public(params) -> dict | None:
    """A params object's public fields (engine-side choices like ``_backend`` left out)."""
    return None if params is None else {k: v for k, v in vars(params).items() if not k.startswith("_")}


def check_render(sent: dict, captured, body: dict) -> None:
    """The producer got the prompt and sampling params the coupled engine would have."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    assert sent["token_ids"] == captured.prompt_token_ids, "prompt token ids differ from vLLM's render"
    check_media(sent, captured)
    sp = GenerateRequest.model_validate(sent).sampling_params  # as the producer reads it
    ref = captured.sampling_params
    for name in PARAMS:
        assert getattr(sp, name) == getattr(ref, name), f"sampling_params.{name}: {getattr(sp, name)!r} != {getattr(ref, name)!r}"
    assert public(sp.structured_outputs) == public(ref.structured_outputs), "structured outputs differ"
    assert ref.stop == (body.get("stop") or [])
    assert not sp.stop, "stop strings must stay with the filter"


def check_media(sent: dict, captured) -> None:
    """The producer got the images the coupled engine did: content hashes and placeholder ranges."""
    features = sent.get("features") or {}
    media = sorted((digest, r["offset"], r["length"]) for modality, digests in features.get("mm_hashes", {}).items()
                   for digest, r in zip(digests, features["mm_placeholders"][modality]))
    assert media == sorted(captured.media), "images differ from vLLM's"
    assert all(item for items in (features.get("kwargs_data") or {}).values() for item in items), "tensors missing"


def check_case_shape(case: Case, message: dict) -> None:
    """The reference's first choice shows what the case is about (no case passes on two empty answers)."""
    e = case.expect
    if "reasoning" in e:
        assert bool(message["reasoning"]) == e["reasoning"], message
    if "tools" in e:
        assert [t["name"] for t in message["tool_calls"]] == e["tools"], message
    text = message["content"] + message["reasoning"] + json.dumps([t["arguments"] for t in message["tool_calls"]], ensure_ascii=False)
    for piece in e.get("text", ()):  # the tokenizer decodes what was scripted
        assert piece in text, f"{piece!r} not in {text!r}"
    if e.get("logprobs"):
        assert message["logprobs"] and any(lp["top_logprobs"] for lp in message["logprobs"])
    if "stop" in e:  # a stop string or stop token ended the answer
        assert message["finish_reason"] == "stop" and message["stop_reason"] == e["stop"], message
    assert message["content"] or message["reasoning"] or message["tool_calls"] or e.get("reasoning") is False


def check_parser_free(case: Case, ref: dict, events: list) -> None:
    """No parser: no reasoning field, the think block in the content; a step whose token ends no
    character still streams a chunk with ``"content": ""`` (the README's example)."""
    message = ref["choices"][0]
    assert not message["reasoning"] and not message["tool_calls"], message
    for piece in case.expect.get("text", ()):
        assert piece in message["content"], (piece, message["content"])
    if "reasoning" in case.name:
        assert message["content"].startswith("<think>"), message["content"][:40]
    if case.name == "plain chunks=1":  # the flag emoji takes several tokens
        empty = [e for e in events[1:] if isinstance(e, dict) and e.get("choices")
                 and e["choices"][0].get("delta") == {"content": ""}]
        assert empty, "no step without a whole character"


def split(message: dict) -> tuple[str, str]:
    return (message.get("content") or "", message.get("reasoning") or "")


def check_upstream_bugs(bugs: tuple[str, ...], case: Case, streamed: dict, full: dict | None) -> None:
    """The vLLM bugs a case is marked with show in vLLM's own stream, and no others do.

    ``full`` is vLLM's non-streaming answer for the same tokens (stop-string cases): the
    reference split of reasoning and content.
    """
    def agrees(bug: str, shows: bool) -> None:
        assert shows == (bug in bugs), f"{bug} {'shows unmarked' if shows else 'does not show'} in vLLM's stream"

    messages = list(streamed["choices"].values())
    agrees(LEAK, any("<think>" in m["reasoning"] for m in messages))
    if full is not None:
        agrees(STOP_DESYNC, any(split(m) != split(c["message"]) for m, c in zip(messages, full["choices"])))
        stop_text, dropped = case.expect["stop_text"], not case.body.get("include_stop_str_in_output")
        agrees(STOP_KEPT, dropped and (messages[0]["content"] or messages[0]["reasoning"]).endswith(stop_text))


def wait_for_abort(served: Served, request_id: str) -> None:
    engine_id = f"generate-tokens-{request_id.removeprefix('chatcmpl-')}"
    wait_for(lambda: engine_id in served.stack.sim_aborted(), "the producer request's abort at the stop string", timeout=10)


def run_case(served: Served, case: Case, bugs: tuple[str, ...]) -> None:
    served.script.write_text("".join(json.dumps(line) + "\n" for line in case.script()))
    served.stack.sim_config(mode="script", tokens_per_event=1, finish_only_tail=case.tail, delay=case.delay, split_writes=1)
    body = {"model": served.name, "stream": True, **case.body}
    if getattr(served.answers, "image", False):
        body["messages"] = with_image(body["messages"], "chat")
    steps = case.steps()

    got = through_envoy(served, body)
    sent = served.stack.sim_requests()[-1]
    want, captured = served.reference.run(body, steps)

    check_render(sent, captured, body)
    assert producer_steps(served, sent) == as_tuples(steps), "the simulator did not replay the scripted engine steps"

    mine, ref = assemble(got), assemble(want)
    assert mine == ref, "assembled messages differ"
    assert deltas(got) == deltas(want), "delta sequences differ"
    assert normalize_events(got) == normalize_events(want), "SSE events differ"

    if getattr(served.answers, "parsers", True):
        check_case_shape(case, ref["choices"][0])
    else:  # no parser: the reasoning and any markup are content, as vLLM streams them
        check_parser_free(case, ref, want)
    full = served.reference.run(non_streaming(body), steps)[0] if "stop" in case.expect else None
    check_upstream_bugs(bugs, case, ref, full)

    if "absent" in case.expect:
        text = "".join(json.dumps(e, ensure_ascii=False) for e in got)
        assert case.expect["absent"] not in text, "text after the stop reached the client"
    if isinstance(case.expect.get("stop"), str):  # stop strings are the filter's: it aborts the producer
        wait_for_abort(served, got[0]["id"])

    if case.sdk:
        assert normalize_events(through_sdk(served, body)) == normalize_events(want), "openai SDK view differs"

    if case.full:
        body = non_streaming(body)
        got_full = through_envoy(served, body)
        want_full, _ = served.reference.run(body, steps)
        assert normalize_response(got_full) == normalize_response(want_full), "non-streaming response differs"
        if isinstance(case.expect.get("stop"), str):  # streamed from the producer, so it can stop it in time
            assert served.stack.sim_requests()[-1]["stream"] is True
            wait_for_abort(served, got_full["id"])


def non_streaming(body: dict) -> dict:
    return {**{k: v for k, v in body.items() if k != "stream_options"}, "stream": False}


def test_parity(servers: Servers, model: str, case_name: str, table: ParityTable):
    served = servers.get(model)
    endpoint, _, name = case_name.rpartition(": ")
    case = CASES[name](served.answers)
    bugs = () if endpoint else upstream(name, model)
    ok = False
    try:
        {"": run_case, "messages": run_messages_case, "responses": run_responses_case}[endpoint](served, case, bugs)
        ok = True
    finally:
        table.record(case_name, model, ok, bugs)


# -- Anthropic Messages: the same engine steps through /v1/messages --------------------------
MESSAGES = "messages: "
MESSAGES_CASES = [f"{kind} chunks={how}" for kind in ("plain", "reasoning", "tool", "reasoning+tool")
                  for how in ("1", "3-4", "tail")] + ["stop string across events"]


def anthropic_body(case: Case, model: str) -> dict:
    """The case's request as an Anthropic client sends it."""
    body = {"model": model, "max_tokens": 1024, "messages": case.body["messages"]}
    if tools := case.body.get("tools"):
        body["tools"] = [{"name": t["function"]["name"], "description": t["function"]["description"],
                          "input_schema": t["function"]["parameters"]} for t in tools]
    if stop := case.body.get("stop"):
        body["stop_sequences"] = stop
    return body


def messages_through_envoy(served: Served, body: dict) -> list | dict:
    return through_envoy(served, body, "/messages", named_events)


def replay(served: Served, case: Case, body: dict, through, reference) -> tuple:
    """The case's engine steps through Envoy + filter (``through``) and through vLLM's coupled
    server in process (``reference``); checks the producer got what the coupled engine did."""
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    served.script.write_text("".join(json.dumps(line) + "\n" for line in case.script()))
    served.stack.sim_config(mode="script", tokens_per_event=1, finish_only_tail=case.tail, delay=case.delay, split_writes=1)
    steps = case.steps()
    got = through(served, body)
    sent = served.stack.sim_requests()[-1]
    want, captured = reference(body, steps)
    assert sent["token_ids"] == captured.prompt_token_ids, "prompt token ids differ from vLLM's render"
    check_media(sent, captured)
    sp = GenerateRequest.model_validate(sent).sampling_params
    for name in PARAMS:
        assert getattr(sp, name) == getattr(captured.sampling_params, name), f"sampling_params.{name}"
    assert not sp.stop, "stop strings must stay with the filter"
    assert producer_steps(served, sent) == as_tuples(steps), "the simulator did not replay the scripted engine steps"
    return got, want, captured, steps


def run_messages_case(served: Served, case: Case, bugs: tuple[str, ...]) -> None:
    body = {**anthropic_body(case, served.name), "stream": True}
    if getattr(served.answers, "image", False):
        body["messages"] = with_image(body["messages"], "messages")
    got, want, captured, steps = replay(served, case, body, messages_through_envoy, served.reference.run_messages)
    assert captured.sampling_params.stop == (body.get("stop_sequences") or [])

    mine, ref = assemble_anthropic(got), assemble_anthropic(want)
    assert mine == ref, "assembled messages differ"
    assert normalize_anthropic(got) == normalize_anthropic(want), "SSE events differ"

    # The case is what it says, in vLLM's answer (with a parser: no parser leaves it all text).
    kinds = [b["type"] for b in ref["content"]]
    e = case.expect if getattr(served.answers, "parsers", True) else {"tools": []}
    assert [b["name"] for b in ref["content"] if b["type"] == "tool_use"] == e.get("tools", [])
    assert ("thinking" in kinds) == bool(e.get("reasoning")) or e.get("reasoning") is None
    if "stop" in e:
        assert ref["stop_reason"] == "stop_sequence" and ref["stop_sequence"] == e["stop"], ref
        wait_for_abort(served, got[0][1]["message"]["id"])

    if case.full:
        body = {**body, "stream": False}
        got_full = messages_through_envoy(served, body)
        want_full, _ = served.reference.run_messages(body, steps)
        assert normalize_message(got_full) == normalize_message(want_full), "non-streaming message differs"


# -- OpenAI Responses: the same engine steps through /v1/responses ---------------------------
RESPONSES = "responses: "
RESPONSES_CASES = [f"{kind} chunks={how}" for kind in ("plain", "reasoning", "tool", "reasoning+tool")
                   for how in ("1", "3-4", "tail")] + ["length cuts a tool call"]


def responses_body(case: Case, model: str) -> dict:
    """The case's request as a Responses client sends it."""
    body = {"model": model, "input": case.body["messages"]}
    if tools := case.body.get("tools"):
        body["tools"] = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                          "parameters": t["function"]["parameters"]} for t in tools]
    if "max_tokens" in case.body:
        body["max_output_tokens"] = case.body["max_tokens"]
    return body


def responses_through_envoy(served: Served, body: dict) -> list | dict:
    return through_envoy(served, body, "/responses", named_events)


def run_responses_case(served: Served, case: Case, bugs: tuple[str, ...]) -> None:
    body = {**responses_body(case, served.name), "stream": True}
    if getattr(served.answers, "image", False):
        body["input"] = with_image(body["input"], "responses")
    got, want, _, steps = replay(served, case, body, responses_through_envoy,
                                 lambda body, steps: run_responses(served.reference, body, steps))

    mine, ref = assemble_responses(got), assemble_responses(want)
    assert mine == ref, "assembled responses differ"
    assert normalize_responses(got) == normalize_responses(want), "SSE events differ"

    e = case.expect if getattr(served.answers, "parsers", True) else {"tools": []}
    assert [name for name, _ in ref["calls"]] == e.get("tools", []), ref
    if e.get("reasoning"):
        assert ref["reasoning"], ref
    if case.full or "length" in case.name:
        body = {**body, "stream": False}
        got_full = responses_through_envoy(served, body)
        want_full, _ = run_responses(served.reference, body, steps)
        assert normalize_responses(got_full) == normalize_responses(want_full), "non-streaming response differs"
