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
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import itertools
import json
import logging
import math
import random
import re
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

import pydantic_core
from aiohttp import web
from tokenizers import Tokenizer

MAX_NUM_SEQS = 256  # vLLM's scheduler default
MAX_LOGPROBS = 20  # ModelConfig.max_logprobs default
_TURNS = (  # last user turn: ChatML (Qwen), DeepSeek, Harmony (gpt-oss)
    re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S),
    re.compile(r"<｜User｜>(.*?)(?=<｜Assistant｜>|<｜User｜>|$)", re.S),
    re.compile(r"<\|start\|>user<\|message\|>(.*?)<\|end\|>", re.S),
)
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}
_SP = "body.sampling_params"
# Producer faults (knob ``fault``, at event ``fault_after``, for the requests that follow): malformed
# SSE, or a producer that dies (closes the connection without ending the body) or stalls (sends
# nothing, keeps it open; setting fault "die" meanwhile makes a stalled request die).
MALFORMED = ("garbage", "truncated_json", "unknown_output_mode", "out_of_vocab", "unknown_index",
             "flood")
FAULTS = (*MALFORMED, "die", "stall")
FLOOD_BYTES = 65 << 20  # "flood": one line longer than the filter's 64 MiB event bound


class RequestError(Exception):
    """vLLM's ErrorResponse: a JSON body, or an SSE event once streaming."""

    def __init__(self, message: str, type_: str = "BadRequestError", code: int = 400,
                 param: str | None = None, value: object = None, client: bool = False):
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
        return _err("int_parsing", loc, "Input should be a valid integer, unable to parse "
                    "string as an integer", value)
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
        raise _validation_error([_err("model_attributes_type", "body", "Input should be a "
                                      "valid dictionary or object to extract fields from", body)])
    errors, ids, sp = [], body.get("token_ids"), body.get("sampling_params")
    not_sp = _err("is_instance_of", _SP, "Input should be an instance of SamplingParams", sp,
                  **{"class": "SamplingParams"})
    if isinstance(sp, dict):
        n, max_tokens, logprobs = (sp.get(f) for f in ("n", "max_tokens", "logprobs"))
        if bad := [f for f in ("n", "max_tokens", "logprobs") if f in sp
                   and type(sp[f]) is not int and (sp[f] is not None or f == "n")]:
            errors += [not_sp] + [_int_err(f"{_SP}.{f}", sp[f]) for f in bad]
        elif n is not None and n < 1:  # SamplingParams.__post_init__ raises past pydantic
            raise RequestError(f"n must be at least 1, got {n}.")
        elif max_tokens is not None and max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}.",
                               param="max_tokens", value=max_tokens, client=True)
        elif logprobs is not None and logprobs < -1:
            raise RequestError(f"logprobs must be non-negative or -1, got {logprobs}.",
                               param="logprobs", value=logprobs, client=True)
    elif sp is None:
        errors.append(_err("missing", _SP, "Field required", body))
    else:
        errors += [not_sp, _err("dict_type", _SP, "Input should be a valid dictionary", sp)]
    loc = "body.token_ids"
    if "token_ids" not in body:
        errors.insert(0, _err("missing", loc, "Field required", body))
    elif not isinstance(ids, list):
        errors.insert(0, _err("list_type", loc, "Input should be a valid list", ids))
    elif bad := [i for i, t in enumerate(ids) if type(t) is not int]:
        errors[:0] = [_int_err(f"{loc}.{i}", ids[i]) for i in bad]
    elif not ids:
        errors.insert(0, _err("too_short", loc, "List should have at least 1 item after "
                              "validation, not 0", ids, field_type="List", min_length=1,
                              actual_length=0))
    elif any(t < 0 for t in ids):
        msg = "token_ids must not contain negative values"
        errors.insert(0, _err("value_error", loc, f"Value error, {msg}", ids,
                              error=ValueError(msg)))
    if errors:
        raise _validation_error(errors)


@dataclass
class _Choice:
    index: int
    tokens: list[int]
    finish: str
    stop_reason: int | str | None
    sizes: list[int]  # tokens per event, summing to len(tokens)
    logprobs: list[dict[int, tuple[float, int]]] | None  # per token, in engine order
    steps: list[int] | None = None  # engine steps per event (stream_interval); None: one each
    sent: int = 0
    done: bool = False


