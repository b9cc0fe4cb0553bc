"""The parity cases: one request body and one scripted generation, for each model family.

Answers are built from realistic text with the REAL tokenizers (Qwen3 ``<think>`` and
hermes ``<tool_call>``; DeepSeek-R1 ``<think>``; gpt-oss Harmony messages rendered by
openai-harmony). A case says what the "GPU" generates (token ids per choice) and how the
engine steps cut it (``chunks``, an optional finish-only tail event). The same script
drives the simulator (the filter's producer) and ``reference.ScriptedEngine`` (vLLM's
coupled server), so both paths see the same engine steps.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import cycle

from reference import Step

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]

REASONING = "The user asks about Paris. 法国的首都是巴黎 — I should check the weather 🤔.\nThen answer briefly."
CONTENT = "It is 18°C and sunny in Paris 🇫🇷. 巴黎天气晴朗！"
CJK_REASONING = "東京の天気を確認します 🌧️☔ — 用户想知道东京的天气。Ünïcödé ✓ 🧑‍🚀"
CJK_ARGS = {"city": "東京 🗼", "note": "雨☔ — naïve café ✓"}
PARIS = {"city": "Paris", "unit": "celsius"}
TOKYO = {"tz": "Asia/Tokyo"}


# -- answers: text -> token ids, per model family -----------------------------------------
class Answers:
    """Token ids of a model's answer: reasoning, then content, then tool calls."""

    eos: int
    tools = True  # the model config has a tool parser

    def __init__(self, model_dir: str) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def answer(self, reasoning: str | None = None, content: str = "", calls=(), end: bool = True,
               think: bool = True) -> list[int]:
        """``reasoning=None``: no reasoning (an empty think block where the model always opens one);
        ``think=False``: no think block at all (the template closed it)."""
        raise NotImplementedError


class Qwen3Answers(Answers):
    """Qwen3 in thinking mode always opens ``<think>`` (empty when it does not think)."""

    eos = 151645  # <|im_end|>

    def answer(self, reasoning=None, content="", calls=(), end=True, think=True):
        text = f"<think>\n{reasoning or ''}\n</think>\n\n" if think else ""
        text += content
        for i, (name, args) in enumerate(calls):
            call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            text += ("\n" if content or i else "") + f"<tool_call>\n{call}\n</tool_call>"
        return self.encode(text) + ([self.eos] if end else [])


class DeepSeekR1Answers(Answers):
    """R1 always opens ``<think>`` itself (this template's generation prompt does not)."""

    eos = 1  # <｜end▁of▁sentence｜>
    tools = False

    def answer(self, reasoning=None, content="", calls=(), end=True, think=True):
        assert not calls and think
        text = f"<think>\n{reasoning or ''}\n</think>\n\n{content}"
        return self.encode(text) + ([self.eos] if end else [])


class HarmonyAnswers(Answers):
    """gpt-oss: Harmony messages as openai-harmony renders them; the prompt ends in ``<|start|>assistant``."""

    eos = 200002  # <|return|>
    CALL = 200012  # <|call|>

    def __init__(self, model_dir: str) -> None:
        super().__init__(model_dir)
        os.environ.setdefault("TIKTOKEN_ENCODINGS_BASE", model_dir)
        from openai_harmony import (
            HarmonyEncodingName,
            Message,
            Role,
            load_harmony_encoding,
        )

        self.encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        self.message = lambda text: Message.from_role_and_content(Role.ASSISTANT, text)

    def answer(self, reasoning=None, content="", calls=(), end=True, think=True):
        messages = []
        if reasoning is not None:
            messages.append(self.message(reasoning).with_channel("analysis"))
        if content:
            messages.append(self.message(content).with_channel("final"))
        for name, args in calls:
            call = self.message(json.dumps(args, ensure_ascii=False)).with_channel("commentary")
            messages.append(call.with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))
        ids: list[int] = []
        for m in messages:
            ids += self.encoding.render(m)
        assert ids[:2] == self.encode("<|start|>assistant")
        ids = ids[2:]  # the generation prompt already opened the first message
        if ids[-1] == 200007 and not calls:  # <|end|> of the final message is <|return|>
            ids[-1] = self.eos
        if not end:
            ids = ids[:-1]
        return ids


