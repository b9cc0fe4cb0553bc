"""The simulator's state and plan: knobs, prefix cache, what each choice answers and when."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

from aiohttp import web
from tokenizers import Tokenizer

from .cache import PrefixCache
from .engine import Engine
from .generation import StepClock, _Choice, _Died, _Disconnected, _Generation, _stream_interval
from .handoff import KvHandoff
from .kvevents import KvEvents
from .scheduler import Scheduler
from .serving import Serving
from .wire import _TURNS, FAULTS, RequestError, _json_response, preload_features_decoder


class Simulator(Serving):
    def __init__(
        self,
        model_dir: str,
        mode: str = "echo",
        script: str | None = None,
        tokens_per_event: int | str = 1,
        delay: float = 0.0,
        finish_only_tail: bool = False,
        error_after: int | None = None,
        http_error: int | None = None,
        prefix_cache_blocks: int = 0,
        prefill_us_per_token: float = 0.0,
        prompt_tokens_details: bool = False,
        lockstep: bool = False,
        kv_events_config: str | None = None,
        block_size: int = 16,
        prefix_caching_hash_algo: str = "sha256",
        lora_modules: list[str] | tuple[str, ...] = (),
        max_num_seqs: int = 0,
        kv_role: str = "both",
        address: tuple[str, int] = ("127.0.0.1", 0),
        max_num_batched_tokens: int = 0,
        kv_transfer_us_per_token: float = 0.0,
    ):
        if mode not in ("echo", "script") or (mode == "script" and not script):
            raise ValueError("mode must be 'echo' or 'script' (script needs a JSONL file)")
        folder = Path(model_dir).expanduser()
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "config.json").read_text())
        if "vision_config" in config:  # a VLM: vLLM's features decoder, loaded now rather than on a first image
            preload_features_decoder()
        eos = config.get("eos_token_id")
        if eos is None:
            name = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
            eos = self.tokenizer.token_to_id(name["content"] if isinstance(name, dict) else name)
        self.eos = eos[0] if isinstance(eos, list) else eos
        self.vocab_size = config.get("vocab_size") or self.tokenizer.get_vocab_size()
        self.max_model_len = config.get("max_position_embeddings", 2048)
        self.model_name = model_dir  # what `vllm serve DIR` reports
        self.configure(
            mode=mode,
            script=script,
            tokens_per_event=tokens_per_event,
            delay=delay,
            finish_only_tail=finish_only_tail,
            error_after=error_after,
            http_error=http_error,
            split_writes=1,
            lockstep=lockstep,
        )
        self.clock = StepClock()
        self.requests: collections.deque = collections.deque(maxlen=50)
        self.numbered: collections.deque = collections.deque(maxlen=400)  # [arrival number, body]
        self.headers: collections.deque = collections.deque(maxlen=50)  # of generate requests
        self.received = 0  # generate requests, ever
        self.prompt_tokens = 0  # of those requests, ever
        self.prefill_waits: collections.deque[float] = collections.deque(maxlen=100_000)  # seconds, see below
        self.cached_prompt_tokens = 0  # of those, found in the prefix cache
        self.aborted: list[str] = []
        self.disconnected: list[str] = []
        self.running: dict[str, set[_Generation]] = collections.defaultdict(set)
        self.held: set[_Generation] = set()
        self.hold_after: int | str | None = None
        events = KvEvents(kv_events_config, block_size, prefix_caching_hash_algo) if kv_events_config else None
        self.cache = PrefixCache(prefix_cache_blocks, block_size, events)
        # --lora-modules NAME=PATH: a request naming an adapter is cached apart, as vLLM keys it (its
        # name and path, vLLM's id counting from 1 in the order given).
        self.loras: dict[str, tuple[str, str, int]] = {}
        for i, item in enumerate(lora_modules):
            name, _, path = item.partition("=")
            if not name or not path:
                raise ValueError(f"--lora-modules takes NAME=PATH, not {item!r}")
            self.loras[name] = (name, path, i + 1)
        self.prefill_us_per_token = prefill_us_per_token
        self.scheduler = Scheduler(max_num_seqs)
        self.handoff = KvHandoff(kv_role, *address, block_size=self.cache.block_size)
        self._prefill = asyncio.Lock()
        # --max-num-batched-tokens: prefill in chunks inside the decode steps (engine.py), slowing them.
        self.engine = Engine(max_num_batched_tokens, prefill_us_per_token) if max_num_batched_tokens else None
        self.kv_transfer_us_per_token = kv_transfer_us_per_token
        self.prompt_tokens_details = prompt_tokens_details

    def configure(
        self,
        mode: str | None = None,
        script: str | None = None,
        tokens_per_event: int | str | None = None,
        delay: float | None = None,
        finish_only_tail: bool | None = None,
        error_after: int | None = None,
        http_error: int | None = None,
        split_writes: int | None = None,
        fault: str | None = None,
        fault_after: int | None = None,
        hold_after: int | str | None = None,
        lockstep: bool | None = None,
    ) -> None:
        """Set the knobs for the requests that follow (also POST /sim/config).

        ``error_after``, ``http_error``, ``fault`` (at event ``fault_after``, see
        FAULTS) and ``hold_after`` are set as given (None turns them off); the other
        knobs keep their value when None. ``split_writes`` > 1 writes each event in
        that many pieces, so events cross TCP writes. ``lockstep``: the ``delay`` between
        events is one engine step of a clock every request shares (``StepClock``), not each
        request's own timer. ``hold_after`` N: a request
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
        if lockstep is not None:
            self.lockstep = bool(lockstep)
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

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """POST /reset_prefix_cache, vLLM's (``VLLM_SERVER_DEV_MODE=1``): the prefix cache emptied and
        ``AllBlocksCleared`` published. vLLM refuses (``success: false``) while running requests hold
        blocks unless asked to reset them; the model holds no blocks for running requests, so it always
        succeeds."""
        self.cache.reset()
        return _json_response({"success": True})

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
        return [*self.tokenizer.encode(found, add_special_tokens=False).ids, self.eos]

    def _logprobs(self, tok: int, pos: int, index: int, k: int, given: dict | None) -> dict:
        """The engine's {token_id: (logprob, rank)} at one position: the sampled token
        first, then the top k (a sampled token inside the top k appears once)."""
        if given is None:  # deterministic fake: every third token was the rank-2 one
            rank = 2 if pos % 3 == 2 else 1

            def value(r: int) -> float:
                return -round(0.05 + 0.5 * (r - 1) + 0.01 * ((pos + index) % 5), 4)

            top = [(tok if r == rank else (tok + r) % self.vocab_size, value(r)) for r in range(1, k + 1)]
            sampled = value(rank)
        else:
            top = [(int(t), float(lp)) for t, lp in given.get("top", [])]
            sampled, ids = float(given["logprob"]), [t for t, _ in top]
            rank = given.get("rank") or (ids.index(tok) + 1 if tok in ids else 1 + sum(lp > sampled for _, lp in top))
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
            line: dict[str, Any] = lines.get(index) or next(iter(lines.values()))
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
                sizes = [
                    sum(sizes[a:b])
                    for a, b in zip([0, *itertools.accumulate(steps)], itertools.accumulate(steps), strict=False)
                ]
            given = line.get("logprobs") or []
            logprobs = (
                None
                if k is None
                else [
                    self._logprobs(t, p, index, k, given[p] if p < len(given) else None) for p, t in enumerate(tokens)
                ]
            )
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
            events = [(c, end - size, end, False, w) for size, end, w in zip(c.sizes, ends, waits, strict=False)]
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
            if self.delay > 0 and self.engine is not None:
                if not (count == 0 and gen.prefilled):  # a prefill's last step samples the first token
                    await self.engine.step(wait, self.delay)  # the step's prefill chunks stretch it
            elif self.delay > 0 and self.lockstep:
                await self.clock.wait(wait, self.delay)  # an abort is seen at the step
            elif self.delay > 0:
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
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
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

        logprobs = (
            None
            if k is None
            else {
                "content": [
                    {**entry(tok, *lps[tok]), "top_logprobs": [entry(t, *v) for t, v in lps.items()]}
                    for tok, lps in zip(c.tokens[start:end], (c.logprobs or [])[start:end], strict=False)
                ]
            }
        )
        return {
            "index": c.index,
            "finish_reason": c.finish if final else None,
            "stop_reason": c.stop_reason if final else None,
            "token_ids": c.tokens[start:end],
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": None,
            "logprobs": logprobs,
        }

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: vLLM's scheduler gauges (``Scheduler.metrics``)."""
        cache = self.cache
        text = self.scheduler.metrics(
            self.model_name, lambda: len(cache.blocks) / cache.capacity if cache.capacity else 0.0
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)  # vLLM's server sets no body limit (images' tensors)
        app[SIMULATOR] = self
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/inference/v1/abort_requests", self.abort_requests)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/sim/kv/{request_id}", self.handoff.take)
        app.on_cleanup.append(lambda _: self.handoff.close())
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/sim/config", self.set_config)
        app.router.add_post("/sim/release", self.release)
        app.router.add_get("/sim/{what:aborted|disconnected|requests|numbered|headers}", self.introspect)
        app.router.add_get("/sim/stats", self.stats)
        return app


SIMULATOR = web.AppKey("simulator", Simulator)  # app[SIMULATOR] is the Simulator
