"""Long prompts tokenized in pieces, on two threads: vLLM's token ids in a fraction of the time.

A fast tokenizer's cost per character grows with the length of the text (the
pre-tokenizer's regex split over one long string), and it runs on one core:
~55 ms for a 30k-token prompt here, most of the time to first token the
filter adds. vLLM's renderer tokenizes the rendered prompt in one call; for
long text the filter cuts it first, only where the cut cannot change a token,
and tokenizes the pieces on two threads (the tokenizer releases the GIL).

Where a cut is safe: the tokenizer splits added tokens out, normalizes, splits
the text into pre-tokens with regexes and maps each pre-token to ids with BPE,
never across a pre-token boundary. A cut at a space between two ASCII letters
("x| y") is a pre-token boundary for the GPT-2/GPT-4/o200k-style patterns
(their only matches that contain a letter stop at a space, and the next match
starts with it), the regexes look neither behind nor at word boundaries, Unicode
normalization never combines across an ASCII character, and no added token
spans it. So tokenizing the pieces gives the same ids as the whole, provided
the tokenizer is built only from parts for which that reasoning holds
(``splittable``); each cut is also checked on the text around it. Anything
else (other tokenizers, offsets, special tokens the tokenizer would add, short
text) takes vLLM's own path unchanged.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import prefixmemo, vllm_seams

log = logging.getLogger("derender.longprompt")

MIN_CHARS = 24_000  # shorter text (~6k tokens): one call, as vLLM does
PIECE_CHARS = 8_000  # pieces this long cost about as little per character as any
WINDOW = 32  # characters either side of a cut that the cut is checked on

_CUT = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")
_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}
_PRE_TOKENIZERS = {"Split", "ByteLevel", "Digits"}
_pool: ThreadPoolExecutor | None = None


def _forget_pool() -> None:
    """A forked worker inherits the pool object but not its thread: start a new one there."""
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def splittable(tokenizer: Any) -> bool:
    """True if cutting at "x| y" provably keeps this tokenizer's ids (see the module doc)."""
    import json

    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return False
    spec = json.loads(backend.to_str())
    if (spec.get("model") or {}).get("type") != "BPE" or (spec.get("model") or {}).get("dropout"):
        return False
    if not _only(spec.get("normalizer"), "normalizers", lambda n: n.get("type") in _NORMALIZERS):
        return False
    if not _only(spec.get("pre_tokenizer"), "pretokenizers", _safe_pre_tokenizer):
        return False
    for token in spec.get("added_tokens") or ():
        content = token.get("content", "")
        if " " in content:
            return False
        edges = content[:1] + content[-1:]
        if (token.get("lstrip") or token.get("rstrip") or token.get("single_word")) and re.search("[A-Za-z]", edges):
            return False
    return True


def _only(node: dict | None, children: str, ok) -> bool:
    if node is None:
        return True
    if node.get("type") == "Sequence":
        return all(_only(child, children, ok) for child in node.get(children) or ())
    return bool(ok(node))


def _safe_pre_tokenizer(node: dict) -> bool:
    kind = node.get("type")
    if kind not in _PRE_TOKENIZERS:
        return False
    if kind == "ByteLevel":
        return not node.get("add_prefix_space")
    if kind == "Split":
        pattern = node.get("pattern") or {}
        regex = pattern.get("Regex")
        return (
            regex is not None
            and node.get("behavior") == "Isolated"
            and not node.get("invert")
            and not looks_around(regex)
        )
    return True  # Digits


def looks_around(regex: str) -> bool:
    """Look-behind, word boundaries or anchors outside character classes: context a cut would hide."""
    depth = 0  # inside [...] (classes nest in Oniguruma)
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            if depth == 0 and regex[i + 1 : i + 2] in tuple("bBGAzZ"):
                return True
            i += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]" and depth:
            depth -= 1
        elif depth == 0 and (c in "^$" or regex.startswith("(?<", i)):
            return True
        i += 1
    return False


def pieces(tokenizer: Any, text: str) -> list[str]:
    """``text`` cut into pieces of about ``PIECE_CHARS`` at checked safe cuts (one piece if none)."""
    candidates: list[int] = []
    start = 0
    while len(text) - start > PIECE_CHARS * 1.5:
        match = _CUT.search(text, start + PIECE_CHARS)
        if match is None:
            break
        candidates.append(match.start())
        start = match.start()
    if not candidates:
        return [text]
    windows = []
    for cut in candidates:
        left, right = text[max(cut - WINDOW, 0) : cut], text[cut : cut + WINDOW]
        windows += [left + right, left, right]
    # The tokenizer itself, not vLLM's thread-safe wrapper (which borrows a copy per call):
    # reading is thread-safe, and these texts are far too short for any truncation to matter.
    ids = [e.ids for e in vllm_seams.raw_tokenizer(tokenizer).encode_batch_fast(windows, add_special_tokens=False)]
    cuts = [cut for k, cut in enumerate(candidates) if ids[3 * k] == ids[3 * k + 1] + ids[3 * k + 2]]
    edges = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(edges)]


