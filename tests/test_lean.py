"""The lean chat path (``translate/lean.py``) against vLLM's: the same bytes for any stream.

For every tokenizer and parser configuration the parity suite serves (qwen3 + hermes,
deepseek-r1, gpt-oss's Harmony parsers, qwen3 without parsers), hypothesis draws an answer
(reasoning, content and tool calls of any text, in the model's own markup, or none of it), the
request's options (usage, tool_choice, parallel_tool_calls, include_reasoning, thinking off,
stop strings, max_tokens) and how the engine cut it into events (any sizes, a finish-only tail,
a length cut). The same producer events go through ``ChatStream`` (vLLM's generator for every
event) and ``LeanChatStream``; the client bytes must be identical, and the lean stream must have
done the middle events itself (so the test compares two paths, not one with itself).
"""

from __future__ import annotations

import asyncio
import json
import re

import pydantic_core
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parity_cases import ANSWERS, PARIS, TOOLS
from parity_paths import ASSET, MAX_MODEL_LEN, MODELS

from derender.ops import assets
from derender.settings import Settings

_MODELS: dict = {}


def served(name: str):
    """The ``Model`` of one parity configuration, built from the flags ``derender serve`` gets."""
    if name not in _MODELS:
        from derender.cli import build_parser
        from derender.options import model_spec
        from derender.translate.model import Model

        model_dir = str(assets.fetch(ASSET.get(name, name), quiet=True))
        args = build_parser().parse_args(
            ["serve", "--model", model_dir, "--served-model-name", name, "--max-model-len", MAX_MODEL_LEN, *MODELS[name]]
        )
        _MODELS[name] = (Model(model_spec(args)), ANSWERS[name](model_dir))
    return _MODELS[name]


@pytest.fixture(scope="module", autouse=True)
def _models_for_this_file_only():
    """The models ``served`` built live as long as this file's tests (conftest then frees them)."""
    yield
    _MODELS.clear()


def render(model, body: dict):
    from derender.translate.render import render_chat

    return asyncio.run(render_chat(model, json.dumps(body).encode(), "lean-diff"))


def events(ids: list[int], sizes: list[int], tail: bool, finish: str) -> list[bytes]:
    """The producer's SSE payloads for one choice: ``ids`` cut by ``sizes`` (cycled), then usage."""
    groups, at, k = [], 0, 0
    while at < len(ids):
        size = sizes[k % len(sizes)]
        groups.append(ids[at : at + size])
        at, k = at + size, k + 1
    if tail or not groups:
        groups.append([])
    payloads = []
    for i, group in enumerate(groups):
        last = i == len(groups) - 1
        choice = {"index": 0, "finish_reason": finish if last else None, "stop_reason": None, "token_ids": group,
                  "routed_experts": None, "sampling_mask": None, "weight_versions": None, "logprobs": None}
        payloads.append(pydantic_core.to_json(
            {"request_id": "generate-tokens-lean-diff", "usage": None, "output_mode": "tokens", "choices": [choice]}))
    usage = {"prompt_tokens": 9, "total_tokens": 9 + len(ids), "completion_tokens": len(ids)}
    payloads.append(pydantic_core.to_json(
        {"request_id": "generate-tokens-lean-diff", "usage": usage, "output_mode": "tokens", "choices": []}))
    return payloads + [b"[DONE]"]


def run(stream, payloads: list[bytes]) -> bytes:
    """What the client gets from one stream object fed these events, as the exchange feeds it."""
    async def go() -> bytes:
        stream.start()
        out = [stream.feed(p)[0] for p in payloads]
        if not stream.finished:
            out.append(stream.end())
        return b"".join(out)

    return asyncio.run(go())


CREATED = re.compile(rb'"created":\d+')
TOOL_CALL_ID = re.compile(rb'"id":"(chatcmpl-tool|call)[_-][0-9a-zA-Z-]{8,}"')  # random per call, in vLLM too


