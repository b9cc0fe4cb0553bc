"""Comparing the filter's answer with the reference's, and the parity table.

Only what must differ between two runs is normalized: the response ``id`` and
``created``, ``system_fingerprint``, and tool-call ids (compared by shape, one
stable id per tool index). Everything else is compared as is.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

_HEX = re.compile(r"[0-9a-f]{8,}")


def id_shape(value: str) -> str:
    return _HEX.sub("<hex>", value)


class ToolIds:
    """Tool-call ids of one response: one id per (choice, tool index), all distinct."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, int], str] = {}

    def placeholder(self, choice: int, index: int, value: str) -> str:
        first = self.ids.setdefault((choice, index), value)
        assert value == first, f"tool call {choice}/{index} changed id: {first} -> {value}"
        assert list(self.ids.values()).count(value) == 1, f"tool call id {value} reused"
        return f"{id_shape(value)}#{choice}.{index}"


def normalize_events(events: list) -> list:
    """Parsed SSE events with per-run values replaced by their shape."""
    ids = ToolIds()
    stream_ids = set()
    out = []
    for event in events:
        if not isinstance(event, dict):
            out.append(event)
            continue
        event = copy.deepcopy(event)
        if "id" in event:  # chatcmpl-{X-Request-Id}: Envoy's uuid here, vLLM's random hex there
            stream_ids.add(event["id"])
            assert event["id"].startswith("chatcmpl-"), event["id"]
            event["id"] = "chatcmpl-<id>"
        if "created" in event:
            assert isinstance(event["created"], int)
            event["created"] = "<created>"
        if event.get("system_fingerprint"):
            event["system_fingerprint"] = "<fingerprint>"
        for choice in event.get("choices") or ():
            for call in (choice.get("delta") or {}).get("tool_calls") or ():
                if call.get("id") is not None:
                    call["id"] = ids.placeholder(choice["index"], call["index"], call["id"])
        out.append(event)
    assert len(stream_ids) <= 1, f"one stream, several ids: {stream_ids}"
    return out


def normalize_response(body: dict) -> dict:
    """A non-streaming ``chat.completion`` with per-run values replaced by their shape."""
    body = copy.deepcopy(body)
    assert body["id"].startswith("chatcmpl-")
    body["id"], body["created"] = "chatcmpl-<id>", "<created>"
    if body.get("system_fingerprint"):
        body["system_fingerprint"] = "<fingerprint>"
    ids = ToolIds()
    for choice in body["choices"]:
        for i, call in enumerate(choice["message"].get("tool_calls") or ()):
            call["id"] = ids.placeholder(choice["index"], i, call["id"])
    return body


