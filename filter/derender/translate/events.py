"""The producer's token events, parsed: what each says (tokens, usage, an error), stepped into the
per-choice outputs (``outputs.ChoiceOutputs``)."""

from __future__ import annotations

import json
from typing import Any

from .errors import HTTPError
from .outputs import ChoiceOutputs, ProducerError

# A choice ended where the engine ends one at ``max_tokens``, with no more tokens.
LENGTH_CUT: dict[str, Any] = {"finish_reason": "length", "stop_reason": None, "token_ids": []}


def step_event(outputs: ChoiceOutputs, event: dict[str, Any]) -> tuple[list[Any], bool, int]:
    """One producer token event into ``outputs``: (its ``RequestOutput``s, abort the producer now?, tokens)."""
    check_output_mode(event)
    results: list[Any] = []
    abort, tokens = False, 0
    for choice in event.get("choices") or ():
        outs, stop = outputs.step(choice)
        tokens += len(choice.get("token_ids") or ())
        results.extend(outs)
        abort |= stop
    return results, abort, tokens


def has_tokens(payload: bytes) -> bool:
    """Whether a producer event carries completion tokens (asked at a key's token limit only: rare)."""
    try:
        event = json.loads(payload)
    except ValueError:
        return True
    return isinstance(event, dict) and any(
        c.get("token_ids") for c in event.get("choices") or () if isinstance(c, dict)
    )


def cached_tokens(event: Any) -> int | None:
    """The prompt tokens a producer found in its prefix cache, if its usage says
    (``vllm serve --enable-prompt-tokens-details``)."""
    try:
        value = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (KeyError, TypeError):
        return None
    return value if isinstance(value, int) else None


def producer_error_event(error: Any) -> HTTPError:
    """A producer's ``{"error": ...}`` event as the error the client gets (the producer's code as status)."""
    if not isinstance(error, dict):
        return HTTPError(502, f"producer error: {error!r}")
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    return HTTPError(status, str(error.get("message", "producer error")), error.get("type"))


def check_output_mode(event: Any) -> None:
    """Token ids are all the filter can use: ``output_mode`` "text" or "derender" would be rendered twice."""
    if not isinstance(event, dict):
        raise ProducerError("the producer's answer is not a JSON object")
    mode = event.get("output_mode", "tokens")
    if mode != "tokens":
        raise ProducerError(f"producer sent output_mode {mode!r}; the filter needs 'tokens'")


def answer_tokens(body: bytes) -> tuple[int | None, tuple[str, ...]]:
    """Tokens in a non-streaming producer response (all choices), and the choices' finish reasons."""
    try:
        choices = json.loads(body).get("choices") or ()
        tokens = sum(len(c.get("token_ids") or ()) for c in choices)
        return tokens, tuple(str(c["finish_reason"]) for c in choices if c.get("finish_reason"))
    except (ValueError, AttributeError, TypeError):
        return None, ()