def run_vllm(stream, payloads: list[bytes]) -> bytes:
    """``run`` with vLLM's parser modules on vLLM's own objects, as vLLM's own server runs them (the
    lean path's ``parser_tables.patch_parsers`` is undone while it runs)."""
    from derender.translate import parser_tables

    with parser_tables.unpatched():
        return run(stream, payloads)


def normal(data: bytes) -> bytes:
    return TOOL_CALL_ID.sub(b'"id":"call-id"', CREATED.sub(b'"created":0', data))


def vllm_path(model):
    """``model`` served on vLLM's path for every event (``--stream-path vllm``)."""
    return model.with_settings(Settings(stream_path="vllm"))


def both_paths(model, body: dict, payloads: list[bytes]) -> tuple[bytes, bytes, int, int]:
    """(vLLM's bytes, the lean path's bytes, middle events the lean path did itself, of those
    the events it did without vLLM's output processor)."""
    from derender.translate import lean
    from derender.translate.stream import ChatStream

    reference, rendered = render(model, body), render(model, body)
    assert reference.request_id == rendered.request_id
    assert lean.eligible(model, rendered), body
    lean_stream = lean.LeanChatStream(model, rendered)
    vllm_stream = ChatStream(vllm_path(model), reference)
    assert vllm_stream.outputs.direct_state is None
    vllm_bytes = run_vllm(vllm_stream, payloads)
    lean_bytes = run(lean_stream, payloads)
    # ``created`` is the second each generator started in, tool call ids are random: all else is equal.
    return normal(vllm_bytes), normal(lean_bytes), lean_stream.handled, lean_stream.direct


# Text that stresses detokenization and the parsers: multi-byte characters, markup look-alikes,
# JSON punctuation, whitespace runs.
ALPHABET = st.sampled_from(list("ab Z09 \n\t.,:;!?\"'\\{}[]<>/=_-") + ["é", "ß", "巴黎", "東京", "🤖", "🇫🇷", "☔",
                                                                        "🧑‍🚀", "</", "<think>", "</think>", "<tool_call>",
                                                                        "{\"", "\"}", "  ", "\u00a0", "\u2028"])
TEXT = st.lists(ALPHABET, max_size=24).map("".join)
CALL = st.tuples(st.sampled_from(["get_weather", "get_time"]),
                 st.one_of(st.just(PARIS), st.dictionaries(st.sampled_from(["city", "tz", "note"]), TEXT, max_size=2)))