def _arguments(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # cut by `length`: compared as text


def assemble(events: list) -> dict:
    """The message each choice streamed, folded from its deltas, plus the final usage."""
    choices: dict[int, dict] = {}
    usage = None
    for event in events:
        if not isinstance(event, dict):
            continue
        if not event.get("choices") and event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices") or ():
            m = choices.setdefault(choice["index"], {"role": None, "content": "", "reasoning": "", "tool_calls": {},
                                                     "finish_reason": None, "stop_reason": None, "logprobs": []})
            delta = choice.get("delta") or {}
            m["role"] = m["role"] or delta.get("role")
            m["content"] += delta.get("content") or ""
            m["reasoning"] += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or ():
                t = m["tool_calls"].setdefault(call["index"], {"id": None, "type": None, "name": "", "arguments": ""})
                t["id"] = t["id"] or call.get("id")
                t["type"] = t["type"] or call.get("type")
                fn = call.get("function") or {}
                t["name"] += fn.get("name") or ""
                t["arguments"] += fn.get("arguments") or ""
            m["logprobs"] += (choice.get("logprobs") or {}).get("content") or []
            if choice.get("finish_reason") is not None:
                assert m["finish_reason"] is None, f"choice {choice['index']} finished twice"
                m["finish_reason"], m["stop_reason"] = choice["finish_reason"], choice.get("stop_reason")
    for m in choices.values():
        m["tool_calls"] = [
            {"id": id_shape(t["id"] or ""), "type": t["type"], "name": t["name"], "arguments": _arguments(t["arguments"])}
            for _, t in sorted(m["tool_calls"].items())
        ]
    return {"choices": dict(sorted(choices.items())), "usage": usage}


def deltas(events: list) -> list[tuple[int, dict]]:
    """The non-empty deltas in order, with their choice index (tool-call ids by shape)."""
    return [
        (c["index"], c["delta"])
        for e in normalize_events(events) if isinstance(e, dict)
        for c in e.get("choices") or ()
        if any(v not in (None, "", []) for v in (c.get("delta") or {}).values())
    ]


class ParityTable:
    """Case x model: pass / FAIL, written as markdown."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str], str] = {}
        self.models: list[str] = []

    def record(self, case: str, model: str, ok: bool, bugs: tuple[str, ...] = ()) -> None:
        if model not in self.models:
            self.models.append(model)
        cell = "pass" if ok else "**FAIL**"
        self.cells[(case, model)] = cell + "".join(f" ({bug})" for bug in bugs)

    def markdown(self, cases: list[str], command: str) -> str:
        models = self.models
        lines = ["| case | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
        for case in cases:
            if not any((case, m) in self.cells for m in models):
                continue
            lines.append(f"| {case} | " + " | ".join(self.cells.get((case, m), "n/a") for m in models) + " |")
        passed = sum(v.startswith("pass") for v in self.cells.values())
        lines += [
            "",
            (f"{passed}/{len(self.cells)} cells pass. n/a: the model config has no such feature "
             "(DeepSeek-R1 is served with a reasoning parser only; enable_thinking is Qwen3's template; "
             "reasoning_effort is rendered by Harmony only; Harmony renders a final assistant message as a "
             "finished turn, so continue_final_message does not apply; qwen3-no-parser is Qwen3 served with no "
             "reasoning or tool parser, vLLM's default, and runs the cases without reasoning or tool "
             "expectations of their own)."),
            ("(vllm#N): vLLM 0.33.0 itself streams this case wrongly; the filter matches it chunk for chunk, "
             "and the test checks the bug shows in vLLM's stream. vllm#55195: `<think>` leaks into reasoning "
             "when it shares a multi-token delta. vllm#51641: stop-string hold-back desyncs delta text from "
             "token ids, so reasoning is misrouted. vllm#52599: Harmony parses token ids, so the matched stop "
             "string stays in the text although include_stop_str_in_output is false."),
            "",
            f"Produced by: `{command}`",
        ]
        return "\n".join(lines) + "\n"

    def write(self, path: str | Path, cases: list[str], command: str) -> None:
        Path(path).write_text(self.markdown(cases, command))


# -- Anthropic Messages ----------------------------------------------------------------------
def normalize_anthropic(events: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """Anthropic (event, data) pairs with per-run values replaced: the message id, tool-use ids
    (one per block, by shape) and thinking signatures (random hex per block)."""
    out = []
    message_ids = set()
    tool_ids: dict[int, str] = {}
    for name, data in events:
        data = copy.deepcopy(data)
        message = data.get("message")
        if isinstance(message, dict) and "id" in message:
            message_ids.add(message["id"])
            assert message["id"].startswith("chatcmpl-"), message["id"]
            message["id"] = "<id>"
        block = data.get("content_block")
        if isinstance(block, dict) and block.get("id"):
            assert block["id"] not in tool_ids.values(), f"tool_use id {block['id']} reused"
            tool_ids[data["index"]] = block["id"]
            block["id"] = f"{id_shape(block['id'])}#{data['index']}"
        delta = data.get("delta")
        if isinstance(delta, dict) and delta.get("type") == "signature_delta":
            assert re.fullmatch(r"[0-9a-f]{32}", delta["signature"]), delta
            delta["signature"] = "<signature>"
        out.append((name, data))
    assert len(message_ids) <= 1, f"one stream, several ids: {message_ids}"
    return out


def assemble_anthropic(events: list[tuple[str, dict]]) -> dict:
    """The message a client folds from the events: blocks with their text, thinking or input."""
    blocks: dict[int, dict] = {}
    final: dict = {}
    for name, data in events:
        if name == "content_block_start":
            block = dict(data["content_block"])
            block.pop("id", None)
            block.pop("signature", None)
            if block["type"] == "tool_use":
                block["input"] = ""
            blocks[data["index"]] = block
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            kind = delta["type"]
            if kind == "text_delta":
                block["text"] += delta["text"]
            elif kind == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif kind == "input_json_delta":
                block["input"] += delta["partial_json"]
        elif name == "message_delta":
            final = {"stop_reason": data["delta"].get("stop_reason"), "stop_sequence": data["delta"].get("stop_sequence"),
                     "usage": data.get("usage")}
        elif name == "error":
            final = {"error": data["error"]}
    for block in blocks.values():
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["input"] or "{}")
    return {"content": [blocks[i] for i in sorted(blocks)], **final}


def normalize_message(body: dict) -> dict:
    """A non-streaming Anthropic message with per-run values replaced."""
    body = copy.deepcopy(body)
    assert body["id"].startswith("chatcmpl-"), body["id"]
    body["id"] = "<id>"
    for i, block in enumerate(body.get("content") or ()):
        if block.get("id"):
            block["id"] = f"{id_shape(block['id'])}#{i}"
        if block.get("signature"):
            assert re.fullmatch(r"[0-9a-f]{32}", block["signature"]), block
            block["signature"] = "<signature>"
    return body


# -- OpenAI Responses ------------------------------------------------------------------------
_RANDOM_ID = re.compile(r"^(resp|rs|msg|fc|call|ws|chatcmpl-tool|chatcmpl)[_-][0-9a-zA-Z-]{8,}$")


def normalize_responses(value):
    """Responses events (or a response) with per-run ids replaced by ``<id N>`` in order of first
    appearance (so an id that one event repeats must be repeated the same way) and times by ``<t>``."""
    seen: dict[str, str] = {}

    def walk(v, key=None):
        if isinstance(v, dict):
            return {k: walk(x, k) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(walk(x) for x in v)
        if isinstance(v, str) and _RANDOM_ID.match(v):
            return seen.setdefault(v, f"<id {len(seen)}>")
        if key in ("created_at", "completed_at") and isinstance(v, (int, float)):
            return "<t>"
        return v

    return walk(value)


def assemble_responses(events: list[tuple[str, dict]]) -> dict:
    """What a client reads off a Responses stream: the reasoning, text and function calls it was
    streamed (deltas folded), and the terminal event's status and output."""
    reasoning, text, args = [], [], {}
    names = {}
    terminal: dict = {}
    for name, data in events:
        if name == "response.reasoning_text.delta":
            reasoning.append(data["delta"])
        elif name == "response.output_text.delta":
            text.append(data["delta"])
        elif name == "response.function_call_arguments.delta":
            args[data["item_id"]] = args.get(data["item_id"], "") + data["delta"]
        elif name == "response.output_item.added" and data["item"]["type"] == "function_call":
            names[data["item"]["id"]] = data["item"]["name"]
        elif name in ("response.completed", "response.incomplete", "response.failed"):
            terminal = {"event": name, "status": data["response"]["status"],
                        "incomplete": data["response"].get("incomplete_details")}
    return {"reasoning": "".join(reasoning), "text": "".join(text),
            "calls": [(names.get(i), a) for i, a in args.items()], **terminal}


def response_parts(response: dict) -> dict:
    """The same view of a (non-streamed, or terminal) response object."""
    reasoning, text, calls = [], [], []
    for item in response["output"]:
        if item["type"] == "reasoning":
            reasoning += [c["text"] for c in item.get("content") or ()]
        elif item["type"] == "message":
            text += [c["text"] for c in item["content"] if c["type"] == "output_text"]
        elif item["type"] == "function_call":
            calls.append((item["name"], item["arguments"]))
    return {"reasoning": "".join(reasoning), "text": "".join(text), "calls": calls}
