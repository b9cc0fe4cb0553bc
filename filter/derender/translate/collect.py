"""A non-streaming answer with stop strings, collected from a streamed producer response.

The producer does not know the stop strings (the filter holds them, see
``render``). Asked for one JSON answer, it would generate up to ``max_tokens``
before the filter could cut the text at the stop string: GPU time, and a
client waiting for an answer that ended long before. So such a request is
streamed from the producer (``render.producer_body``); its events go, one
engine step at a time as in vLLM's engine, into the same output state as a
non-streaming answer's; once every choice has finished (at a stop string or
at the producer) the producer request is aborted and the client gets the one
JSON object vLLM would send. A request under a key's token budget that may outrun what it
reserved is collected the same way (``Rendered.metered``), so that the budget can end it
(``events``' token limit, ``cut``). Its status went out with the producer's headers
(200): an error that comes mid-stream reaches the client as an OpenAI error
object with that status.
"""

from __future__ import annotations

import json
from typing import Any

from .decode import Decoded, ProducerDecoder
from .errors import HTTPError
from .events import has_tokens
from .model import Model
from .outputs import ProducerError
from .render import Rendered
from .sse import SSEDecoder, SSEError
from .stream import choice_outputs


class Collected(Decoded):
    """Producer SSE events -> the generation's final ``RequestOutput`` (``final``): the producer decoder
    (``decode.ProducerDecoder``) whose outputs are kept until the last, for the one JSON answer."""

    def __init__(self, model: Model, rendered: Rendered) -> None:
        self.decoder = ProducerDecoder(choice_outputs(model, rendered, stream=False))
        self.outputs = self.decoder.outputs
        self.final: Any = None
        self.finished = False  # the client's answer was produced (the final JSON or an error)
        self.whole = False  # that answer was the final JSON
        self._sse = SSEDecoder()

    def payloads(self, chunk: bytes, end: bool) -> list[bytes]:
        """One body chunk's events.

        Raises ``HTTPError`` 502 for a stream the filter cannot use (the events before the fault
        taken first)."""
        try:
            return self._sse.feed(chunk) + (self._sse.close() if end else [])
        except SSEError as exc:
            for payload in exc.payloads:
                self._event(payload)
            raise HTTPError(502, f"invalid producer stream: {exc}") from None

    def events(self, payloads: list[bytes], token_limit: int | None = None) -> tuple[bool, list[bytes] | None]:
        """The producer's events: (True if the producer must be aborted now, a stop string having
        ended the generation; the events from the first that carries tokens past ``token_limit``
        completion tokens, not taken (a key's budget decides: ``ops.quota``), or None).

        Raises ``HTTPError``: 502 for an event the filter cannot use, the producer's own status for
        an error event."""
        abort = False
        for k, payload in enumerate(payloads):
            if self.outputs.done:
                break
            if token_limit is not None and self.completion_tokens >= token_limit and has_tokens(payload):
                return abort, payloads[k:]
            abort |= self._event(payload)
        return abort, None

    def cut(self) -> None:
        """End every unfinished choice here, as the engine ends one at ``max_tokens`` (``length``)."""
        finals = self.decoder.cut()
        if finals:
            self.final = finals[-1]

    def _event(self, payload: bytes) -> bool:
        if payload == b"[DONE]" or self.outputs.done:
            return False
        try:
            finals, abort = self.decoder.event(json.loads(payload))  # HTTPError for the producer's error event
            if finals:
                self.final = finals[-1]
        except (ProducerError, ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
            raise HTTPError(502, f"invalid producer event: {exc}") from None
        return abort

    def close(self) -> None:
        """Nothing runs between events: nothing to shut."""
        self.finished = True