@st.composite
def streams(draw, name: str, thinking_off: bool = True, stop: bool = True):
    """A request and the producer's events for it. ``thinking_off``: the request may turn thinking
    off (``chat_template_kwargs``, which only a chat request can say; without it a drawn answer
    without thinking is still drawn, asked for with thinking on). ``stop``: it may name a stop
    string (Messages says it as ``stop_sequences``; Responses has none)."""
    _, answers = served(name)
    tools = answers.tools
    think = draw(st.booleans()) if name in ("qwen3", "qwen3-no-parser") else True
    reasoning = draw(st.one_of(st.none(), TEXT))
    content = draw(TEXT)
    calls = draw(st.lists(CALL, max_size=2)) if name != "deepseek-r1" else []
    if not calls and not content and reasoning is None:
        content = "ok"
    ids = answers.answer(reasoning, content, calls, end=True, think=think)
    if draw(st.integers(0, 5)) == 0:  # any ids at all, special tokens included, then the model's EOS
        vocab = served(name)[0].model_config.get_vocab_size()
        ids = draw(st.lists(st.integers(0, vocab - 1), max_size=30)) + [answers.eos]
    finish = "stop"
    cut = draw(st.one_of(st.none(), st.integers(1, max(1, len(ids) - 1))))
    if cut is not None and cut < len(ids):
        ids, finish = ids[:cut], "length"
    tail = finish == "stop" and draw(st.booleans())
    if tail:  # a finish-only tail event reports the stop, its token unsent (as the parity cases do)
        ids = ids[:-1]
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=6))
    body: dict = {"model": name, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                  "stream": True, "max_tokens": 2000}
    if draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    if tools and draw(st.booleans()):
        body["tools"] = TOOLS
        body["tool_choice"] = draw(st.sampled_from(
            ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]))
        body["parallel_tool_calls"] = draw(st.booleans())
    if draw(st.integers(0, 3)) == 0:
        body["include_reasoning"] = False
    if not think and thinking_off:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    if stop and content and draw(st.integers(0, 4)) == 0:
        word = content[len(content) // 3 : len(content) // 3 + 2].strip()
        if word:
            body["stop"] = [word]
    return body, events(ids, sizes, tail, finish)


NAMES = list(MODELS)


@pytest.mark.parametrize("name", NAMES)
def test_lean_path_sends_vllms_bytes(name):
    model, _ = served(name)
    done = []

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(streams(name))
    def check(drawn):
        body, payloads = drawn
        vllm_bytes, lean_bytes, handled, direct = both_paths(model, body, payloads)
        assert lean_bytes == vllm_bytes, body
        middle = max(0, sum(1 for p in payloads if b'"choices":[{' in p) - 2)  # neither the first nor the last
        done.append((handled, middle, direct))

    check()
    # The test compares two paths: the lean one did the middle events itself (a stop string that
    # ends a stream early leaves the rest of its events to nobody), most of them without vLLM's
    # output processor (all but the first middle event of a stream without stop strings).
    handled, middle, direct = (sum(d[i] for d in done) for i in range(3))
    assert middle > 0 and handled >= middle // 3, (handled, middle)  # 0.6-1.0 seen
    after_first = sum(max(0, m - 1) for _, m, _ in done)
    assert after_first > 0 and direct >= after_first // 3, (direct, after_first)


# The configurations whose vLLM parsers run on vLLM's declarative parser engine (the others have no
# drop table to share: DeepSeek-R1's reasoning parser, gpt-oss's Harmony, no parser at all).
ENGINE_PARSERS = ("qwen3", "qwen2-vl")


SIGNATURE = re.compile(rb'"signature":"[0-9a-f]{32}"')  # a thinking block's, uuid4 per block in vLLM too
TOOL_USE_ID = re.compile(rb'"id":"(chatcmpl-tool|call|toolu)[_-][0-9a-zA-Z-]{8,}"')


def messages_body(chat: dict) -> dict:
    """The Anthropic Messages request asking what ``chat`` asks (stop strings as stop_sequences)."""
    body = {"model": chat["model"], "max_tokens": chat["max_tokens"], "messages": chat["messages"], "stream": True}
    if "tools" in chat:
        body["tools"] = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                          "input_schema": t["function"]["parameters"]} for t in chat["tools"]]
        choice = chat.get("tool_choice", "auto")
        body["tool_choice"] = ({"type": "tool", "name": choice["function"]["name"]} if isinstance(choice, dict)
                               else {"type": {"auto": "auto", "none": "none", "required": "any"}[choice]})
    if "stop" in chat:
        body["stop_sequences"] = chat["stop"]
    return body


def clean(data: bytes) -> bytes:
    return SIGNATURE.sub(b'"signature":"sig"', TOOL_USE_ID.sub(b'"id":"call-id"', data))


