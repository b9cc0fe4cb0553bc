"""The simulator's HTTP handlers: generate (streamed or whole, with faults), abort, health, knobs, stats."""

from __future__ import annotations

import asyncio
import json
import random
import time
from contextlib import nullcontext
from http import HTTPStatus
from typing import Any, cast

import pydantic_core
from aiohttp import web

from .generation import _Died, _Disconnected, _drop, _Generation
from .kvevents import media_of
from .state import SimulatorState
from .wire import (
    _ERROR_TYPES,
    FLOOD_BYTES,
    MALFORMED,
    MAX_LOGPROBS,
    MAX_NUM_SEQS,
    RequestError,
    _check_body,
    _err,
    _json_response,
    _validation_error,
    check_features,
)


class Serving(SimulatorState):
    """The handlers of ``Simulator`` (``simulator.Simulator``), which holds the state they use."""

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.received += 1
        # Every value of a header: a repeated one (say the client's copy beside the filter's) shows as "a | b".
        self.headers.append({k: " | ".join(request.headers.getall(k)) for k in request.headers})
        body, bad_json = None, None
        try:
            if raw:
                self.requests.append(body := json.loads(raw))
                self.numbered.append([self.received, body])
        except ValueError as e:
            bad_json = e
        try:
            if (code := self.http_error) is not None:
                raise RequestError(
                    f"simulated HTTP {code} error", _ERROR_TYPES.get(code, HTTPStatus(code).phrase), code
                )
            if request.content_type != "application/json":
                raise RequestError(
                    "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                    "Bad Request",
                    400,
                )
            if bad_json is not None:
                raise _validation_error(
                    [
                        _err(
                            "json_invalid",
                            f"body.{getattr(bad_json, 'pos', 0)}",
                            "JSON decode error",
                            {},
                            error=getattr(bad_json, "msg", str(bad_json)),
                        )
                    ]
                )
            if body is None:
                raise _validation_error([_err("missing", "body", "Field required", None)])
            _check_body(body)
            check_features(body)
            return await self._serve(request, body)
        except RequestError as e:
            return _json_response(e.body, e.code)

    async def _serve(self, request: web.Request, body: dict) -> web.StreamResponse:
        sp, prompt = body["sampling_params"], body["token_ids"]
        base = request.headers.get("X-Request-Id", body.get("request_id"))
        if base is None:
            base = f"{random.getrandbits(64):016x}"  # vLLM's random_uuid()
        if (sp.get("n") or 1) > MAX_NUM_SEQS:
            raise RequestError(
                f"sampling_params.n must be at most the server's max_num_seqs ({MAX_NUM_SEQS}), got {sp['n']}."
            )
        if sp.get("stop"):
            raise RequestError(
                "stop strings are not supported on a --tokens-only server "
                "because detokenization is disabled. Check stop strings on the"
                " coordinator, or use stop_token_ids."
            )
        if (mode := body.get("output_mode", "tokens")) != "tokens":
            raise RequestError(
                f"output_mode={mode!r} requires a tokenizer, but this server "
                "does not load one (--tokens-only or --skip-tokenizer-init). "
                "Send the request to a server that loads a tokenizer, or use "
                "output_mode='tokens'."
            )
        if not sp.get("max_tokens") and len(prompt) > self.max_model_len:
            raise RequestError(
                f"Input length ({len(prompt)}) exceeds model's maximum context length ({self.max_model_len})."
            )
        try:
            gen = _Generation(
                f"generate-tokens-{base}",
                self._plan(body),
                request,
                fault=self.fault,
                fault_after=self.fault_after,
                hold_after=self.hold_after,
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RequestError(f"simulator script error: {e}", "InternalServerError", 500) from None
        self.running[gen.engine_id].add(gen)
        try:
            async with self.scheduler.slot(len(gen.choices)):  # --max-num-seqs: it may wait its turn
                return await self._run(gen, body)
        finally:
            self.running[gen.engine_id].discard(gen)
            if not self.running[gen.engine_id]:
                del self.running[gen.engine_id]

    async def _run(self, gen: _Generation, body: dict) -> web.StreamResponse:
        """A scheduled request: its prefill (the prompt's blocks then cached), then its answer."""
        prompt = body["token_ids"]
        salt, media, lora = body.get("cache_salt"), media_of(body), self.loras.get(body.get("model") or "")
        gen.cached_tokens = self.cache.cached_tokens(prompt, salt, media, lora)
        self.prompt_tokens += len(prompt)
        self.cached_prompt_tokens += gen.cached_tokens
        try:
            pulled = await self.handoff.pulled(body)  # a decode whose KV a prefill producer computed
            missing = len(prompt) - gen.cached_tokens
            if pulled:  # the transfer of the blocks not cached here: the request waits for them, no step slowed
                await asyncio.sleep(missing * self.kv_transfer_us_per_token / 1e6)
            elif self.engine is not None and self.prefill_us_per_token:  # chunks inside the decode steps
                arrived = time.monotonic()
                await self.engine.prefill(missing, self.delay)
                gen.prefilled = missing > 0
                self.prefill_waits.append(time.monotonic() - arrived)
            elif self.prefill_us_per_token:  # prefill: the tokens not found in the cache, one
                arrived = time.monotonic()  # prompt at a time (one GPU's prefill throughput: a queue forms)
                async with self._prefill:
                    await asyncio.sleep(missing * self.prefill_us_per_token / 1e6)
                # The modelled time to first token: the queue and the prefill, nothing of this machine's.
                self.prefill_waits.append(time.monotonic() - arrived)
            self.cache.store(prompt, salt, media, lora)  # prefilled: the prompt's blocks are cached (and published)
            answer = self._stream if body.get("stream") else self._full
            # --max-num-batched-tokens: its tokens take room in every step's budget while it decodes.
            with self.engine.running(len(gen.choices)) if self.engine is not None else nullcontext():
                return await answer(gen, body)
        except asyncio.CancelledError:  # aiohttp cancels the handler of a lost client
            self.disconnected.append(gen.engine_id)
            raise
        finally:
            for c in gen.choices:  # the KV of what was computed stays cached
                self.cache.store(prompt + c.tokens[: c.sent], salt, media, lora)

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
            raise RequestError(
                f"Requested sample logprobs of {count}, which is greater than max allowed: {MAX_LOGPROBS}",
                param="logprobs",
                value=count,
                client=True,
            )

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
        return self._faulty(
            gen.fault,
            _json_response(
                {
                    "request_id": gen.engine_id,
                    "model": self.model_name,
                    "created": created,
                    "usage": self._usage(len(prompt), sum(c.sent for c in gen.choices), cached=self._cached(gen)),
                    "prompt_logprobs": None,
                    "prompt_token_id_logprobs": None,
                    "prompt_token_ids": prompt if body.get("return_token_ids") else None,
                    "mm_placeholders": None,
                    "metrics": None,
                    "kv_transfer_params": self._kv_transfer(body, gen),
                    "ec_transfer_params": None,
                    "output_mode": "tokens",
                    "choices": [self._choice(c, 0, c.sent, True, k) for c in gen.choices],
                }
            ),
        )

    def _kv_transfer(self, body: dict, gen: _Generation) -> dict | None:
        """A prefill producer's answer to ``kv_transfer_params: {"do_remote_decode": true}`` (``handoff``)."""
        return self.handoff.answer(body, gen.engine_id)

    def _faulty(self, fault: str | None, response: web.Response) -> web.Response:
        """A malformed-output fault applied to a non-streaming body."""
        body = cast(bytes, response.body)
        if fault in ("garbage", "truncated_json", "flood"):
            body = {
                "garbage": b"\x00\xff" + body,
                "truncated_json": body[: len(body) // 2],
                "flood": body + b" " * FLOOD_BYTES,
            }[fault]
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
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
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
                    await response.write(frame[i : i + step])
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
            chunk: dict[str, Any] = {"request_id": gen.engine_id, "usage": None}
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
            await send(
                pydantic_core.to_json(
                    {"request_id": gen.engine_id, "usage": usage, "output_mode": "tokens", "choices": []}
                )
            )

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
            return _json_response(RequestError(f"JSON decode error: {e}", "Bad Request").body, 400)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids is None:
            return _json_response(RequestError("Missing 'request_ids' in request body", "Bad Request").body, 400)
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
        running = {eid: sum(c.sent for g in gens for c in g.choices) for eid, gens in self.running.items()}
        blocked = sorted(
            eid
            for eid, gens in self.running.items()
            for g in gens
            if g.request.transport is not None and g.request.transport.get_write_buffer_size()
        )
        held = sorted(g.engine_id for g in self.held)
        return web.json_response(
            {
                "received": self.received,
                "running": running,
                "blocked": blocked,
                "held": held,
                "prompt_tokens": self.prompt_tokens,
                "cached_prompt_tokens": self.cached_prompt_tokens,
                "prefill_waits": list(self.prefill_waits),
                "kv_event_batches": self.cache.events.published if self.cache.events is not None else 0,
                "scheduler": self.scheduler.stats(),
                "kv_handoff": self.handoff.stats(),
                "engine": self.engine.stats() if self.engine is not None else None,
            }
        )

    async def introspect(self, request: web.Request) -> web.Response:
        """GET /sim/aborted, /sim/disconnected (engine ids), /sim/requests (bodies), /sim/numbered
        ([its arrival number, body]), /sim/headers (request headers of /inference/v1/generate)."""
        return web.json_response(list(getattr(self, request.match_info["what"])))