@dataclass(eq=False)  # hashable by identity
class _Generation:
    """One request in flight."""

    engine_id: str
    choices: list[_Choice]
    request: web.Request
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    fault: str | None = None  # the knobs when the request came in
    fault_after: int = 0
    hold_after: int | str | None = None  # N events, or "end": after the last, before [DONE]
    released: asyncio.Event = field(default_factory=asyncio.Event)
    cached_tokens: int = 0  # of the prompt, found in the prefix cache

    def closed(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()


def _stream_interval(sizes: list[int], interval: int) -> list[int] | None:
    """Engine steps (of these token counts) per event that vLLM's output processor sends with
    ``stream_interval`` N: the first token's step at once, then whenever N tokens have gathered
    since the last event, and the last step (``output_processor.py``); None for N = 1. An event
    waits for each of its steps (``delay`` per step), so a client sees a GPU's pacing."""
    if interval <= 1:
        return None
    steps, gathered, count = [], 0, 0
    for i, size in enumerate(sizes):
        gathered, count = gathered + size, count + 1
        if not steps or gathered >= interval or i == len(sizes) - 1:
            steps.append(count)
            gathered = count = 0
    return steps


class _Disconnected(Exception):
    pass


class _Died(Exception):
    """Fault "die": drop the connection here."""


async def _drop(request: web.Request) -> None:
    """Close the connection at once (no end of body), once what was written is in the kernel."""
    transport = request.transport
    if transport is None:
        return
    while transport.get_write_buffer_size() and not transport.is_closing():
        await asyncio.sleep(0.001)
    transport.abort()


class PrefixCache:
    """vLLM's prefix cache, modelled: an LRU of full blocks of ``BLOCK`` tokens, each known by
    the hash of its whole prefix (a chain, as vLLM hashes them). A request finds the leading
    blocks of its prompt that are cached; when it ends, its prompt and output blocks are cached.
    ``capacity`` 0: no cache (nothing is ever found)."""

    BLOCK = 16

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self.blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def chain(self, token_ids: list[int]) -> list[bytes]:
        hashes, parent = [], b""
        for start in range(0, len(token_ids) // self.BLOCK * self.BLOCK, self.BLOCK):
            block = token_ids[start:start + self.BLOCK]
            parent = hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in block),
                                     digest_size=16).digest()
            hashes.append(parent)
        return hashes

    def cached_tokens(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` found in the cache (whole leading blocks), which become recent."""
        found = 0
        for h in self.chain(prompt):
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            found += 1
        return found * self.BLOCK

    def store(self, token_ids: list[int]) -> None:
        if not self.capacity:
            return
        for h in self.chain(token_ids):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class Simulator:
    def __init__(self, model_dir: str, mode: str = "echo", script: str | None = None,
                 tokens_per_event: int | str = 1, delay: float = 0.0,
                 finish_only_tail: bool = False, error_after: int | None = None,
                 http_error: int | None = None, prefix_cache_blocks: int = 0,
                 prefill_us_per_token: float = 0.0, prompt_tokens_details: bool = False):
        if mode not in ("echo", "script") or (mode == "script" and not script):
            raise ValueError("mode must be 'echo' or 'script' (script needs a JSONL file)")
        folder = Path(model_dir).expanduser()
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "config.json").read_text())
        eos = config.get("eos_token_id")
        if eos is None:
            name = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
            eos = self.tokenizer.token_to_id(name["content"] if isinstance(name, dict) else name)
        self.eos = eos[0] if isinstance(eos, list) else eos
        self.vocab_size = config.get("vocab_size") or self.tokenizer.get_vocab_size()
        self.max_model_len = config.get("max_position_embeddings", 2048)
        self.model_name = model_dir  # what `vllm serve DIR` reports
        self.configure(mode=mode, script=script, tokens_per_event=tokens_per_event, delay=delay,
                       finish_only_tail=finish_only_tail, error_after=error_after,
                       http_error=http_error, split_writes=1)
        self.requests: collections.deque = collections.deque(maxlen=50)
        self.headers: collections.deque = collections.deque(maxlen=50)  # of generate requests
        self.received = 0  # generate requests, ever
        self.prompt_tokens = 0  # of those requests, ever
        self.prefill_waits: collections.deque[float] = collections.deque(maxlen=100_000)  # seconds, see below
        self.cached_prompt_tokens = 0  # of those, found in the prefix cache
        self.aborted: list[str] = []
        self.disconnected: list[str] = []
        self.running: dict[str, set[_Generation]] = collections.defaultdict(set)
        self.held: set[_Generation] = set()
        self.hold_after: int | None = None
        self.cache = PrefixCache(prefix_cache_blocks)
        self.prefill_us_per_token = prefill_us_per_token
        self._prefill = asyncio.Lock()
        self.prompt_tokens_details = prompt_tokens_details

    def configure(self, mode: str | None = None, script: str | None = None,
                  tokens_per_event: int | str | None = None, delay: float | None = None,
                  finish_only_tail: bool | None = None, error_after: int | None = None,
                  http_error: int | None = None, split_writes: int | None = None,
                  fault: str | None = None, fault_after: int | None = None,
                  hold_after: int | str | None = None) -> None:
        """Set the knobs for the requests that follow (also POST /sim/config).

        ``error_after``, ``http_error``, ``fault`` (at event ``fault_after``, see
        FAULTS) and ``hold_after`` are set as given (None turns them off); the other
        knobs keep their value when None. ``split_writes`` > 1 writes each event in
        that many pieces, so events cross TCP writes. ``hold_after`` N: a request
        sends N events, then waits, its connection open, until POST /sim/release
        (or an abort, or its client leaving); /sim/stats lists it under ``held``.
        ``hold_after`` "end": a streaming request sends every event (its usage too) and
        waits the same way before ``[DONE]`` and the end of its body.
        """
        if mode is not None:
            self.mode = mode
        if script is not None:
            self.script = script
        if self.mode not in ("echo", "script") or (self.mode == "script" and not self.script):
            raise ValueError("mode must be 'echo' or 'script' (script needs a JSONL file)")
        if delay is not None:
            self.delay = delay
        if finish_only_tail is not None:
            self.finish_only_tail = finish_only_tail
        if split_writes is not None:
            self.split_writes = max(1, int(split_writes))
        self.error_after, self.http_error = error_after, http_error
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(FAULTS)}")
        self.fault, self.fault_after = fault, fault_after or 0
        if hold_after is not None and hold_after != "end" and int(hold_after) < 0:
            raise ValueError("hold_after must be >= 0 or 'end'")
        self.hold_after = None if hold_after is None else hold_after if hold_after == "end" else int(hold_after)
        if tokens_per_event is not None:
            self.seed = None
            if isinstance(tokens_per_event, str) and tokens_per_event.startswith("random:"):
                self.seed, tokens_per_event = tokens_per_event.split(":", 1)[1], 1
            if int(tokens_per_event) < 1:
                raise ValueError("tokens_per_event must be >= 1 or 'random:SEED'")
            self.tokens_per_event = int(tokens_per_event)

    async def set_config(self, request: web.Request) -> web.Response:
        try:
            self.configure(**json.loads(await request.read()))
        except (ValueError, TypeError) as e:
            return _json_response({"error": str(e)}, 400)
        return web.Response(status=200)

    # ---- answers -----------------------------------------------------------------
    def _echo_answer(self, prompt: list[int]) -> list[int]:
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        found = next((f[-1] for p in _TURNS if (f := p.findall(text))), None)
        if found is None:
            found = self.tokenizer.decode(prompt, skip_special_tokens=True)[-200:]
        return self.tokenizer.encode(found, add_special_tokens=False).ids + [self.eos]

    def _logprobs(self, tok: int, pos: int, index: int, k: int, given: dict | None) -> dict:
        """The engine's {token_id: (logprob, rank)} at one position: the sampled token
        first, then the top k (a sampled token inside the top k appears once)."""
        if given is None:  # deterministic fake: every third token was the rank-2 one
            rank = 2 if pos % 3 == 2 else 1

            def value(r: int) -> float:
                return -round(0.05 + 0.5 * (r - 1) + 0.01 * ((pos + index) % 5), 4)

            top = [(tok if r == rank else (tok + r) % self.vocab_size, value(r))
                   for r in range(1, k + 1)]
            sampled = value(rank)
        else:
            top = [(int(t), float(lp)) for t, lp in given.get("top", [])]
            sampled, ids = float(given["logprob"]), [t for t, _ in top]
            rank = given.get("rank") or (ids.index(tok) + 1 if tok in ids else
                                         1 + sum(lp > sampled for _, lp in top))
        entries = {tok: (sampled, rank)}
        entries.update((t, (lp, r)) for r, (t, lp) in enumerate(top[:k], 1))
        return entries

    def _plan(self, body: dict) -> list[_Choice]:
        sp = body["sampling_params"]
        k, stop_ids = sp.get("logprobs"), set(sp.get("stop_token_ids") or ())
        room = max(1, self.max_model_len - len(body["token_ids"]))  # engine stops there
        max_tokens = min(sp.get("max_tokens") or room, room)
        if self.mode == "echo":
            lines = {0: {"token_ids": self._echo_answer(body["token_ids"])}}
        else:
            text = Path(self.script).read_text()
            parsed = [json.loads(s) for s in text.splitlines() if s.strip()]
            if any("when" in line for line in parsed):  # the answers of a multi-turn exchange
                prompt = self.tokenizer.decode(body["token_ids"], skip_special_tokens=False)
                matching = [line for line in parsed if "when" in line and line["when"] in prompt]
                parsed = matching or [line for line in parsed if "when" not in line]
            lines = {line.get("index", i): line for i, line in enumerate(parsed)}
            if not lines:
                raise ValueError(f"{self.script} has no choices")
        rng = random.Random(self.seed) if self.seed is not None else None
        choices = []
        for index in range(sp.get("n") or 1):
            line = lines.get(index) or next(iter(lines.values()))
            tokens = [int(t) for t in line.get("token_ids", [])]
            finish, stop_reason = line.get("finish_reason") or "stop", line.get("stop_reason")
            cut = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
            if cut is not None:
                tokens, finish, stop_reason = tokens[: cut + 1], "stop", tokens[cut]
            if len(tokens) > max_tokens:
                tokens, finish, stop_reason = tokens[:max_tokens], "length", None
            sizes, left = [], len(tokens)
            for size in [s for s in line.get("chunks") or () if s > 0]:
                if left > 0:
                    sizes.append(min(size, left))
                    left -= sizes[-1]
            while left > 0:
                sizes.append(min(rng.randint(1, 4) if rng else self.tokens_per_event, left))
                left -= sizes[-1]
            steps = _stream_interval(sizes, sp.get("stream_interval") or 1)
            if steps is not None:
                sizes = [sum(sizes[a:b]) for a, b in zip([0, *itertools.accumulate(steps)], itertools.accumulate(steps))]
            given = line.get("logprobs") or []
            logprobs = None if k is None else [
                self._logprobs(t, p, index, k, given[p] if p < len(given) else None)
                for p, t in enumerate(tokens)]
            choices.append(_Choice(index, tokens, finish, stop_reason, sizes, logprobs, steps))
        return choices

    # ---- engine loop ---------------------------------------------------------------
    async def _steps(self, gen: _Generation):
        """Yield (choice, start, end, final) per engine output, round-robin over the
        choices, honouring delay, abort, disconnect and error_after."""
        per_choice = []
        for c in gen.choices:
            ends = [sum(c.sizes[: i + 1]) for i in range(len(c.sizes))]
            waits = c.steps or [1] * len(c.sizes)  # engine steps before each event
            events = [(c, end - size, end, False, w) for size, end, w in zip(c.sizes, ends, waits)]
            if self.finish_only_tail or not events:
                events.append((c, len(c.tokens), len(c.tokens), True, 1))
            else:
                events[-1] = (*events[-1][:3], True, events[-1][4])
            per_choice.append(events)
        steps = max(len(events) for events in per_choice)
        schedule = [events[t] for t in range(steps) for events in per_choice if t < len(events)]
        for count, (c, start, end, final, wait) in enumerate(schedule):
            if count == gen.hold_after:
                await self._hold(gen)
            if self.delay > 0:
                try:
                    await asyncio.wait_for(gen.aborted.wait(), self.delay * wait)
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)
            if gen.closed():
                raise _Disconnected
            if gen.aborted.is_set():
                break
            if gen.fault in ("die", "stall") and count == gen.fault_after:
                while gen.fault == "stall" and not (gen.closed() or gen.aborted.is_set()):
                    await asyncio.sleep(0.05)  # silent, connection open
                    if self.fault == "die":  # set while stalled: die now
                        gen.fault = "die"
                if gen.fault == "die":
                    raise _Died
                if gen.closed():
                    raise _Disconnected
                break
            if self.error_after is not None and count >= self.error_after:
                raise RequestError("Internal server error", "InternalServerError", 500)
            c.sent, c.done = end, final
            yield c, start, end, final
        for c in gen.choices:  # the engine's final output for an aborted request
            if not c.done:
                c.finish, c.stop_reason, c.done = "abort", None, True
                yield c, c.sent, c.sent, True

    @staticmethod
    def _usage(prompt: int, completion: int, details: bool = True, cached: int | None = None) -> dict:
        """vLLM's UsageInfo; ``cached``: the prompt tokens found in the prefix cache, which vLLM
        reports (``prompt_tokens_details.cached_tokens``) with --enable-prompt-tokens-details."""
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                 "completion_tokens": completion}
        if details:
            usage.update(prompt_tokens_details=None, completion_tokens_details=None)
        if cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def _cached(self, gen: _Generation) -> int | None:
        return gen.cached_tokens if self.prompt_tokens_details else None

    @staticmethod
    def _choice(c: _Choice, start: int, end: int, final: bool, k: int | None) -> dict:
        def entry(t: int, lp: float, rank: int) -> dict:  # ServingTokens' clamp and rank
            lp = -9999.0 if math.isnan(lp) else max(lp, -9999.0)
            return {"token_id": t, "logprob": lp, "rank": rank or None}

        logprobs = None if k is None else {"content": [
            {**entry(tok, *lps[tok]), "top_logprobs": [entry(t, *v) for t, v in lps.items()]}
            for tok, lps in zip(c.tokens[start:end], c.logprobs[start:end])]}
        return {"index": c.index, "finish_reason": c.finish if final else None,
                "stop_reason": c.stop_reason if final else None,
                "token_ids": c.tokens[start:end], "routed_experts": None,
                "sampling_mask": None, "weight_versions": None, "logprobs": logprobs}

    # ---- HTTP ----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.received += 1
        self.headers.append(dict(request.headers))
        body, bad_json = None, None
        try:
            if raw:
                self.requests.append(body := json.loads(raw))
        except ValueError as e:
            bad_json = e
        try:
            if (code := self.http_error) is not None:
                raise RequestError(f"simulated HTTP {code} error",
                                   _ERROR_TYPES.get(code, HTTPStatus(code).phrase), code)
            if request.content_type != "application/json":
                raise RequestError("1 validation error:\n  Unsupported Media Type: Only "
                                   "'application/json' is allowed", "Bad Request", 400)
            if bad_json is not None:
                raise _validation_error([_err(
                    "json_invalid", f"body.{getattr(bad_json, 'pos', 0)}", "JSON decode error",
                    {}, error=getattr(bad_json, "msg", str(bad_json)))])
            if body is None:
                raise _validation_error([_err("missing", "body", "Field required", None)])
            _check_body(body)
            return await self._serve(request, body)
        except RequestError as e:
            return _json_response(e.body, e.code)

    async def _serve(self, request: web.Request, body: dict) -> web.StreamResponse:
        sp, prompt = body["sampling_params"], body["token_ids"]
        base = request.headers.get("X-Request-Id", body.get("request_id"))
        if base is None:
            base = "%016x" % random.getrandbits(64)  # vLLM's random_uuid()
        if (sp.get("n") or 1) > MAX_NUM_SEQS:
            raise RequestError(f"sampling_params.n must be at most the server's max_num_seqs"
                               f" ({MAX_NUM_SEQS}), got {sp['n']}.")
        if sp.get("stop"):
            raise RequestError("stop strings are not supported on a --tokens-only server "
                               "because detokenization is disabled. Check stop strings on the"
                               " coordinator, or use stop_token_ids.")
        if (mode := body.get("output_mode", "tokens")) != "tokens":
            raise RequestError(f"output_mode={mode!r} requires a tokenizer, but this server "
                               "does not load one (--tokens-only or --skip-tokenizer-init). "
                               "Send the request to a server that loads a tokenizer, or use "
                               "output_mode='tokens'.")
        if not sp.get("max_tokens") and len(prompt) > self.max_model_len:
            raise RequestError(f"Input length ({len(prompt)}) exceeds model's maximum context"
                               f" length ({self.max_model_len}).")
        try:
            gen = _Generation(f"generate-tokens-{base}", self._plan(body), request,
                              fault=self.fault, fault_after=self.fault_after,
                              hold_after=self.hold_after)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RequestError(f"simulator script error: {e}", "InternalServerError", 500)
        self.running[gen.engine_id].add(gen)
        gen.cached_tokens = self.cache.cached_tokens(prompt)
        self.prompt_tokens += len(prompt)
        self.cached_prompt_tokens += gen.cached_tokens
        try:
            if self.prefill_us_per_token:  # prefill: the tokens not found in the cache, one prompt
                arrived = time.monotonic()  # at a time (one GPU's prefill throughput: a queue forms)
                async with self._prefill:
                    await asyncio.sleep((len(prompt) - gen.cached_tokens) * self.prefill_us_per_token / 1e6)
                # The modelled time to first token: the queue and the prefill, nothing of this machine's.
                self.prefill_waits.append(time.monotonic() - arrived)
            return await (self._stream if body.get("stream") else self._full)(gen, body)
        except asyncio.CancelledError:  # aiohttp cancels the handler of a lost client
            self.disconnected.append(gen.engine_id)
            raise
        finally:
            self.running[gen.engine_id].discard(gen)
            if not self.running[gen.engine_id]:
                del self.running[gen.engine_id]
            for c in gen.choices:  # the KV of what was computed stays cached
                self.cache.store(prompt + c.tokens[:c.sent])

    async def _hold(self, gen: _Generation) -> None:
        """Wait, sending nothing, until released, aborted or left by the client."""
        self.held.add(gen)
        try:
            while not (gen.released.is_set() or gen.aborted.is_set() or gen.closed()):
                try:
                    await asyncio.wait_for(gen.released.wait(), 0.05)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.held.discard(gen)

    async def release(self, request: web.Request) -> web.Response:
        """POST /sim/release: the held requests go on."""
        released = sorted(g.engine_id for g in self.held)
        for gen in self.held:
            gen.released.set()
        return web.json_response({"released": released})

    def _check_logprobs(self, k: int | None) -> None:  # SamplingParams.verify (engine side)
        if k is not None and (count := self.vocab_size if k == -1 else k) > MAX_LOGPROBS:
            raise RequestError(f"Requested sample logprobs of {count}, which is greater than "
                               f"max allowed: {MAX_LOGPROBS}", param="logprobs", value=count,
                               client=True)

    async def _full(self, gen: _Generation, body: dict) -> web.Response:
        """serve_tokens_full_generator + JSONResponse(model_dump())."""
        created, prompt = int(time.time()), body["token_ids"]
        k = body["sampling_params"].get("logprobs")
        self._check_logprobs(k)
        try:
            async for _ in self._steps(gen):
                pass
        except _Disconnected:
            self.disconnected.append(gen.engine_id)
            return web.Response(status=499)  # nobody reads it
        except _Died:
            await _drop(gen.request)
            return web.Response(status=499)  # never sent
        return self._faulty(gen.fault, _json_response({
            "request_id": gen.engine_id, "model": self.model_name, "created": created,
            "usage": self._usage(len(prompt), sum(c.sent for c in gen.choices), cached=self._cached(gen)),
            "prompt_logprobs": None, "prompt_token_id_logprobs": None,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "output_mode": "tokens",
            "choices": [self._choice(c, 0, c.sent, True, k) for c in gen.choices]}))

    def _faulty(self, fault: str | None, response: web.Response) -> web.Response:
        """A malformed-output fault applied to a non-streaming body."""
        body = response.body
        if fault in ("garbage", "truncated_json", "flood"):
            body = {"garbage": b"\x00\xff" + body, "truncated_json": body[: len(body) // 2],
                    "flood": body + b" " * FLOOD_BYTES}[fault]
        elif fault in ("unknown_output_mode", "out_of_vocab", "unknown_index"):
            data = json.loads(body)
            self._spoil(fault, data, data["choices"][0], len(data["choices"]))
            body = json.dumps(data).encode()
        else:
            return response
        return web.Response(body=body, status=response.status, content_type="application/json")

    def _spoil(self, fault: str | None, chunk: dict, choice: dict, n: int) -> None:
        """The malformed-event faults that keep the JSON valid."""
        if fault == "unknown_output_mode":
            chunk["output_mode"] = "unknown"
        elif fault == "out_of_vocab":
            choice["token_ids"] = [*choice["token_ids"], self.vocab_size + 7]
        elif fault == "unknown_index":
            choice["index"] = n  # the choices are 0..n-1

    async def _stream(self, gen: _Generation, body: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; "
                                               "charset=utf-8"})
        response.enable_chunked_encoding()
        await response.prepare(gen.request)

        async def send(data: bytes, raw: bool = False) -> None:  # one write per event (or split_writes pieces)
            frame = data if raw else b"data: " + data + b"\n\n"
            try:
                if self.split_writes == 1:
                    await response.write(frame)
                    return
                step = -(-len(frame) // self.split_writes)
                for i in range(0, len(frame), step):
                    await response.write(frame[i:i + step])
                    await asyncio.sleep(0.001)
            except ConnectionResetError as e:
                raise _Disconnected from e

        try:
            try:
                await self._stream_events(gen, body, send)
            except RequestError as e:  # vLLM: json.dumps(ErrorResponse.model_dump())
                await send(json.dumps(e.body).encode())
            if gen.hold_after == "end":
                await self._hold(gen)
                if gen.closed():
                    raise _Disconnected
            await send(b"[DONE]")
            await response.write_eof()
        except _Disconnected:
            self.disconnected.append(gen.engine_id)
        except _Died:
            await _drop(gen.request)
        return response

    async def _stream_events(self, gen: _Generation, body: dict, send) -> None:
        """serve_tokens_stream_generator: one chunk per engine output, then usage."""
        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        prompt, k = body["token_ids"], body["sampling_params"].get("logprobs")
        prompt_ids = prompt if body.get("return_token_ids") else None
        generated = [0] * len(gen.choices)
        self._check_logprobs(k)
        count = -1
        async for c, start, end, final in self._steps(gen):
            count += 1
            generated[c.index] += end - start
            chunk = {"request_id": gen.engine_id, "usage": None}
            if continuous:
                chunk["usage"] = self._usage(len(prompt), generated[c.index])
            if prompt_ids is not None:  # first chunk only; None fields are omitted
                chunk["prompt_token_ids"], prompt_ids = prompt_ids, None
            chunk["output_mode"] = "tokens"
            chunk["choices"] = [self._choice(c, start, end, final, k)]
            if count == gen.fault_after and gen.fault in MALFORMED:
                await self._send_faulty(gen.fault, chunk, len(gen.choices), send)
                continue
            await send(pydantic_core.to_json(chunk))
        if include_usage:  # dumped with exclude_none
            usage = self._usage(len(prompt), sum(generated), details=False, cached=self._cached(gen))
            await send(pydantic_core.to_json({"request_id": gen.engine_id, "usage": usage,
                                              "output_mode": "tokens", "choices": []}))

    async def _send_faulty(self, fault: str, chunk: dict, n: int, send) -> None:
        """This event, malformed as the fault says; the stream goes on afterwards."""
        data = pydantic_core.to_json(chunk)
        if fault == "garbage":  # unframed bytes, glued to the event's line
            await send(b"\x00\xff\xfe garbage \x9c", raw=True)
            await send(data)
        elif fault == "truncated_json":
            await send(data[: len(data) // 2])
        elif fault == "flood":  # one endless line
            for _ in range(FLOOD_BYTES >> 20):
                await send(b"x" * (1 << 20), raw=True)
        else:
            self._spoil(fault, chunk, chunk["choices"][0], n)
            await send(pydantic_core.to_json(chunk))

    async def abort_requests(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError as e:
            return _json_response(RequestError(f"JSON decode error: {e}", "Bad Request").body,
                                  400)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is None:
            return _json_response(RequestError("Missing 'request_ids' in request body",
                                               "Bad Request").body, 400)
        for request_id in [ids] if isinstance(ids, str) else ids:
            self.aborted.append(request_id)
            for gen in self.running.get(request_id, ()):
                gen.aborted.set()
        return web.Response(status=200)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def stats(self, request: web.Request) -> web.Response:
        """GET /sim/stats: generate requests received ever, tokens sent per running request, and
        the running requests whose writes wait (the kernel's socket buffer is full: the reader
        is not reading), the requests held by ``hold_after``, and the prompt tokens received
        ever and how many of them the prefix cache held, and (``--prefill-us-per-token``) each
        request's modelled time to first token: its wait for the prefill queue and its prefill."""
        running = {eid: sum(c.sent for g in gens for c in g.choices)
                   for eid, gens in self.running.items()}
        blocked = sorted(eid for eid, gens in self.running.items() for g in gens
                         if g.request.transport is not None and g.request.transport.get_write_buffer_size())
        held = sorted(g.engine_id for g in self.held)
        return web.json_response({"received": self.received, "running": running, "blocked": blocked,
                                  "held": held, "prompt_tokens": self.prompt_tokens,
                                  "cached_prompt_tokens": self.cached_prompt_tokens,
                                  "prefill_waits": list(self.prefill_waits)})

    async def introspect(self, request: web.Request) -> web.Response:
        """GET /sim/aborted, /sim/disconnected (engine ids), /sim/requests (bodies),
        /sim/headers (request headers of /inference/v1/generate)."""
        return web.json_response(list(getattr(self, request.match_info["what"])))

    def app(self) -> web.Application:
        app = web.Application()
        app[SIMULATOR] = self
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/inference/v1/abort_requests", self.abort_requests)
        app.router.add_get("/health", self.health)
        app.router.add_post("/sim/config", self.set_config)
        app.router.add_post("/sim/release", self.release)
        app.router.add_get("/sim/{what:aborted|disconnected|requests|headers}", self.introspect)
        app.router.add_get("/sim/stats", self.stats)
        return app


SIMULATOR = web.AppKey("simulator", Simulator)  # app[SIMULATOR] is the Simulator


def build_app(model_dir: str, mode: str = "echo", script: str | None = None,
              tokens_per_event: int | str = 1, delay: float = 0.0,
              finish_only_tail: bool = False, error_after: int | None = None,
              http_error: int | None = None, prefix_cache_blocks: int = 0,
              prefill_us_per_token: float = 0.0, prompt_tokens_details: bool = False) -> web.Application:
    return Simulator(model_dir, mode, script, tokens_per_event, delay, finish_only_tail,
                     error_after, http_error, prefix_cache_blocks, prefill_us_per_token,
                     prompt_tokens_details).app()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="folder with tokenizer.json, tokenizer_config.json, config.json")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--mode", choices=("echo", "script"), default="echo")
    parser.add_argument("--script", help="JSONL file of choices (script mode)")
    parser.add_argument("--tokens-per-event", default="1", help="int or random:SEED")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds per event")
    parser.add_argument("--finish-only-tail", action="store_true",
                        help="send finish_reason in a separate event with no tokens")
    parser.add_argument("--error-after", type=int, help="mid-stream error after N events")
    parser.add_argument("--http-error", type=int, help="answer every generate with this status")
    parser.add_argument("--prefix-cache-blocks", type=int, default=0,
                        help="model vLLM's prefix cache: an LRU of this many 16-token blocks (0: none)")
    parser.add_argument("--prefill-us-per-token", type=float, default=0.0,
                        help="before the first token, wait this long per prompt token not found in the cache "
                        "(one prompt at a time, as one GPU prefills)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="report usage.prompt_tokens_details.cached_tokens, as vllm serve with this flag")


async def _announce(args: argparse.Namespace) -> None:
    cache = f", prefix cache of {args.prefix_cache_blocks} blocks" if args.prefix_cache_blocks else ""
    logging.getLogger("derender.sim").info("simulator (%s mode%s) on http://%s:%d", args.mode, cache, args.host, args.port)


def main(args: argparse.Namespace) -> int:
    tpe = str(args.tokens_per_event)
    app = build_app(args.model, args.mode, args.script, int(tpe) if tpe.isdigit() else tpe,
                    args.delay, args.finish_only_tail, args.error_after, args.http_error,
                    args.prefix_cache_blocks, args.prefill_us_per_token, args.enable_prompt_tokens_details)
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    # One line in the log's own format, in place of aiohttp's banner ("Running on ... Press CTRL+C").
    app.on_startup.append(lambda _: _announce(args))
    web.run_app(app, host=args.host, port=args.port, access_log=None, loop=loop, backlog=4096,
                shutdown_timeout=1.0, print=None)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(main(_parser.parse_args()))