@pytest.mark.parametrize("name", [n for n in NAMES if n != "qwen2-vl"])
def test_lean_messages_path_sends_vllms_bytes(name):
    """Messages on the lean path (``LeanMessagesStream``: the lean chat path's middle events, most
    written from a template of vLLM's Anthropic converter, the rest through the converter) against
    vLLM's chain (its chat generator and converter for every event, every event through
    ``process_outputs``), over the same drawn streams as above: identical bytes, and the lean
    stream did most middle events itself, most without the converter."""
    from derender.endpoints.messages import LeanMessagesStream, MessagesStream, render_messages
    from derender.translate import lean

    model, _ = served(name)
    done = []

    def rendered(body: dict):
        return asyncio.run(render_messages(model, json.dumps(body).encode(), "lean-diff"))

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    # Every drawn example counts (thinking off, a chat-only knob, is not drawn rather than passed over).
    @given(streams(name, thinking_off=False))
    def check(drawn):
        chat, payloads = drawn
        body = messages_body(chat)
        reference = MessagesStream(vllm_path(model), rendered(body))
        lean_rendered = rendered(body)
        assert lean.eligible(model, lean_rendered, continuous_usage=True)
        lean_stream = LeanMessagesStream(model, lean_rendered)
        assert reference.outputs.direct_state is None
        vllm_bytes, lean_bytes = run_vllm(reference, payloads), run(lean_stream, payloads)
        assert clean(lean_bytes) == clean(vllm_bytes), body
        middle = max(0, sum(1 for p in payloads if b'"choices":[{' in p) - 2)  # neither the first nor the last
        if "stop" not in chat:  # a stop string ends a stream early and sends all events through process_outputs
            done.append((lean_stream.handled, lean_stream.direct, lean_stream.templated, middle, lean_stream.converted))

    check()
    handled, direct, templated, middle, converted = (sum(d[i] for d in done) for i in range(5))
    assert middle > 0 and handled >= middle // 3, (handled, middle)
    after_first = sum(max(0, d[3] - 1) for d in done)
    assert after_first > 0 and direct >= after_first // 3, (direct, after_first)
    # Some middle deltas took the template; how many depends on the draws (tool-call arguments and
    # block changes go to the converter: 16-71 % of them templated over the seeds tried).
    assert templated > 0, (templated, converted)

    # Where the template must carry nearly everything: reasoning, then text, one token per event. The
    # converter takes only the delta that opens each block (thinking, text); every other delta that
    # says anything is a template's (gpt-oss's channel markers say nothing).
    _, answers = served(name)
    ids = answers.answer("Paris is in France, and the sky there is grey today.",
                         "It is rainy in Paris today, about 12 degrees.", [], end=True, think=True)
    body = messages_body({"model": name, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                          "max_tokens": 2000})
    payloads = events(ids, [1], False, "stop")
    reference, lean_stream = MessagesStream(vllm_path(model), rendered(body)), LeanMessagesStream(model, rendered(body))
    vllm_bytes, lean_bytes = run_vllm(reference, payloads), run(lean_stream, payloads)
    assert clean(lean_bytes) == clean(vllm_bytes)
    assert lean_stream.handled == len(ids) - 2  # every event but the first and the last
    assert lean_stream.converted <= 2 and lean_stream.templated >= lean_stream.handled // 2, (
        lean_stream.templated, lean_stream.converted, lean_stream.handled)


