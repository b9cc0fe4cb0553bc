"""What every configuration is driven with: the token streams, the chat requests, long prompts.

One answer shape everywhere, the one the issue measured vLLM's streaming derender on:
Qwen3 reasoning (``<think>...</think>``) then a hermes ``<tool_call>`` with JSON
arguments, then ``<|im_end|>``, exactly ``n`` tokens, one token per producer event.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

REASONING = (
    "The user wants the weather for a trip, so I should check the forecast before answering. "
    "Paris in spring can be mild or rainy; the dates matter, and so does the unit they prefer. "
    "Step {i}: compare the morning and evening temperatures, note the chance of rain, then decide "
    "whether one call covers every day or several calls are needed. "
)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
                "notes": {"type": "string"},
            },
            "required": ["city"],
        },
    },
}
ARGUMENTS = {"city": "Paris", "unit": "celsius", "days": 3, "notes": "morning and evening, chance of rain"}
FILLER = "Section {i}: the quarterly report lists revenue, costs, staffing and open risks for each region. "


@lru_cache
def _tokenizer(model_dir: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def _ids(model_dir: str, text: str) -> list[int]:
    return _tokenizer(model_dir).encode(text, add_special_tokens=False).ids


def reasoning_tool_call(model_dir: str, n: int) -> list[int]:
    """Exactly ``n`` token ids: reasoning, one tool call, end of turn."""
    head = _ids(model_dir, "<think>\n")
    tail = _ids(model_dir, "\n</think>\n\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": ARGUMENTS}) + "\n</tool_call>")
    eos = _tokenizer(model_dir).token_to_id("<|im_end|>")
    room = n - len(head) - len(tail) - 1
    if room < 1:
        raise ValueError(f"a reasoning + tool-call stream needs more than {n} tokens")
    body: list[int] = []
    i = 0
    while len(body) < room:
        body += _ids(model_dir, REASONING.format(i=i))
        i += 1
    return head + body[:room] + tail + [eos]


def script_line(token_ids: list[int]) -> str:
    """The simulator's script: one choice, one token per event, EOS ends it."""
    return json.dumps({"index": 0, "token_ids": token_ids, "finish_reason": "stop", "stop_reason": None}) + "\n"


def chat_request(model: str, tools: bool, prompt: str | None = None, max_tokens: int = 4096) -> dict:
    """The OpenAI request; ``tools`` adds the function (tool_choice auto) for the hermes parser."""
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": prompt or "What will the weather be like in Paris for the next three days?"},
        ],
        "stream": True,
        "max_tokens": max_tokens,
    }
    if tools:
        body["tools"] = [TOOL]
    return body


# Where each API is asked, by the name the bench scripts take (``--api``).
API_PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def api_body(api: str) -> bytes:
    """The bench's qwen3 chat request with tools, as the body of a request to ``api`` (``API_PATHS``)."""
    chat = chat_request("qwen3", True)
    return json.dumps(chat if api == "chat" else agent_request(chat, api)).encode()


def agent_request(chat: dict, endpoint: str) -> dict:
    """``chat`` as the same question to /v1/messages (Anthropic) or /v1/responses (OpenAI)."""
    system = next(m["content"] for m in chat["messages"] if m["role"] == "system")
    turns = [m for m in chat["messages"] if m["role"] != "system"]
    tools = [t["function"] for t in chat.get("tools") or ()]
    if endpoint == "messages":
        body = {"model": chat["model"], "system": system, "messages": turns, "max_tokens": chat["max_tokens"], "stream": True}
        if tools:
            body["tools"] = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in tools]
        return body
    body = {"model": chat["model"], "instructions": system, "input": turns, "max_output_tokens": chat["max_tokens"], "stream": True}
    if tools:
        body["tools"] = [{"type": "function", **t} for t in tools]
    return body


def prompt_of(model_dir: str, n: int) -> str:
    """A user message of about ``n`` tokens."""
    parts: list[str] = []
    count = 0
    i = 0
    while count < n:
        part = FILLER.format(i=i)
        count += len(_ids(model_dir, part))
        parts.append(part)
        i += 1
    return "".join(parts)


def fold(events: list[dict]) -> dict:
    """A chat.completion.chunk stream folded to what a client sees (as vLLM's parity test does)."""
    out = {"reasoning": "", "content": "", "tool_calls": {}, "finish_reason": None}
    for event in events:
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            out["reasoning"] += delta.get("reasoning") or delta.get("reasoning_content") or ""
            out["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                slot = out["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                function = call.get("function") or {}
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
            out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
    out["tool_calls"] = [
        {"name": c["name"], "arguments": json.loads(c["arguments"]) if c["arguments"] else None}
        for _, c in sorted(out["tool_calls"].items())
    ]
    return out


def digest(folded: dict) -> str:
    """A short fingerprint of a folded stream, to tell whether two paths produced the same answer."""
    import hashlib

    return hashlib.sha256(json.dumps(folded, sort_keys=True).encode()).hexdigest()[:16]


def sse_events(body: bytes) -> list[dict]:
    """``data:`` JSON events of an SSE body (``[DONE]`` left out)."""
    events = []
    for block in body.split(b"\n\n"):
        if block.startswith(b"data: ") and block[6:] != b"[DONE]":
            events.append(json.loads(block[6:]))
    return events
