"""Repeated prompt prefixes tokenized once per worker: an agent's system prompt and tool list, and
the conversation so far, are not tokenized again on every turn.

An agent's request repeats the previous one and adds a turn: the rendered prompt text shares a long
prefix with the last one (Claude Code's system prompt and tools are some 60 KB). Tokenizing it costs
the most of a long prompt's render on the worker. The text is cut where the chat template opens a
turn, just before an added token such as ``<|im_start|>``: a fast tokenizer splits its input on
such tokens before anything else (normalizing, pre-tokenizing and BPE run on each piece on its
own), so the ids of the pieces, joined, are the ids of the whole. Each piece's ids are held under
the hash of the text up to its end (BLAKE2b, chained piece by piece); a prompt takes the held ids of
its longest known prefix and tokenizes only the pieces after it.

Which tokens may cut: added tokens (special or not: the tokenizer splits on all of them) matched on
the text as it is (not normalized, or the normalizer does nothing), that take no whitespace beside
them (no ``lstrip`` / ``rstrip`` / ``single_word``) and that no other added token's match could
cover the place before them, on a tokenizer ``longprompt.splittable`` accepts
(BPE, no prefix space, known normalizers). Anything else keeps vLLM's path. Held ids are bounded
(``BUDGET_IDS``), the least recently used dropped first. ``tests/test_prefix_memo.py`` demands the
tokenizer's own ids for generated conversations on every tokenizer shipped.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from . import vllm_seams

MIN_CHARS = 500  # shorter prompts are tokenized whole, as vLLM does
BUDGET_IDS = 4_000_000  # ids held per worker (16 MiB), the least recently used dropped first
ENTRY_IDS = 32  # what a held piece costs beside its ids (its key, its array), counted as ids


def boundaries(tokenizer: Any) -> list[str]:
    """The special added tokens a prompt may be cut before (see the module doc); [] if none."""
    backend = vllm_seams.raw_tokenizer(tokenizer)
    if not hasattr(backend, "to_str") or getattr(tokenizer, "split_special_tokens", False):
        return []  # not a fast tokenizer, or one told to read special tokens' text as text
    spec = json.loads(backend.to_str())
    added = spec.get("added_tokens") or ()
    contents = [token.get("content") or "" for token in added]
    normalizer = spec.get("normalizer")
    identity = normalizer is None or (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers"))
    # A match of another added token could cover the place before a marker if it holds the marker
    # past its own start, or ends with what the marker begins with (the tokenizer takes the leftmost).
    tails = "\x00".join(content[1:] for content in contents)
    suffixes = {content[j:] for content in contents for j in range(1, len(content))}
    return [
        token["content"]
        for token in added
        if token.get("content")
        and (identity or not token.get("normalized"))
        and not (token.get("lstrip") or token.get("rstrip") or token.get("single_word"))
        and token["content"] not in tails
        and not any(token["content"][:k] in suffixes for k in range(1, len(token["content"])))
    ]


class PrefixMemo:
    """The ids of prompts' pieces, under the chained hash of the text up to each piece's end."""

    def __init__(self, markers: list[str], encode_pieces: Callable[[list[str]], list[list[int]]]) -> None:
        alternatives = "|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True))
        self._cut = re.compile(f"(?=(?:{alternatives}))")
        self._encode_pieces = encode_pieces
        self._held: OrderedDict[bytes, array] = OrderedDict()
        self._lock = threading.Lock()
        self.held_ids = 0
        self.hits = 0  # prompts that found a held prefix
        self.reused_ids = 0  # ids taken from held pieces instead of tokenized
        # Told each prompt's ids taken from memory and ids tokenized (the worker's metrics).
        self.observe: Callable[[int, int], None] | None = None

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self.held_ids = 0

    def encode(self, text: str) -> list[int] | None:
        """``text``'s ids, its known prefix taken from memory; None if it has too few pieces to cut."""
        pieces = [p for p in self._cut.split(text) if p]
        if len(pieces) < 2:
            return None
        running = hashlib.blake2b(digest_size=16)
        keys = []
        for piece in pieces:
            running.update(piece.encode("utf-8", "surrogatepass"))
            running.update(b"\x00")  # the pieces' ends are part of what is hashed
            keys.append(running.copy().digest())
        ids: list[int] = []
        known = 0
        with self._lock:
            held = self._held
            while known < len(keys):
                got = held.get(keys[known])
                if got is None:
                    break
                held.move_to_end(keys[known])
                ids.extend(got)
                known += 1
        if known:
            self.hits += 1
            self.reused_ids += len(ids)
        fresh = self._encode_pieces(pieces[known:]) if known < len(pieces) else []
        with self._lock:
            for key, piece_ids in zip(keys[known:], fresh, strict=True):
                if key not in self._held:
                    self._held[key] = array("i", piece_ids)
                    self.held_ids += len(piece_ids) + ENTRY_IDS
            while self.held_ids > BUDGET_IDS and self._held:
                _, dropped = self._held.popitem(last=False)
                self.held_ids -= len(dropped) + ENTRY_IDS
        held_count = len(ids)
        for piece_ids in fresh:
            ids.extend(piece_ids)
        if self.observe is not None:
            self.observe(held_count, len(ids) - held_count)
        return ids
