"""The producer decoder: the producer's token events -> each choice's ``RequestOutput``s.

One ``ProducerDecoder`` per generation, whatever the client's API and whether it is streamed: the
events step its ``ChoiceOutputs`` (detokenizer, stop strings, logprobs per choice), and it keeps what
the events say of the whole generation (the producer's request id, the tokens so far, its usage).
Each API's encoder (``stream.ChatStream`` and its kin for streams, ``collect.Collected`` for one JSON
answer) is composed with one and turns its outputs into the client's bytes.
"""

from __future__ import annotations

from typing import Any

from .events import LENGTH_CUT, cached_tokens, producer_error_event, step_event
from .outputs import ChoiceOutputs, ProducerError


class ProducerDecoder:
    """One generation's producer events, decoded."""

    __slots__ = ("cached", "outputs", "request_id", "tokens", "usage_seen")

    def __init__(self, outputs: ChoiceOutputs) -> None:
        self.outputs = outputs
        self.request_id: str | None = None  # the producer's (generate-tokens-...), from its first event
        self.tokens = 0  # completion tokens so far, every choice
        self.cached: int | None = None  # the prompt tokens the producer found in its prefix cache, as its usage says
        self.usage_seen = False  # the producer's final usage event came

    def event(self, event: Any) -> tuple[list[Any], bool]:
        """One parsed producer event -> (its ``RequestOutput``s, abort the producer now?).

        Raises ``HTTPError`` for the producer's own error event (its code as the status),
        ``ProducerError`` (or ``ValueError``, ``KeyError``, ...) for an event the filter cannot use."""
        if not isinstance(event, dict):
            raise ProducerError("producer event is not a JSON object")
        if "error" in event:
            raise producer_error_event(event["error"])
        if event.get("usage") and not event.get("choices"):  # the producer's final usage event
            self.usage(cached_tokens(event))
        outs, abort, tokens = step_event(self.outputs, event)
        if self.request_id is None:
            self.request_id = event.get("request_id")
        self.tokens += tokens
        return outs, abort

    def direct(self, event: dict[str, Any]) -> tuple[str, list[int]] | None:
        """A middle event of one choice that only needs detokenizing (``ChoiceOutputs.direct_text``):
        its new text and ids, counted; None (nothing changed) for any other event."""
        got = self.outputs.direct_text(event["choices"][0])
        if got is not None:  # ``took``, inlined: once per token
            if self.request_id is None:
                self.request_id = event.get("request_id")
            self.tokens += len(got[1])
        return got

    def took(self, event: dict[str, Any], tokens: int) -> None:
        """An event an encoder stepped itself (a lean path's middle event) carried ``tokens``."""
        if self.request_id is None:
            self.request_id = event.get("request_id")
        self.tokens += tokens

    def usage(self, cached: int | None) -> None:
        """The producer's final usage came, saying ``cached`` prompt tokens were in its prefix cache."""
        self.cached = cached
        self.usage_seen = True
        if self.outputs.cached is not None:
            self.outputs.cached.value = cached or 0

    def cut(self) -> list[Any]:
        """Every unfinished choice ends here, as the engine ends one at ``max_tokens`` (``length``):
        their last outputs. (A key's budget ran out.)"""
        outs: list[Any] = []
        for index, done in enumerate(self.outputs.finished):
            if not done:
                outs += self.outputs.step(LENGTH_CUT | {"index": index})[0]
        return outs

    @property
    def ended(self) -> bool:
        """Every choice finished, and the producer's usage came where its cache hits are passed on."""
        return self.outputs.done and (self.outputs.cached is None or self.usage_seen)


class Decoded:
    """The base of an encoder composed with a producer decoder (``decoder``): what the exchange reads
    of the generation through it."""

    decoder: ProducerDecoder

    @property
    def completion_tokens(self) -> int:
        return self.decoder.tokens

    @property
    def producer_request_id(self) -> str | None:
        return self.decoder.request_id