@pytest.mark.parametrize("name", ["qwen3", "gpt-oss"])  # the configurations with a tool parser (qwen2-vl: qwen3's)
@pytest.mark.parametrize("calls", [1, 2])
def test_lean_messages_tool_arguments_take_the_template(name, calls):
    """A tool call's arguments, one token per event, in one or two calls, with and without text
    before them: identical bytes to vLLM's chain, and the converter takes only the deltas that open
    a block or change the call; the argument deltas between are a template's, the converter getting
    them as one delta before anything else. Whether they made complete JSON decides the
    ``stop_reason`` when a stop string ends the stream (``tool_use`` if so, else ``stop_sequence``):
    a stop string "}" ends gpt-oss's arguments complete; a length cut ends them short."""
    from derender.endpoints.messages import LeanMessagesStream, MessagesStream, render_messages

    model, answers = served(name)

    def rendered(body: dict):
        return asyncio.run(render_messages(model, json.dumps(body).encode(), "lean-diff"))

    args = [{"city": "Paris, France", "unit": "celsius", "note": "東京 🤖 \\ \"x\""}, {"tz": "Europe/Paris"}]
    chosen = [("get_weather", args[0]), ("get_time", args[1])][:calls]
    for content in ("", "Let me look that up."):
        ids = answers.answer("The user asks for the weather.", content, chosen, end=True, think=True)
        for cut, stop in ((None, None), (len(ids) - 6, None), (None, "}")):
            chat = {"model": name, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                    "max_tokens": 2000, "tools": TOOLS, **({"stop": [stop]} if stop else {})}
            body = messages_body(chat)
            payloads = events(ids if cut is None else ids[:cut], [1], False, "stop" if cut is None else "length")
            reference = MessagesStream(vllm_path(model), rendered(body))
            lean_stream = LeanMessagesStream(model, rendered(body))
            vllm_bytes, lean_bytes = run_vllm(reference, payloads), run(lean_stream, payloads)
            assert clean(lean_bytes) == clean(vllm_bytes), (content, cut, stop)
            assert b"input_json_delta" in lean_bytes
            if cut is not None:
                assert b'"stop_reason":"max_tokens"' in lean_bytes
            elif stop is None or name == "gpt-oss":  # the case that reads the held arguments at the end
                assert b'"stop_reason":"tool_use"' in lean_bytes, lean_bytes[-300:]
            # each block's first delta, and each call's first argument delta, go to the converter
            assert lean_stream.converted <= 3 + 2 * calls, (lean_stream.converted, lean_stream.templated)
            assert lean_stream.templated >= lean_stream.handled // 3, (lean_stream.templated, lean_stream.handled)


def _shape(info) -> tuple:
    if info is None:
        return (None,)
    shape = info.lexer_shape
    terminals = [(t.name, t.pattern.pattern, t.is_literal, t.literal) for t in shape.terminals]
    return (info.extra_token_ids, terminals, shape.literal_strings, shape.max_literal_len, shape.literal_first_chars,
            shape.has_only_literals, shape.prefix_set, shape.literals_by_first)


@pytest.mark.parametrize("name", NAMES)
def test_shared_parser_tables_equal_fresh_ones(name, monkeypatch):
    """The lean path builds vLLM's parser drop tables once per (engine config, tokenizer) and shares
    them: for every parser a request of this configuration makes, the shared table equals the one
    vLLM builds anew (``test_stream_path_vllm_leaves_vllm_unpatched``: a process on vLLM's path keeps
    vLLM's builder, which makes a fresh one every time)."""
    from vllm.parser.engine import streaming_parser_engine as engine


    model, answers = served(name)
    memo = engine._build_drop_info
    assert getattr(memo, "derender_memo", False)
    memo.tables.clear()
    for body in ({"model": name, "messages": [{"role": "user", "content": "hi"}], "stream": True},
                 {"model": name, "messages": [{"role": "user", "content": "hi"}], "stream": True, "tools": TOOLS},
                 {"model": name, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                  "chat_template_kwargs": {"enable_thinking": False}}):
        if "tools" in body and not answers.tools or model.serving_chat.parser_cls is None:
            continue
        rendered = render(model, body)
        model.serving_chat._make_parser(rendered.request, model.tokenizer, rendered.chat_template_kwargs)
    tables = list(memo.tables.values())
    assert bool(tables) == (name in ENGINE_PARSERS), "a parser engine was built or not, unlike vLLM 0.33's parsers"
    for config, tokenizer, shared in tables:
        assert memo(config, tokenizer) is shared
        assert _shape(shared) == _shape(memo.built(config, tokenizer))
        fresh = memo.built(config, tokenizer)  # vLLM's own builder, as a --stream-path vllm process keeps it
        assert fresh is not shared or shared is None


