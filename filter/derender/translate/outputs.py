"""Producer token events -> vLLM ``RequestOutput``s, as vLLM's own front end makes them.

In a coupled ``vllm serve`` the API server turns every engine step into a
``RequestOutput`` with vLLM's ``OutputProcessor``: a ``DecodeStream``
detokenizer primed with the prompt, stop-string checks that hold text back,
the stop token dropped from the text, logprobs with their decoded tokens, and
one child request per choice when ``n > 1``. The producer already ran the
engine; each of its SSE events is one engine step of one choice. So for every
event we rebuild the ``EngineCoreOutput`` the engine would have produced and
hand it to a live ``OutputProcessor`` that belongs to this HTTP stream alone.
"""

from __future__ import annotations

import time
from copy import copy
from typing import Any

import numpy as np
import tokenizers
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.engine.parallel_sampling import ParentRequest
from vllm.v1.outputs import LogprobsLists

FINISH_REASONS = {str(r): r for r in FinishReason}


class ProducerError(Exception):
    """The producer sent something the filter cannot turn into output."""


class LateCount:
    """The producer's prefix-cache hits (``num_cached_tokens``), known only from its usage event
    at the end of the stream. vLLM's generators read ``RequestOutput.num_cached_tokens`` from the
    first output, as the engine sets it after prefill, and hand it over untouched to the
    pydantic usage models that take it as an int (``__index__``) once the stream is over; so
    every output carries this one object, whose value is set when the usage arrives. Sums
    (Harmony's Responses context adds it up per output) stay late too."""

    __slots__ = ("_parts", "value")

    def __init__(self, parts: tuple = ()) -> None:
        self.value = 0
        self._parts = parts

    def __index__(self) -> int:
        if self._parts:
            return sum(int(p) for p in self._parts)
        return self.value

    __int__ = __index__

    def __add__(self, other: Any) -> LateCount:
        return LateCount((self, other))

    __radd__ = __add__

    def __repr__(self) -> str:
        return f"LateCount({int(self)})"


