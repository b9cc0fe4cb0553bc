"""The producer's wire as vLLM 0.33.0 validates it: limits, error bodies, request checks, faults."""

from __future__ import annotations

import json
import os
import re

from aiohttp import web

MAX_NUM_SEQS = 256  # vLLM's scheduler default
MAX_LOGPROBS = 20  # ModelConfig.max_logprobs default
_TURNS = (  # last user turn: ChatML (Qwen), DeepSeek, Harmony (gpt-oss)
    re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL),
    re.compile(r"<｜User｜>(.*?)(?=<｜Assistant｜>|<｜User｜>|$)", re.DOTALL),
    re.compile(r"<\|start\|>user<\|message\|>(.*?)<\|end\|>", re.DOTALL),
)
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
_SP = "body.sampling_params"
# Producer faults (knob ``fault``, at event ``fault_after``, for the requests that follow): malformed
# SSE, or a producer that dies (closes the connection without ending the body) or stalls (sends
# nothing, keeps it open; setting fault "die" meanwhile makes a stalled request die).
MALFORMED = ("garbage", "truncated_json", "unknown_output_mode", "out_of_vocab", "unknown_index", "flood")
FAULTS = (*MALFORMED, "die", "stall")
FLOOD_BYTES = 65 << 20  # "flood": one line longer than the filter's 64 MiB event bound


class RequestError(Exception):
    """vLLM's ErrorResponse: a JSON body, or an SSE event once streaming."""

    def __init__(
        self,
        message: str,
        type_: str = "BadRequestError",
        code: int = 400,
        param: str | None = None,
        value: object = None,
        client: bool = False,
    ):
        if client and param is not None:  # VLLMValidationError.__str__
            message += f" (parameter={param}, value={value})"
        super().__init__(message)
        self.code = code
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _json_response(body: object, status: int = 200) -> web.Response:
    text = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return web.Response(body=text.encode(), status=status, content_type="application/json")


def _err(type_: str, loc: str, msg: str, value: object, **ctx) -> dict:
    """One pydantic error, as FastAPI reports it."""
    return {"type": type_, "loc": loc, "msg": msg, "input": value, **({"ctx": ctx} if ctx else {})}


def _int_err(loc: str, value: object) -> dict:  # lax numeric strings count as errors here
    if isinstance(value, str):
        return _err("int_parsing", loc, "Input should be a valid integer, unable to parse string as an integer", value)
    return _err("int_type", loc, "Input should be a valid integer", value)


def _validation_error(errors: list[dict]) -> RequestError:
    """RequestValidationError as vLLM's handler renders it (inputs summarized)."""

    def summarize(v: object) -> object:
        if isinstance(v, (list, tuple, dict)):
            return f"<{type(v).__name__} of {len(v)} items>"
        text = v if isinstance(v, str) else str(v)
        return text[:200] + "...[truncated]" if len(text) > 200 else text

    lines = "".join(f"  {dict(e, input=summarize(e['input']))}\n" for e in errors[:10])
    message = f"{len(errors)} validation error{'s' * (len(errors) > 1)}:\n{lines}".rstrip()
    return RequestError(message, "Bad Request", 400, errors[0]["loc"])


def _check_body(body: object) -> None:
    """GenerateRequest validation as vLLM reports it (pydantic's common cases)."""
    if not isinstance(body, dict):
        raise _validation_error(
            [
                _err(
                    "model_attributes_type",
                    "body",
                    "Input should be a valid dictionary or object to extract fields from",
                    body,
                )
            ]
        )
    errors: list[dict] = []
    ids, sp = body.get("token_ids"), body.get("sampling_params")
    not_sp = _err(
        "is_instance_of", _SP, "Input should be an instance of SamplingParams", sp, **{"class": "SamplingParams"}
    )
    if isinstance(sp, dict):
        n, max_tokens, logprobs = (sp.get(f) for f in ("n", "max_tokens", "logprobs"))
        if bad := [
            f
            for f in ("n", "max_tokens", "logprobs")
            if f in sp and type(sp[f]) is not int and (sp[f] is not None or f == "n")
        ]:
            errors += [not_sp] + [_int_err(f"{_SP}.{f}", sp[f]) for f in bad]
        elif n is not None and n < 1:  # SamplingParams.__post_init__ raises past pydantic
            raise RequestError(f"n must be at least 1, got {n}.")
        elif max_tokens is not None and max_tokens < 1:
            raise RequestError(
                f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens", value=max_tokens, client=True
            )
        elif logprobs is not None and logprobs < -1:
            raise RequestError(
                f"logprobs must be non-negative or -1, got {logprobs}.", param="logprobs", value=logprobs, client=True
            )
    elif sp is None:
        errors.append(_err("missing", _SP, "Field required", body))
    else:
        errors += [not_sp, _err("dict_type", _SP, "Input should be a valid dictionary", sp)]
    loc = "body.token_ids"
    if "token_ids" not in body:
        errors.insert(0, _err("missing", loc, "Field required", body))
    elif not isinstance(ids, list):
        errors.insert(0, _err("list_type", loc, "Input should be a valid list", ids))
    elif bad_ids := [i for i, t in enumerate(ids) if type(t) is not int]:
        errors[:0] = [_int_err(f"{loc}.{i}", ids[i]) for i in bad_ids]
    elif not ids:
        errors.insert(
            0,
            _err(
                "too_short",
                loc,
                "List should have at least 1 item after validation, not 0",
                ids,
                field_type="List",
                min_length=1,
                actual_length=0,
            ),
        )
    elif any(t < 0 for t in ids):
        msg = "token_ids must not contain negative values"
        errors.insert(0, _err("value_error", loc, f"Value error, {msg}", ids, error=ValueError(msg)))
    if errors:
        raise _validation_error(errors)


def preload_features_decoder() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm.entrypoints.scale_out.token_in_token_out.mm_features  # noqa: F401


def check_features(body: dict) -> int:
    """``GenerateRequest.features`` as a producer reads them (vLLM's own model and decoder): placeholders
    within the prompt, every item's tensors inline (this producer caches none). Returns the item count."""
    features = body.get("features")
    if features is None:
        return 0
    if body.get("content_parts"):
        raise RequestError("content_parts and features are mutually exclusive")
    preload_features_decoder()
    from vllm.entrypoints.scale_out.token_in_token_out.mm_features import mm_kwargs_from_features
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import MultiModalFeatures

    try:
        parsed = MultiModalFeatures.model_validate(features)
        for ranges in parsed.mm_placeholders.values():
            if any(r.offset + r.length > len(body["token_ids"]) for r in ranges):
                raise ValueError("mm_placeholders must remain within the token_ids sequence")
        items = mm_kwargs_from_features(parsed)
    except (ValueError, TypeError) as exc:
        raise RequestError(str(exc)) from None
    missing = [m for m, values in items.items() if any(v is None for v in values)]
    if missing:
        raise RequestError(f"a {missing[0]} item without its data is not in this producer's cache")
    return sum(len(values) for values in items.values())
