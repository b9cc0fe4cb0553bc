"""Logging: text or JSON lines, and the one structured line per request.

Every record may carry ``fields`` (``log.info("request", extra={"fields": {...}})``):
the text format appends them as ``key=value``, the JSON format merges them
into the object. Prompt and completion text are logged only when
``--log-prompts`` sets ``LOG_PROMPTS``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any

LOG_PROMPTS = False


def _value(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)
    if text == "" or any(c in text for c in ' "=\n'):
        return json.dumps(text, ensure_ascii=False)
    return text


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_value(v)}" for k, v in fields.items())
        return line


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


# vLLM's start-up lines about GPU kernels (Triton, its compiled ops): the filter runs no model,
# only vLLM's renderer, tokenizer and parsers, so none of them concerns it. A newcomer should see
# the filter's lines, not alarms that contradict each other ("installed" / "not installed").
KERNEL_NOISE = (
    "Triton is installed but",
    "Triton not installed or not compatible",
    "Triton is not installed",
    "requires Triton",
    "Failed to import from vllm._C",
)
# vLLM's start-up lines that mean nothing for a filter: kernel choices (IR op priority, the SSM
# cache type of a mamba backend it never runs), what derender.model says again in its one line
# (architecture, max model len), and advice naming a flag the filter does not take.
START_NOISE = (
    "Final IR op priority",
    "Reset SSM cache type",
    "Resolved architecture:",
    "Using max model len",
    "Detected the chat template content format",
)


class _NoKernelNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("vllm"):
            return True
        message = record.getMessage()
        return not any(noise in message for noise in KERNEL_NOISE + START_NOISE)


def setup(level: str, fmt: str = "text", log_prompts: bool = False) -> None:
    global LOG_PROMPTS
    LOG_PROMPTS = log_prompts
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_NoKernelNoise())
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)


def sse_json(data: bytes):
    """The JSON objects of the ``data:`` lines in the SSE bytes a client got."""
    for line in data.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            continue
        if isinstance(event, dict):
            yield event


def completion_texts_from_sse(data: bytes) -> list[str]:
    """The text of each choice in the SSE bytes a client got (reasoning, content, completion text)."""
    texts: dict[int, list[str]] = {}
    for event in sse_json(data):
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or choice  # chat deltas; completions carry "text"
            for key in ("reasoning", "content", "text"):
                if delta.get(key):
                    texts.setdefault(choice.get("index", 0), []).append(delta[key])
    return ["".join(texts[i]) for i in sorted(texts)]


def completion_texts_from_json(body: bytes) -> list[str]:
    """The text of each choice in a ``chat.completion`` or ``text_completion`` body."""
    try:
        choices = json.loads(body).get("choices") or ()
    except (ValueError, AttributeError):
        return []
    texts = []
    for choice in choices:
        message = choice.get("message") or choice
        texts.append("".join(message.get(k) or "" for k in ("reasoning", "content", "text")))
    return texts