class ParserFreeQwen3Answers(Qwen3Answers):
    """Qwen3 served with no parser (vLLM's default): ``<think>`` and tool markup are content."""

    tools = False
    parsers = False


class VisionQwen3Answers(Qwen3Answers):
    """A Qwen2-VL with the Qwen3 tokenizer and parsers: every case's first user message carries an image."""

    image = True


ANSWERS: dict[str, type[Answers]] = {"qwen3": Qwen3Answers, "deepseek-r1": DeepSeekR1Answers, "gpt-oss": HarmonyAnswers,
                                     "qwen3-no-parser": ParserFreeQwen3Answers, "qwen2-vl": VisionQwen3Answers}
# The cases a vision config runs (each also through Messages and Responses): plain, reasoning, tools.
VISION = {"plain chunks=1", "reasoning chunks=3-4", "tool chunks=1", "reasoning+tool chunks=tail"}


def _png() -> bytes:
    import io

    from PIL import Image

    image = Image.new("RGB", (120, 80), (30, 140, 220))
    image.putpixel((3, 3), (255, 255, 255))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def with_image(messages: list[dict], api: str) -> list[dict]:
    """``messages`` with a picture after the first user message's text, in ``api``'s own shape
    (``chat``, ``messages`` (Anthropic), ``responses``)."""
    import base64

    data = base64.b64encode(_png()).decode()
    url = "data:image/png;base64," + data
    image = {"chat": {"type": "image_url", "image_url": {"url": url}},
             "messages": {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
             "responses": {"type": "input_image", "image_url": url, "detail": "auto"}}[api]
    text = "input_text" if api == "responses" else "text"
    out, done = [], False
    for message in messages:
        if not done and message["role"] == "user" and isinstance(message["content"], str):
            message = {**message, "content": [{"type": text, "text": message["content"]}, image]}
            done = True
        out.append(message)
    assert done, "no user message to put the image in"
    return out
# The cases a parser-free config runs: no reasoning or tool expectations of their own.
PARSER_FREE = {"plain chunks=1", "plain chunks=3-4", "plain chunks=rand", "plain chunks=tail",
               "reasoning chunks=1", "reasoning chunks=3-4", "logprobs top_logprobs=2", "stop string across events",
               "stop_token_ids", "continuous_usage_stats", "n=2 interleaved"}


# -- cases ---------------------------------------------------------------------------------
@dataclass
class Choice:
    """What one choice generates: the simulator script line and the reference steps."""

    token_ids: list[int]
    chunks: list[int]
    finish_reason: str = "stop"
    stop_reason: int | str | None = None
    logprobs: list[dict] | None = None  # per token: {"logprob", "rank", "top": [[id, lp], ...]}

    def __post_init__(self) -> None:
        assert sum(self.chunks) == len(self.token_ids) and all(c > 0 for c in self.chunks), self.chunks


@dataclass
class Case:
    name: str
    body: dict  # the OpenAI request minus "model" and "stream"
    choices: list[Choice]
    tail: bool = False  # finish_reason in a separate event with no tokens
    delay: float = 0.0  # seconds between simulator events
    expect: dict = field(default_factory=dict)  # what the reference must show (the case is what it says)
    sdk: bool = False  # also through the openai SDK
    full: bool = False  # also non-streaming

    def script(self) -> list[dict]:
        """Simulator script lines (one per choice)."""
        return [
            {"index": i, "token_ids": c.token_ids, "chunks": c.chunks, "finish_reason": c.finish_reason,
             "stop_reason": c.stop_reason, **({"logprobs": c.logprobs} if c.logprobs else {})}
            for i, c in enumerate(self.choices)
        ]

    def steps(self) -> list[Step]:
        """The engine steps, in the order the simulator sends them (round robin over choices)."""
        per_choice = []
        for i, c in enumerate(self.choices):
            steps, start = [], 0
            for size in c.chunks:
                lps = None
                if c.logprobs is not None:
                    lps = [(e["logprob"], e["rank"], [tuple(t) for t in e["top"]]) for e in c.logprobs[start:start + size]]
                steps.append(Step(i, c.token_ids[start:start + size], logprobs=lps))
                start += size
            if self.tail:
                steps.append(Step(i, []))
            steps[-1].finish_reason, steps[-1].stop_reason = c.finish_reason, c.stop_reason
            per_choice.append(steps)
        return [s[t] for t in range(max(map(len, per_choice))) for s in per_choice if t < len(s)]


def _fit(sizes, n: int) -> list[int]:
    """Event sizes from an endless iterator, cut to ``n`` tokens."""
    out: list[int] = []
    for size in sizes:
        if sum(out) >= n:
            return out
        out.append(min(size, n - sum(out)))
    return out


def _seeded(seed: int):
    rng = random.Random(seed)
    while True:
        yield rng.randint(1, 5)


# How engine steps cut an answer: one token per event, speculative-decoding-like 3-4,
# irregular seeded sizes, and one token per event plus a finish-only tail event.
CHUNKINGS = {
    "1": lambda n, seed: [1] * n,
    "3-4": lambda n, seed: _fit(cycle([3, 4]), n),
    "rand": lambda n, seed: _fit(_seeded(seed), n),
    "tail": lambda n, seed: [1] * n,
}


def chunked(ids: list[int], how: str, seed: int = 7, **kw) -> Choice:
    return Choice(ids, CHUNKINGS[how](len(ids), seed), **kw)


def logprob_rows(ids: list[int], k: int) -> list[dict]:
    """Scripted per-token logprobs: the sampled token at rank 1, 2 or outside the top k.

    Top alternatives are the neighbouring answer tokens, so byte-fallback pieces of
    CJK and emoji show up as top tokens too.
    """
    rows = []
    for p, tok in enumerate(ids):
        others = [t for t in (ids[(p + 1) % len(ids)], ids[p - 1], ids[(p + 3) % len(ids)], 13) if t != tok]
        others = list(dict.fromkeys(others))[: k + 1]
        rank = (1, 2, 1, k + 1)[p % 4]
        lp = -round(0.03 + 0.4 * (rank - 1) + 0.01 * (p % 7), 4)
        top = [[t, -round(0.05 + 0.4 * r + 0.01 * (p % 5), 4)] for r, t in enumerate(others)]
        if rank <= k:
            top.insert(rank - 1, [tok, lp])
        top = top[:k]
        rows.append({"logprob": lp, "rank": rank, "top": top})
    return rows


CaseFn = Callable[[Answers], Case]
CASES: dict[str, CaseFn] = {}
APPLIES: dict[str, Callable[[type[Answers]], bool]] = {}
# Where vLLM 0.33.0 itself streams something wrong, the filter matches it on purpose.
# The test checks each listed bug really shows in vLLM's stream (and no unlisted one does).
LEAK = "vllm#55195"  # <think> leaks into reasoning when it shares a multi-token delta
STOP_DESYNC = "vllm#51641"  # stop-string hold-back desyncs delta text from token ids: reasoning misrouted
STOP_KEPT = "vllm#52599"  # Harmony parses token ids: the matched stop string (or stop token) stays in the text
UPSTREAM: dict[str, dict[str, tuple[str, ...]]] = {}


def case(name: str, when: Callable[[type[Answers]], bool] = lambda cls: True,
         upstream: dict[str, tuple[str, ...]] | None = None):
    """Register a case; ``when`` says which model families have the feature it tests,
    ``upstream`` which vLLM bugs show in it, per model."""

    def register(fn: CaseFn) -> CaseFn:
        CASES[name], APPLIES[name], UPSTREAM[name] = fn, when, upstream or {}
        return fn

    return register


def upstream(name: str, model: str) -> tuple[str, ...]:
    return UPSTREAM[name].get(model, ())


def with_tools(cls: type[Answers]) -> bool:
    return cls.tools


def cases_for(model: str) -> list[str]:
    cls = ANSWERS[model]
    return [name for name in CASES if APPLIES[name](cls) and (getattr(cls, "parsers", True) or name in PARSER_FREE)
            and (not getattr(cls, "image", False) or name in VISION)]


def base_answer(a: Answers, kind: str, end: bool = True) -> list[int]:
    if kind == "plain":
        return a.answer(content=CONTENT, end=end)
    if kind == "reasoning":
        return a.answer(REASONING, "Sunny, 18°C. 晴れ ☀️", end=end)
    if kind == "tool":
        return a.answer(calls=[("get_weather", PARIS)], end=end)
    if kind == "reasoning+tool":
        return a.answer(REASONING, calls=[("get_weather", PARIS)], end=end)
    raise ValueError(kind)


def _base_case(kind: str, how: str) -> CaseFn:
    def build(a: Answers) -> Case:
        tail = how == "tail"
        ids = base_answer(a, kind, end=not tail)  # a finish-only tail reports the stop separately
        tools = {"tools": TOOLS} if "tool" in kind else {}
        expect = {"tools": ["get_weather"] if "tool" in kind else [], **({"reasoning": True} if "reasoning" in kind else {}),
                  "text": {"plain": [CONTENT], "reasoning": ["法国的首都是巴黎", "晴れ ☀️"]}.get(kind, ["Paris"])}
        return Case(f"{kind} chunks={how}", {"messages": QUESTION, **tools}, [chunked(ids, how)], tail=tail,
                    expect=expect, sdk=(how == "1" and kind == "reasoning+tool"), full=(how == "3-4"))

    return build


R1_LEAK = {"deepseek-r1": (LEAK,)}  # R1 opens <think> itself; a first event of several tokens leaks it

for _kind in ("plain", "reasoning", "tool", "reasoning+tool"):
    for _how in CHUNKINGS:
        case(f"{_kind} chunks={_how}", with_tools if "tool" in _kind else lambda cls: True,
             R1_LEAK if _kind == "reasoning" and _how in ("3-4", "rand") else None)(_base_case(_kind, _how))


@case("n=2 interleaved", upstream=R1_LEAK)
def _n2(a: Answers) -> Case:
    first = a.answer(REASONING, calls=[("get_weather", PARIS)]) if a.tools else a.answer(REASONING, CONTENT)
    second = base_answer(a, "plain")
    return Case("n=2", {"messages": QUESTION, "n": 2, **({"tools": TOOLS} if a.tools else {}),
                        "stream_options": {"include_usage": True}},
                [chunked(first, "3-4"), chunked(second, "rand", seed=3)], expect={"reasoning": True}, sdk=True, full=True)


@case("logprobs top_logprobs=2", upstream=R1_LEAK)
def _logprobs(a: Answers) -> Case:
    ids = a.answer(CJK_REASONING, "Robot: 🤖 done. 你好，世界！")
    return Case("logprobs", {"messages": QUESTION, "logprobs": True, "top_logprobs": 2},
                [Choice(ids, CHUNKINGS["rand"](len(ids), 11), logprobs=logprob_rows(ids, 2))],
                expect={"reasoning": True, "logprobs": True, "text": ["Robot: 🤖 done", "🧑‍🚀"]}, sdk=True, full=True)


@case("CJK+emoji in reasoning and tool args", upstream=R1_LEAK)
def _cjk(a: Answers) -> Case:
    if a.tools:
        ids = a.answer(CJK_REASONING, calls=[("get_weather", CJK_ARGS)])
        body = {"messages": QUESTION, "tools": TOOLS}
    else:
        ids = a.answer(CJK_REASONING, "答え：東京は雨です ☔🌧️")
        body = {"messages": QUESTION}
    expect = {"reasoning": True, "tools": ["get_weather"] if a.tools else [], "text": ["東京の天気を確認します 🌧️☔", "🗼" if a.tools else "☔🌧️"]}
    return Case("cjk", body, [chunked(ids, "rand", seed=5)], expect=expect)


@case("two tool calls", with_tools)
def _two_tools(a: Answers) -> Case:
    ids = a.answer(REASONING, calls=[("get_weather", PARIS), ("get_time", TOKYO)])
    return Case("two", {"messages": QUESTION, "tools": TOOLS}, [chunked(ids, "3-4")],
                expect={"tools": ["get_weather", "get_time"]}, full=True)


@case("length cuts a tool call", with_tools)
def _length(a: Answers) -> Case:
    ids = a.answer(calls=[("get_weather", CJK_ARGS)])
    cut = len(ids) - 6  # inside the arguments
    return Case("length", {"messages": QUESTION, "tools": TOOLS, "max_tokens": cut},
                [Choice(ids[:cut], CHUNKINGS["3-4"](cut, 0), finish_reason="length")], expect={"tools": ["get_weather"]}, full=True)


@case("enable_thinking false", lambda cls: cls is Qwen3Answers)  # only Qwen3's template and parser take it
def _no_thinking(a: Answers) -> Case:
    ids = a.answer(content=CONTENT + " No thinking today.", think=False)
    return Case("no-think", {"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}},
                [chunked(ids, "3-4")], expect={"reasoning": False}, full=True)


@case("multi-turn after a tool result", with_tools)
def _multi_turn(a: Answers) -> Case:
    history = [{"role": "system", "content": "You are a terse weather bot. Answer in one line."}, *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(PARIS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temp_c": 18, "sky": "sunny ☀️"})},
    ]
    ids = a.answer(REASONING, calls=[("get_time", TOKYO)])
    return Case("multi-turn", {"messages": history, "tools": TOOLS}, [chunked(ids, "rand", seed=9)],
                expect={"reasoning": True, "tools": ["get_time"]})


@case("tool_choice required", with_tools)
def _required(a: Answers) -> Case:
    ids = a.answer(calls=[("get_weather", PARIS)])
    return Case("required", {"messages": QUESTION, "tools": TOOLS, "tool_choice": "required"}, [chunked(ids, "3-4")],
                expect={"tools": ["get_weather"]}, full=True)


@case("tool_choice named", with_tools)
def _named(a: Answers) -> Case:
    ids = a.answer(calls=[("get_weather", PARIS)])
    choice = {"type": "function", "function": {"name": "get_weather"}}
    return Case("named", {"messages": QUESTION, "tools": TOOLS, "tool_choice": choice}, [chunked(ids, "1")],
                expect={"tools": ["get_weather"]}, full=True)


@case("tool_choice none", with_tools)
def _none(a: Answers) -> Case:
    ids = a.answer(content=CONTENT, calls=[("get_weather", PARIS)])  # the model calls anyway: stays text
    return Case("none", {"messages": QUESTION, "tools": TOOLS, "tool_choice": "none"}, [chunked(ids, "3-4")],
                expect={"tools": []}, full=True)


@case("parallel_tool_calls false", with_tools)
def _single(a: Answers) -> Case:
    ids = a.answer(calls=[("get_weather", PARIS), ("get_time", TOKYO)])
    return Case("single", {"messages": QUESTION, "tools": TOOLS, "parallel_tool_calls": False}, [chunked(ids, "1")],
                expect={"tools": ["get_weather"]}, full=True)


@case("include_reasoning false")
def _hide(a: Answers) -> Case:
    ids = a.answer(REASONING, CONTENT)
    return Case("hide", {"messages": QUESTION, "include_reasoning": False, "logprobs": True, "top_logprobs": 1,
                         "return_token_ids": True},
                [Choice(ids, CHUNKINGS["3-4"](len(ids), 0), logprobs=logprob_rows(ids, 1))], expect={"reasoning": False}, full=True)


STOP_TEXT = "Count: one two STOP three four. Then more text after the stop 🛑 that must not arrive."
# stop_reason, the text the stop drops (unless include_stop_str_in_output), text after it, text before it
STOP_EXPECT = {"stop": "STOP", "stop_text": "STOP", "absent": "three", "text": ["Count: one two"]}


def _stop_case(a: Answers, name: str, **params) -> Case:
    ids = a.answer(content=STOP_TEXT)
    return Case(name, {"messages": QUESTION, "stop": ["STOP", "<<>>"], **params},
                [chunked(ids, "3-4")], delay=0.01, expect=STOP_EXPECT, full=True)


@case("stop string across events", upstream={"deepseek-r1": (STOP_DESYNC,), "gpt-oss": (STOP_KEPT,)})
def _stop(a: Answers) -> Case:
    return _stop_case(a, "stop")


@case("n=2 stop string in one choice", upstream={"deepseek-r1": (STOP_DESYNC,), "gpt-oss": (STOP_KEPT,)})
def _stop_n2(a: Answers) -> Case:
    """The stop string ends choice 0 only; choice 1 runs to its end, as in vLLM (the engine aborts one child)."""
    stopped = _stop_case(a, "stop-n2").choices[0]
    other = a.answer(content=" ".join([CONTENT] * 3))
    body = {"messages": QUESTION, "n": 2, "stop": ["STOP"], "stream_options": {"include_usage": True}}
    return Case("stop-n2", body, [stopped, chunked(other, "1")], delay=0.02,
                expect=STOP_EXPECT, full=True)


@case("stop_token_ids", upstream={"gpt-oss": (STOP_KEPT,)})
def _stop_token(a: Answers) -> Case:
    """A stop token the request names: the producer ends there; its text is dropped, its id is the stop_reason."""
    ids = a.answer(content=CONTENT)
    cut = ids.index(a.encode(" sunny")[0])
    return Case("stop-token", {"messages": QUESTION, "stop_token_ids": [ids[cut]]},
                [Choice(ids[:cut + 1], CHUNKINGS["3-4"](cut + 1, 0), stop_reason=ids[cut])],
                expect={"stop": ids[cut], "stop_text": " sunny", "absent": " in Paris", "text": ["It is 18°C and"]},
                full=True)


@case("stop string include_stop_str_in_output")
def _stop_include(a: Answers) -> Case:
    return _stop_case(a, "stop-include", include_stop_str_in_output=True)


@case("stop string after min_tokens", upstream={"deepseek-r1": (STOP_DESYNC,), "gpt-oss": (STOP_KEPT,)})
def _stop_min(a: Answers) -> Case:
    ids = a.answer(content="Say STOP early, then " + STOP_TEXT)
    early = next(k for k in range(len(ids)) if "STOP" in a.tokenizer.decode(ids[:k], skip_special_tokens=False))
    return Case("stop-min", {"messages": QUESTION, "stop": ["STOP"], "min_tokens": early + 2},
                [chunked(ids, "rand", seed=2)], delay=0.01, expect=STOP_EXPECT)


@case("return_token_ids", upstream=R1_LEAK)
def _token_ids(a: Answers) -> Case:
    ids = a.answer(REASONING, CONTENT)
    return Case("token-ids", {"messages": QUESTION, "return_token_ids": True}, [chunked(ids, "3-4")],
                expect={"reasoning": True}, full=True)


@case("continuous_usage_stats", upstream=R1_LEAK)
def _usage(a: Answers) -> Case:
    ids = a.answer(REASONING, calls=[("get_weather", PARIS)]) if a.tools else a.answer(REASONING, CONTENT)
    return Case("usage", {"messages": QUESTION, **({"tools": TOOLS} if a.tools else {}),
                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                [chunked(ids, "rand", seed=4)], expect={"reasoning": True})


@case("continue_final_message with echo", lambda cls: cls is not HarmonyAnswers)  # Harmony renders no partial turn
def _continue(a: Answers) -> Case:
    """The client writes the start of the answer; the model continues it and echo sends it back first."""
    partial = "It is 18°C"  # plain text: templates drop think blocks of earlier turns
    messages = [*QUESTION, {"role": "assistant", "content": partial}]
    ids = a.encode(" and sunny in Paris 🇫🇷.") + [a.eos]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    return Case("continue", body, [chunked(ids, "3-4")], expect={"text": ["and sunny in Paris"]}, full=True)


@case("reasoning_effort high", lambda cls: cls is HarmonyAnswers)  # rendered into Harmony's system message
def _effort(a: Answers) -> Case:
    ids = a.answer(REASONING, CONTENT)
    return Case("effort", {"messages": QUESTION, "reasoning_effort": "high"}, [chunked(ids, "3-4")],
                expect={"reasoning": True, "text": [CONTENT]})