def test_a_parser_failing_mid_stream_ends_both_paths_alike(monkeypatch):
    """vLLM's generator answers a parser's exception with its error chunk; the lean path hands the
    exception to the generator, so the client gets the same."""
    model, answers = served("qwen3")
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True, "tools": TOOLS}
    ids = answers.answer("thinking it over", "Sunny.", [("get_weather", PARIS)])
    payloads = events(ids, [1], False, "stop")
    parser_cls = type(model.serving_chat._make_parser(render(model, body).request, model.tokenizer, None))
    real = parser_cls.parse_delta
    calls = {"n": 0}

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 1000 == 7:  # the seventh call of each stream
            raise RuntimeError("parser broke")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(parser_cls, "parse_delta", failing)
    from derender.translate import lean
    from derender.translate.stream import ChatStream

    reference, rendered = render(model, body), render(model, body)
    vllm_bytes = run(ChatStream(vllm_path(model), reference), payloads)
    calls["n"] = 1000
    stream = lean.LeanChatStream(model, rendered)
    lean_bytes = run(stream, payloads)
    assert b"parser broke" in vllm_bytes and vllm_bytes.endswith(b"data: [DONE]\n\n")
    assert normal(lean_bytes) == normal(vllm_bytes)
    assert stream.handled >= 5 and stream.direct >= 4


@pytest.mark.parametrize("extra", [{"n": 2}, {"logprobs": True}, {"echo": True}, {"return_token_ids": True},
                                   {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}])
def test_what_the_lean_path_leaves_to_vllm(extra):
    from derender.endpoints.chat import ChatExchange
    from derender.translate import lean

    model, _ = served("qwen3")
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}
    exchange = ChatExchange(model, None, None)
    exchange.rendered = render(model, body)
    assert not lean.eligible(model, exchange.rendered)
    assert type(exchange.new_stream()).__name__ == "ChatStream"
    plain = {k: v for k, v in body.items() if k not in extra}
    exchange.rendered = render(model, plain)
    assert type(exchange.new_stream()) is lean.LeanChatStream


