"""OpenAI-style error bodies, shaped exactly as vLLM's HTTP server shapes them."""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any, TypeVar

from pydantic import ValidationError

T = TypeVar("T")

# A stream that ended before every choice finished (the client gets it as a 502).
INCOMPLETE = "the producer's stream ended before the generation finished"
# /v1/completions with several prompts, here and in render-tier mode.
ONE_PROMPT = (
    "This endpoint takes one prompt per request (got {n}): each request becomes one producer "
    "request, so send each prompt in its own request."
)


class HTTPError(Exception):
    """An error the client gets as ``{"error": {...}}`` with an HTTP status."""

    # True: the OpenAI shape on every endpoint (vLLM's request-validation 400s are answered
    # before any endpoint's handler runs, so /v1/messages gets them in this shape too).
    openai_shape = False

    def __init__(self, status: int, message: str, err_type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = err_type or _default_type(self.status)
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.type, self.param)

    @classmethod
    def from_vllm(cls, response: Any) -> HTTPError:
        """From a vLLM ``ErrorResponse``."""
        e = response.error
        return cls(e.code, e.message, e.type, e.param)


class AnthropicHTTPError(HTTPError):
    """An ``HTTPError`` the client gets in Anthropic's shape (vLLM's ``translate_error_response``)."""

    @classmethod
    def of(cls, exc: HTTPError) -> HTTPError:
        if isinstance(exc, AnthropicHTTPError) or exc.openai_shape:
            return exc
        return cls(exc.status, exc.message, exc.type, exc.param)

    def body(self) -> bytes:
        return anthropic_error_body(self.status, self.message)


def anthropic_error_body(status: int, message: str) -> bytes:
    """``{"type": "error", "error": {...}}`` with the error type vLLM picks for ``status``."""
    from vllm.entrypoints.anthropic.protocol import translate_error_type

    return dumps({"type": "error", "error": {"type": translate_error_type(status), "message": message}})


def _default_type(status: int) -> str:
    if status == 400:
        return "BadRequestError"
    if status == 401:
        return "AuthenticationError"
    if status == 404:
        return "NotFoundError"
    if status == 413:
        return "RequestEntityTooLarge"
    if status == 429:
        return "RateLimitError"
    if status >= 500:
        return "InternalServerError"
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def dumps(content: Any) -> bytes:
    """JSON as Starlette's ``JSONResponse`` renders it (vLLM's non-streaming bodies)."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def error_body(status: int, message: str, err_type: str | None = None, param: str | None = None) -> bytes:
    return dumps(
        {"error": {"message": message, "type": err_type or _default_type(status), "param": param, "code": status}}
    )


# A mid-stream error event in each client shape, as vLLM streams it: one helper per shape.
def error_event(status: int, message: str, err_type: str | None = None, param: str | None = None) -> bytes:
    """OpenAI chat and completions: one SSE event (``[DONE]`` follows separately)."""
    return b"data: " + error_body(status, message, err_type, param) + b"\n\n"


def anthropic_error_event(status: int, message: str) -> bytes:
    """Anthropic Messages: the ``error`` event."""
    return b"event: error\ndata: " + anthropic_error_body(status, message) + b"\n\n"


def responses_error_event(error: HTTPError, sequence: int) -> bytes:
    """OpenAI Responses: the ``error`` event, numbered ``sequence`` (its status as the code)."""
    data = {
        "type": "error",
        "code": str(error.status),
        "message": error.message,
        "param": error.param,
        "sequence_number": sequence,
    }
    return f"event: error\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def parse_body(validate: Callable[[Any], T], raw: bytes) -> T:
    """Decode and validate a JSON body as FastAPI does before vLLM sees it; 400 as vLLM reports it."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad JSON, bytes that are not UTF-8, nesting too deep
        error = {"type": "json_invalid", "loc": ("body", getattr(exc, "pos", 0)), "msg": "JSON decode error"}
        raise _validation_error([{**error, "input": {}, "ctx": {"error": getattr(exc, "msg", str(exc))}}]) from None
    try:
        return validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except (KeyError, IndexError, AttributeError) as exc:
        # A vLLM request model's own validator tripped on a malformed body (``tools: [{}]`` with a
        # named ``tool_choice``: ``tool["function"]``). vLLM answers 500 for its KeyError; the fault
        # is the client's body, so here it is a 400 that says what was missing (docs/parity.md).
        raise HTTPError(400, f"Malformed request body: {_crash_detail(exc)}", "BadRequestError") from None


def _crash_detail(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"a required field {exc.args[0]!r} is missing" if exc.args else "a required field is missing"
    if isinstance(exc, IndexError):
        return "a list is shorter than required"
    return "a field has the wrong type"


def validation_error(exc: ValidationError) -> HTTPError:
    """A pydantic ``ValidationError`` of the request body, as vLLM reports a 400."""
    return _validation_error([{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors(include_url=False)])


def _validation_error(errors: list[dict[str, Any]]) -> HTTPError:
    """FastAPI's request-validation errors through vLLM's own handler."""
    from fastapi.exceptions import RequestValidationError
    from vllm.entrypoints.serve.exception_handling.handlers.validation import (
        validation_exception_handler,
    )

    fake = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(log_error_stack=False))))
    response = None
    coro = validation_exception_handler(fake, RequestValidationError(errors))  # type: ignore[arg-type]  # reads app.state.args only
    try:
        coro.send(None)
    except StopIteration as done:
        response = done.value
    assert response is not None
    body = json.loads(response.body)["error"]
    return HTTPError(response.status_code, body["message"], body["type"], body["param"])


def from_exception(exc: Exception) -> HTTPError:
    """Any exception, classified by vLLM's own ``create_error_response``."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    return HTTPError.from_vllm(create_error_response(exc))
