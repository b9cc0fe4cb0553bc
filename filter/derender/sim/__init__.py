"""Producer simulator: vLLM 0.33.0's ``POST /inference/v1/generate`` without a GPU.

Speaks the token-in/token-out wire format of
``vllm/entrypoints/scale_out/token_in_token_out/`` byte for byte: field order,
null vs omitted fields, SSE framing, usage and error events, the non-streaming
body and vLLM's 400 bodies. Importing vLLM's models costs ~6 s, so the JSON is
built by hand in their field order; stream chunks go through
``pydantic_core.to_json`` (what ``model_dump_json`` uses: same float format),
non-streaming bodies through ``json.dumps`` like Starlette's ``JSONResponse``.

Answers come from one of two modes:
- ``echo``: the text of the last user turn of the prompt (ChatML, DeepSeek and
  Harmony templates; otherwise the last 200 chars of the decoded prompt),
  re-tokenized, then the model's EOS id: finish_reason "stop", stop_reason null.
- ``script``: a JSONL file, re-read on every request, one choice per line:
  ``{"index": 0, "token_ids": [...], "finish_reason": "stop", "stop_reason": null,
  "chunks": [2, 1, 3], "logprobs": [{"logprob": -0.1, "top": [[id, lp], ...],
  "rank": 1}, ...]}`` (all but token_ids optional). Choices missing for n > 1
  reuse the first line. Lines with ``"when": "TEXT"`` answer only prompts whose
  decoded text contains TEXT (and then the lines without ``when`` do not): one
  script for each turn of an agent's exchange, e.g. a tool call, then an answer
  once the prompt holds the tool's result.

Like vLLM, the request's ``stop_token_ids`` and ``max_tokens`` cut the answer (a
stop token beats the length cap on the same step). ``abort_requests`` takes
ENGINE ids (``generate-tokens-<X-Request-Id or request_id>``), as vLLM's engine
does. Stop strings get vLLM's ``--tokens-only`` 400.

The package: ``wire`` (vLLM's request checks and error bodies), ``generation`` (one request in
flight), ``cache`` (the prefix cache), ``simulator`` (state and plan), ``serving`` (the HTTP
handlers), ``app`` (the app, flags and ``main``). ``python -m derender.sim`` runs it.
"""

from .app import add_arguments, build_app, main
from .cache import PrefixCache
from .generation import _Choice, _Generation
from .simulator import SIMULATOR, Simulator
from .wire import FAULTS, MALFORMED

__all__ = [
    "FAULTS",
    "MALFORMED",
    "SIMULATOR",
    "PrefixCache",
    "Simulator",
    "_Choice",
    "_Generation",
    "add_arguments",
    "build_app",
    "main",
]