class ChoiceOutputs:
    """A live ``OutputProcessor`` for one generation (all ``n`` choices)."""

    def __init__(
        self,
        tokenizer: Any,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        stream: bool,
        vocab_size: int | None = None,
        cached_tokens: bool = False,
        direct: bool = False,
    ) -> None:
        # Ids the model cannot emit decode to nothing: refuse them rather than count phantom tokens.
        self.vocab_size = vocab_size or len(tokenizer)
        params = copy(params)
        # The producer already grouped tokens by stream_interval: one event is
        # one engine step here, so no second grouping.
        params.stream_interval = None
        params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        self.n = params.n
        self.num_logprobs = params.logprobs
        self.processor = OutputProcessor(tokenizer, log_stats=False)
        self.finished = [False] * self.n
        self.reasons: list[str | None] = [None] * self.n  # each choice's finish reason, as the engine gave it
        self.stopped_early = False  # a stop string ended a choice here, not at the producer
        self.cached: LateCount | None = LateCount() if cached_tokens else None
        self.child_ids: list[str] = []
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            external_req_id=request_id,
        )
        if self.n == 1:
            self.processor.add_request(request, None)
            self.child_ids.append(request_id)
        else:
            parent = ParentRequest(request)
            for index in range(self.n):
                child_id, child_params = parent.get_child_info(index)
                child = copy(request)
                child.request_id = child_id
                child.sampling_params = child_params
                self.processor.add_request(child, None, parent, index)
                self.child_ids.append(child_id)
        for child_id in self.child_ids:
            prime_with_tail(self.processor.request_states[child_id].detokenizer, prompt_token_ids)
        # The request state whose token events may skip ``process_outputs`` (``step``), if any.
        self.direct_state = self._direct_state(params) if direct else None
        self.direct_steps = 0  # events that skipped process_outputs
        self._reused: RequestOutput | None = None  # ``direct_output``'s one output

    def _direct_state(self, params: SamplingParams) -> Any:
        """The one choice's request state, when all ``OutputProcessor.process_outputs`` does for an
        event that finishes nothing is to detokenize it and make the output: one choice, delta
        outputs, one output per event, no stop strings, no logprobs of any kind."""
        state = self.processor.request_states.get(self.child_ids[0]) if self.n == 1 else None
        if state is None or state.detokenizer is None or state.logprobs_processor is None:
            return None
        if (
            self.num_logprobs is not None
            or params.prompt_logprobs is not None
            or getattr(state.detokenizer, "stop", None)  # vLLM's detokenizers with text have it
            or state.stream_interval != 1
            or state.output_kind != RequestOutputKind.DELTA
            or state.parent_req is not None
            or state.streaming_input
        ):
            return None
        return state

    @property
    def done(self) -> bool:
        return all(self.finished)

    def _checked(self, choice: dict[str, Any]) -> tuple[int, list[int], FinishReason | None] | None:
        """A producer choice event's (index, token ids, finish reason); None if that choice has
        finished already. Raises ``ProducerError`` for what no producer sends."""
        index = choice.get("index", 0)
        if not isinstance(index, int) or not 0 <= index < self.n:
            raise ProducerError(f"producer sent choice index {index!r} for n={self.n}")
        if self.finished[index]:
            return None
        token_ids = choice.get("token_ids") or []
        if not isinstance(token_ids, list) or not all(type(t) is int and 0 <= t < self.vocab_size for t in token_ids):
            raise ProducerError(f"producer sent token ids outside the vocabulary (size {self.vocab_size})")
        reason = choice.get("finish_reason")
        finish = None
        if reason is not None:
            finish = FINISH_REASONS.get(reason)
            if finish is None:
                raise ProducerError(f"producer sent unknown finish_reason {reason!r}")
            self.reasons[index] = reason
        return index, list(token_ids), finish

    def _direct(self, finish: FinishReason | None) -> Any:
        """The request state, if this event may skip ``process_outputs`` (``direct_state``, prefill over)."""
        state = self.direct_state
        return state if finish is None and state is not None and not state.is_prefilling else None

    def direct_text(self, choice: dict[str, Any]) -> tuple[str, list[int]] | None:
        """The lean chat path's step: a choice event's new text and ids, straight from the detokenizer,
        with no ``RequestOutput`` made; None, with nothing changed, unless ``step`` would skip
        ``process_outputs`` for it."""
        try:
            checked = self._checked(choice)
        except ProducerError:  # ``step`` raises it
            return None
        if checked is None:
            return None
        state = self._direct(checked[2])
        if state is None:
            return None
        self.direct_steps += 1
        ids = checked[1]
        state.detokenizer.update(ids, False)  # no stop strings: it finds none
        return state.detokenizer.get_next_output_text(False, True), ids

    def direct_output(self, choice: dict[str, Any]) -> RequestOutput | None:
        """The lean Responses path's step: a choice event's ``RequestOutput`` as ``step`` makes it for
        an event that skips ``process_outputs``, but one object for the whole stream, its completion's
        text and ids replaced each time (nothing else in it changes from event to event then: no
        logprobs, no finish, the same prompt, stats and cache count). Its reader, vLLM's Responses
        loop body, is done with it before the next event and keeps only what it copies out of it.
        None, with nothing changed, unless ``step`` would skip ``process_outputs`` for the event."""
        out = self._reused
        if out is None:
            if not self._direct_ok(choice):
                return None
            # ``step``'s direct branch: vLLM's make_request_output gives exactly one output here
            # (``direct_state``: delta outputs, stream interval 1, no parent request).
            [out] = self.step(choice)[0]
            self._reused = out
            return out
        got = self.direct_text(choice)
        if got is None:
            return None
        completion = out.outputs[0]
        completion.text, completion.token_ids = got
        return out

    def _direct_ok(self, choice: dict[str, Any]) -> bool:
        try:
            checked = self._checked(choice)
        except ProducerError:  # ``step`` raises it
            return False
        return checked is not None and self._direct(checked[2]) is not None

    def step(self, choice: dict[str, Any]) -> tuple[list[RequestOutput], bool]:
        """Apply one producer choice event.

        Returns the ``RequestOutput``s it yields and whether the producer
        request must be aborted now (every choice finished, one of them at a
        stop string the producer does not know about).
        """
        checked = self._checked(choice)
        if checked is None:
            return [], False
        index, token_ids, finish = checked
        state = self._direct(finish)
        if state is not None:
            # What process_outputs does for this event: the detokenizer's update (no stop strings:
            # it finds none), then vLLM's own output of the request state (no stats, no logprobs).
            self.direct_steps += 1
            state.detokenizer.update(token_ids, False)
            out = state.make_request_output(token_ids, None, None, None)
            if out is None:
                return [], False
            if self.cached is not None:
                out.num_cached_tokens = self.cached
            return [out], False
        logprobs = choice.get("logprobs")
        output = EngineCoreOutput(
            request_id=self.child_ids[index],
            new_token_ids=token_ids,
            new_logprobs=self._logprobs(logprobs, token_ids) if self.num_logprobs is not None and token_ids else None,
            finish_reason=finish,
            stop_reason=choice.get("stop_reason"),
        )
        result = self.processor.process_outputs([output])
        if self.cached is not None:
            for out in result.request_outputs:
                out.num_cached_tokens = self.cached  # type: ignore[assignment]  # LateCount: an int once read
        if finish is not None or output.request_id not in self.processor.request_states:
            self.finished[index] = True
        # A stop string ended a choice the producer is still generating. vLLM's engine
        # aborts just that child; the producer can only abort the whole request, which
        # would cut the other choices: abort once every choice has finished.
        self.stopped_early |= bool(result.reqs_to_abort)
        return result.request_outputs, self.stopped_early and self.done  # type: ignore[return-value]  # generate: RequestOutputs

    def _logprobs(self, logprobs: dict[str, Any] | None, token_ids: list[int]) -> LogprobsLists:
        """The engine's per-position rows: sampled token first, then top-k by rank."""
        content = (logprobs or {}).get("content") or []
        if len(content) != len(token_ids):
            raise ProducerError(f"producer sent {len(content)} logprob entries for {len(token_ids)} tokens")
        k = self.num_logprobs or 0  # set: logprobs were asked for
        rows_ids, rows_lps, ranks = [], [], []
        for entry in content:
            tops = entry.get("top_logprobs") or []
            ranked = sorted(
                (t for t in tops if t.get("rank") is not None and (k < 0 or t["rank"] <= k)),
                key=lambda t: t["rank"],
            )
            rows_ids.append([entry["token_id"]] + [t["token_id"] for t in ranked])
            rows_lps.append([entry["logprob"]] + [t["logprob"] for t in ranked])
            ranks.append(entry.get("rank") or 0)
        ranks_np = np.array(ranks, dtype=np.int64)
        if len({len(r) for r in rows_ids}) > 1:
            # Older producers (vLLM 0.32) cut each row to k candidates, sampled token
            # first, so rows can differ in width: keep them ragged, one array per row.
            return LogprobsLists(
                [np.array(r, dtype=np.int64) for r in rows_ids],  # type: ignore[arg-type]
                [np.array(r, dtype=np.float32) for r in rows_lps],  # type: ignore[arg-type]
                ranks_np,
            )
        ids = np.array(rows_ids, dtype=np.int64).reshape(len(rows_ids), -1)
        lps = np.array(rows_lps, dtype=np.float32).reshape(len(rows_ids), -1)
        return LogprobsLists(ids, lps, ranks_np)