def test_stream_path_vllm_turns_it_off(monkeypatch):
    from derender.endpoints.chat import ChatExchange
    from derender.translate import lean

    model, _ = served("qwen3")
    exchange = ChatExchange(model, None, None)
    exchange.rendered = render(model, {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert type(exchange.new_stream()) is lean.LeanChatStream
    exchange = ChatExchange(vllm_path(model), None, None)
    exchange.rendered = render(model, {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert type(exchange.new_stream()).__name__ == "ChatStream"


def test_stream_path_vllm_leaves_vllm_unpatched(qwen3_dir):
    """A process serving only ``--stream-path vllm`` runs vLLM's parser engine and Responses server as
    they are: the shared drop tables, compiled regex calls and delta models' validators
    (``parser_tables``) and the Responses server's cached ``TypeAdapter`` are the lean path's,
    installed by a lean model only."""
    import subprocess
    import sys

    code = (
        "from derender.settings import Settings\n"
        "from derender.translate.model import Model, ModelSpec\n"
        "from derender.endpoints.responses.endpoint import serving_responses\n"
        "from vllm.parser.engine import streaming_parser_engine as engine\n"
        "from vllm.entrypoints.openai.responses import serving as responses\n"
        "import pydantic, regex, sys\n"
        "from vllm.tool_parsers import hermes_tool_parser as hermes\n"
        "from vllm.entrypoints.generate.base.protocol import DeltaMessage\n"
        "vllms_validator = DeltaMessage.__pydantic_validator__\n"
        "def patched():\n"
        "    return (getattr(engine._build_drop_info, 'derender_memo', False), hermes.re is not regex,\n"
        "            responses.TypeAdapter is not pydantic.TypeAdapter,\n"
        "            DeltaMessage.__pydantic_validator__ is not vllms_validator)\n"
        "model = Model(ModelSpec(model=sys.argv[1], settings=Settings(stream_path='vllm')))\n"
        "serving_responses(model)\n"
        "print('vllm', *patched())\n"
        "serving_responses(model.with_settings(Settings()))\n"
        "print('lean', *patched())\n"
    )
    out = subprocess.run([sys.executable, "-c", code, qwen3_dir], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-3:-1] == ["vllm False False False False", "lean True True True True"], out.stdout


def test_both_paths_through_envoy_send_the_same_bytes(qwen3_dir, script):
    """The real thing: one filter on each path (``--stream-path lean`` and ``vllm``) behind its own
    Envoy, the same scripted answer (reasoning, content, a tool call, cut into uneven events)."""
    from stack import Stack

    model, answers = served("qwen3")
    ids = answers.answer("Paris, then Tokyo 🤔", "Checking 東京.", [("get_weather", PARIS)])
    script.set({"index": 0, "token_ids": ids, "chunks": [1, 2, 1, 3, 1]})
    flags = ["--served-model-name", "qwen3", "--max-model-len", "4096", *MODELS["qwen3"]]
    sim = ["--mode", "script", "--script", str(script.path)]
    body = {"model": "qwen3", "messages": [{"role": "user", "content": "weather?"}], "stream": True, "tools": TOOLS,
            "stream_options": {"include_usage": True}}
    got = {}
    for path in ("lean", "vllm"):
        stack = Stack(qwen3_dir, [*flags, "--stream-path", path], sim).start()
        try:
            import httpx

            with httpx.stream("POST", stack.base_url + "/chat/completions", json=body, timeout=60,
                              headers={"x-request-id": "e2e-lean"}) as r:
                assert r.status_code == 200
                got[path] = normal(r.read())
        finally:
            stack.stop()
    assert got["lean"] == got["vllm"]
    assert got["lean"].count(b"data: ") > 20 and b'"tool_calls"' in got["lean"] and b"[DONE]" in got["lean"]


RESPONSE_IDS = re.compile(rb'"((?:item_|call_)?id)":"(resp|msg|rs|fc|ctc|call|chatcmpl-tool)[_-][0-9a-zA-Z-]{8,}"')
CREATED_AT = re.compile(rb'"created_at":\d+(\.\d+)?')


def responses_body(chat: dict, draw_include: bool) -> dict:
    """The Responses request asking what ``chat`` asks (stop strings are not a Responses field)."""
    body = {"model": chat["model"], "input": chat["messages"], "max_output_tokens": chat["max_tokens"], "stream": True}
    if "tools" in chat:
        body["tools"] = [{"type": "function", **t["function"]} for t in chat["tools"]]
        choice = chat.get("tool_choice", "auto")
        body["tool_choice"] = {"type": "function", "name": choice["function"]["name"]} if isinstance(choice, dict) else choice
        body["parallel_tool_calls"] = chat.get("parallel_tool_calls", True)
    if chat.get("include_reasoning") is False:
        body["include_reasoning"] = False
    if draw_include:
        body["include"] = ["message.output_text.logprobs"]
        body["top_logprobs"] = 2
    return body


def with_logprobs(payload: bytes) -> bytes:
    if payload == b"[DONE]":
        return payload
    event = json.loads(payload)
    for choice in event["choices"]:
        choice["logprobs"] = {"content": [
            {"token_id": t, "logprob": -0.25 * (i % 3), "rank": 1,
             "top_logprobs": [{"token_id": t, "logprob": -0.25 * (i % 3), "rank": 1},
                              {"token_id": t + 1, "logprob": -2.5, "rank": 2}, {"token_id": 13, "logprob": -3.0, "rank": 3}]}
            for i, t in enumerate(choice["token_ids"])]}
    return pydantic_core.to_json(event)


def run_responses(model, body: dict, payloads: list[bytes], lean_on: bool) -> tuple[bytes, int, int, int, int]:
    """What the client gets from a Responses stream fed these events as the exchange feeds them
    (each event's bytes, then the events vLLM's generator wrote for it); the outputs the lean path
    took, the delta events it wrote from a template, the outputs handed to it directly, with no
    ``RequestOutput`` made for them (``Session.direct``), and the template's events written with
    the body's item lines decided in place (``LoopBody._within``)."""
    from derender.endpoints.responses import ResponsesStream, render_responses

    async def go() -> tuple[bytes, int, int, int, int]:
        rendered = await render_responses(model, json.dumps(body).encode(), "lean-diff")
        stream = ResponsesStream(model, rendered)
        stream.start()
        out = []
        for p in payloads:
            out += [stream.feed(p)[0], await stream.flush()]
        if not stream.finished:
            out += [stream.end(), await stream.flush()]
        loop = rendered.session._loop
        session = rendered.session
        return b"".join(out), session.lean_events, loop.templated if loop else 0, session.direct_events, loop.within if loop else 0

    if lean_on:
        return asyncio.run(go())
    from derender.translate import parser_tables

    model = vllm_path(model)
    with parser_tables.unpatched():
        return asyncio.run(go())


@pytest.mark.parametrize("name", [n for n in NAMES if n != "gpt-oss"])
def test_lean_responses_path_sends_vllms_bytes(name):
    """Responses on the lean path (``responses.lean.LoopBody``: vLLM's loop body per middle output,
    not its generator chain) against vLLM's generators for every output, over the drawn streams
    (gpt-oss's Harmony path is another generator, not taken): identical bytes, logprobs asked or
    not, and the lean path took most middle outputs itself, writing most of their delta events from
    a template of vLLM's."""
    model, _ = served(name)
    done = []

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    # Every drawn example counts: a draw that fell on a chat-only knob (and was passed over) left as
    # few as 23 of 100 examples to run, too few for the sums below to hold for every seed.
    @given(streams(name, thinking_off=False, stop=False), st.booleans())
    def check(drawn, logprobs):
        chat, payloads = drawn
        body = responses_body(chat, logprobs)
        if logprobs:  # the producer's logprob rows: the sampled token and two candidates
            payloads = [with_logprobs(p) for p in payloads]
        vllm_bytes, untaken, _, undirect, _ = run_responses(model, body, payloads, lean_on=False)
        lean_bytes, taken, templated, direct, within = run_responses(model, body, payloads, lean_on=True)
        clean = lambda data: CREATED_AT.sub(b'"created_at":0', RESPONSE_IDS.sub(rb'"\1":"\2-id"', data))
        assert untaken == undirect == 0 and re.search(rb"event: (response\.completed|response\.incomplete|error)\n", vllm_bytes), body
        assert clean(lean_bytes) == clean(vllm_bytes), body
        # Without logprobs every middle output but the first (the generator's own, before its first
        # wait) goes into the loop body directly, with no RequestOutput made for it.
        assert logprobs or direct == max(0, taken - 1), (direct, taken)
        done.append((taken, max(0, sum(1 for p in payloads if b'"choices":[{' in p) - 1), templated, within))

    check()
    taken, middle, templated, within = (sum(d[i] for d in done) for i in range(4))
    assert middle > 0 and taken >= middle // 2, (taken, middle)
    assert templated > 0 and within > 0, (templated, within, taken)
    # A plain answer (reasoning, text, a call; one token per event): most middle outputs are a delta
    # inside an open item, written from the template (the rest: markup tokens, item changes).
    _, answers = served(name)
    chat = {"model": name, "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 2000}
    calls = [("get_weather", PARIS)] if answers.tools else []
    if calls:
        chat["tools"] = TOOLS
    ids = answers.answer("Let me think about the weather in Paris, a city in France.",
                         "I will look it up for you right now, one moment.", calls, end=True, think=True)
    _, taken, templated, direct, within = run_responses(model, responses_body(chat, False), events(ids, [1], False, "stop"), lean_on=True)
    assert within >= taken // 2 and within <= templated, (within, templated, taken)
    assert direct == taken - 1, (direct, taken)  # all but the first (the generator's, before its first wait)