def encode(tokenizer: Any, parts: list[str]) -> list[int]:
    """The ids of ``"".join(parts)``: half the pieces on a helper thread, half on this one."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="derender-tokenize")
    total = sum(map(len, parts))
    at, size = 0, 0
    while at < len(parts) and size < total / 2:
        size += len(parts[at])
        at += 1
    first = _pool.submit(tokenizer, parts[:at], add_special_tokens=False) if at else None
    rest = tokenizer(parts[at:], add_special_tokens=False)["input_ids"] if at < len(parts) else []
    head = first.result()["input_ids"] if first is not None else []
    return [i for piece in (*head, *rest) for i in piece]


def encode_each(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """The ids of each text on its own (``prefixmemo``): long ones in checked pieces on two threads."""
    global split_prompts
    out: list[list[int] | None] = [None] * len(texts)
    short: list[int] = []
    for k, text in enumerate(texts):
        if len(text) >= MIN_CHARS and len(parts := pieces(tokenizer, text)) > 1:
            out[k] = encode(tokenizer, parts)
            split_prompts += 1
        else:
            short.append(k)
    if short:
        backend = vllm_seams.raw_tokenizer(tokenizer)
        if backend.truncation is None and backend.padding is None:  # as the tokenizer's own call sets them
            # one at a time: a batch is spread over threads, which costs more CPU for short texts
            batch = [backend.encode_batch_fast([texts[k]], add_special_tokens=False)[0].ids for k in short]
        else:
            batch = tokenizer([texts[k] for k in short], add_special_tokens=False)["input_ids"]
        for k, ids in zip(short, batch, strict=True):
            out[k] = ids
    return [ids or [] for ids in out]


# Texts (prompts, or a prompt's new part after what the prefix memo held) this process tokenized
# in pieces on two threads (for tests and the curious).
split_prompts = 0

# A text with letters, digits, spaces and more than one script: what a special-token probe encodes.
PROBE = "Hello, world: 42 東京 ok"


def adds_no_special_tokens(tokenizer: Any) -> bool:
    """Whether ``add_special_tokens=True`` encodes a text as ``False`` does: the tokenizer's
    post-processor (where a fast tokenizer adds BOS / EOS) adds no token to one sequence, and a
    probe encodes alike both ways. vLLM's Responses server asks for special tokens on the rendered
    prompt, its chat server not; where they add nothing, a Responses prompt may take the same
    pieces and held prefixes as a chat prompt."""
    backend = vllm_seams.raw_tokenizer(tokenizer)
    post = getattr(backend, "post_processor", None)
    if post is not None and post.num_special_tokens_to_add(False) != 0:
        return False
    both = [tokenizer(PROBE, add_special_tokens=flag)["input_ids"] for flag in (True, False)]
    return both[0] == both[1]


def install(renderer: Any) -> tuple[bool, prefixmemo.PrefixMemo | None]:
    """Route the renderer's long text prompts through its prefix memo, else ``pieces`` and ``encode``.
    (False, None) if the tokenizer is not known to split safely; the memo is None where it cannot be cut."""

    tokenizer = renderer.get_tokenizer()
    if not splittable(tokenizer):
        log.info("long prompts are tokenized in one call (tokenizer not known to split safely)")
        return False, None
    original = vllm_seams.renderer_tokenize_prompt(renderer)
    markers = prefixmemo.boundaries(tokenizer)
    memo = prefixmemo.PrefixMemo(markers, lambda texts: encode_each(tokenizer, texts)) if markers else None
    shortest = min(MIN_CHARS, prefixmemo.MIN_CHARS) if memo is not None else MIN_CHARS  # shorter: vLLM's call
    plain = adds_no_special_tokens(tokenizer)  # special tokens asked for (Responses) change nothing

    def tokenize_prompt(prompt: Any, params: Any) -> Any:
        global split_prompts
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if not isinstance(text, str) or len(text) < shortest:
            return original(prompt, params)
        kwargs = params.get_encode_kwargs()
        special = kwargs.get("add_special_tokens") and not plain
        if special or vllm_seams.renderer_wants_offsets(renderer, prompt, params):
            return original(prompt, params)
        ids = memo.encode(text) if memo is not None and len(text) >= prefixmemo.MIN_CHARS else None
        if ids is None:
            if len(text) < MIN_CHARS:
                return original(prompt, params)
            parts = pieces(tokenizer, text)
            if len(parts) < 2:
                return original(prompt, params)
            ids = encode(tokenizer, parts)
            split_prompts += 1
        limit = kwargs.get("max_length") if kwargs.get("truncation") else None
        if limit is not None and len(ids) > limit:  # as the tokenizer truncates one sequence
            ids = ids[:limit] if tokenizer.truncation_side == "right" else ids[-limit:]
        return vllm_seams.renderer_tokens_prompt(renderer, ids, prompt)

    vllm_seams.set_renderer_tokenize_prompt(renderer, tokenize_prompt)
    return True, memo