# Prompt tokens a detokenizer is primed with: plenty for UTF-8 to resynchronize.
PRIMING_TAIL = 32


def prime_with_tail(detokenizer: Any, prompt_token_ids: list[int]) -> None:
    """Prime vLLM's ``DecodeStream`` with the prompt's tail instead of the whole prompt.

    vLLM primes it with every prompt token, and its first step decodes the whole
    prompt twice (~12 ms at 30k tokens, on the way to the first token). After
    that first step the prompt is gone from its state: the prompt only decides
    the first text, as the bytes the first output token's decode follows. A
    byte-level decoder turns ids into bytes, then bytes into text with
    replacement characters, and UTF-8 resynchronizes at any byte below 0x80; so
    once the tail holds such a byte (a decoded ASCII character), tail and prompt
    give the same text from there on and every step the same output. A tail that
    ends in a cut character (the replacement character) or any other decoder
    keeps vLLM's priming.
    """
    if not isinstance(detokenizer, FastIncrementalDetokenizer) or len(prompt_token_ids) <= PRIMING_TAIL:
        return
    tokenizer = detokenizer.tokenizer
    if not isinstance(tokenizer.decoder, tokenizers.decoders.ByteLevel):
        return
    tail = prompt_token_ids[-PRIMING_TAIL:]
    text = tokenizer.decode(tail, skip_special_tokens=detokenizer.skip_special_tokens)
    if text.endswith("\ufffd") or not any(c < "\x80" for c in text):
        return
    detokenizer.stream = tokenizers.decoders.DecodeStream(ids=tail, skip_special_tokens=detokenizer.skip_special_tokens)
