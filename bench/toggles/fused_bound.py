"""A toggle for ``bench/inproc_ab.py``: what a fused per-token path in Python could cost at least.

    .venv/bin/python bench/inproc_ab.py --api chat --toggle bench/toggles/fused_bound.py --evict-mb 64

``on()`` replaces ``ModelExchange.response_chunk`` (the servicer's call for each response body chunk)
for a stream's middle events, from its third on: one producer event in the chunk, its JSON read
by the filter's own loader, its token ids stepped through a ``tokenizers`` ``DecodeStream``, and the
new text written into a chunk template as reasoning text. No parser, no detokenizer wrapper, no
exchange layers: the least Python a token could take through this servicer. Its output is wrong on
purpose (no reasoning split, no tool calls, the parsers' state left behind); what it measures
(setting B against A) is the floor under any fused path that keeps the servicer and the transport.
The first two events and any event that finishes, carries no token ids or shares its chunk go to
vLLM's path. ``off()`` puts the method back.
"""

from __future__ import annotations

import json
from typing import Any

_ORIGINAL: Any = None
_TOKENIZER: Any = None
_TAIL = b'"},"logprobs":null,"finish_reason":null}]}\n\n'


def _tokenizer() -> Any:
    global _TOKENIZER
    if _TOKENIZER is None:
        from derender.ops import assets
        from tokenizers import Tokenizer

        _TOKENIZER = Tokenizer.from_file(str(assets.fetch("qwen3", quiet=True) / "tokenizer.json"))
    return _TOKENIZER


async def _stand_in(self: Any, chunk: bytes, end: bool) -> bytes:
    from derender.translate import eventjson
    from tokenizers.decoders import DecodeStream

    state = self.__dict__.get("_fused")  # [events seen, DecodeStream, chunk head], on the exchange itself
    if state is None:
        state = self._fused = [0, DecodeStream(skip_special_tokens=True),
                                    b'data: {"id":"chatcmpl-%d","object":"chat.completion.chunk","created":1,'
                                    b'"model":"qwen3","choices":[{"index":0,"delta":{"reasoning":"' % id(self)]
    state[0] += 1
    if end or state[0] < 3 or not chunk.startswith(b"data: {") or chunk.count(b"\n\n") != 1:
        return await _ORIGINAL(self, chunk, end)
    event = eventjson.loads(chunk[6:-2])
    choice = event["choices"][0]
    ids = choice.get("token_ids")
    if not ids or choice.get("finish_reason") is not None:
        return await _ORIGINAL(self, chunk, end)
    tokenizer, stream = _tokenizer(), state[1]
    text = "".join(piece for piece in (stream.step(tokenizer, i) for i in ids) if piece)
    return state[2] + json.dumps(text, ensure_ascii=False)[1:-1].encode() + _TAIL


def on() -> None:
    global _ORIGINAL
    from derender.endpoints.router import ModelExchange

    if _ORIGINAL is None:
        _ORIGINAL = ModelExchange.response_chunk
    _tokenizer()
    ModelExchange.response_chunk = _stand_in  # type: ignore[method-assign]


def off() -> None:
    from derender.endpoints.router import ModelExchange

    if _ORIGINAL is not None:
        ModelExchange.response_chunk = _ORIGINAL  # type: ignore[method-assign]
