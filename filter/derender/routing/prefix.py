"""A prompt's token ids as vLLM's prefix cache sees them: the chain of block hashes.

vLLM caches a prompt's KV in blocks of ``block_size`` tokens (16 by default) and
finds a block again by its hash, which chains the parent block's hash, the
block's token ids and extra keys (the request's ``cache_salt`` on the first
block; a LoRA adapter's name and path on every block; each image's content hash and
its offset in the blocks its placeholder tokens fall in). Only full blocks count.
Two prompts share cached blocks exactly as far as their chains agree, so a
routing key made from a chain hash sends prompts that can share cache to the
same place.

The hashing is vLLM's own (``hash_block_tokens`` with the function
``--prefix-caching-hash-algo`` names, ``sha256`` by default, and the same
``NONE_HASH`` seed), so the chain equals the producer's when both run with the
same algorithm and ``PYTHONHASHSEED`` (unset by default). A key only has to be
stable to spread and stick; equal to the producer's, it can also be matched
against what a replica reports it holds.

vLLM's hash costs ~2 us a block (a pickle and a sha256); the chain is memoized
per block (parent hash, block tokens), so the blocks a conversation's earlier
turns already hashed cost a dict lookup each.

Which prefix makes the routing key (``PrefixKey``): a conversation's turns share
everything up to their first answer (system prompt, tools, first user message),
and a tenant's conversations share the system prompt only. A key over the first
turn's prompt, up to the assistant's header the chat template puts there (found by
the template's own generation prompt), is the same for every turn of one
conversation and differs between conversations, so conversations spread over the
replicas and their turns stick; each replica then holds a tenant's system prompt
once (one miss per replica and tenant). A key over the system prompt alone would
put all of a tenant's conversations on one replica, which the load bound must then
break up. Prompts without that header (completions) are keyed by their full blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

BLOCK_SIZE = 16  # vLLM's default prefix-cache block size on GPUs
HASH_ALGO = "sha256"  # vLLM's default --prefix-caching-hash-algo


class BlockHasher:
    """The block-hash chain of token ids, as vLLM's prefix cache computes it."""

    MEMO = 1 << 16  # blocks remembered (per process); cleared when full

    def __init__(self, block_size: int = BLOCK_SIZE, algo: str = HASH_ALGO) -> None:
        if block_size < 1:
            raise ValueError("the prefix block size must be >= 1")
        self.block_size = block_size
        self._memo: dict[tuple, Any] = {}
        self.hash_fn = get_hash_fn_by_name(algo)
        # vLLM's root of every chain; its seed is PYTHONHASHSEED if set, else a fixed
        # string for the cryptographic algorithms (random for xxhash: not reproducible).
        kv_cache_utils.init_none_hash(self.hash_fn)

    def chain(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        limit: int | None = None,
        lora: tuple[str, str] | None = None,
        media: Sequence[Media] = (),
    ) -> list[bytes]:
        """The hashes of the full blocks of ``token_ids`` (the first ``limit`` of them, if given);
        ``lora``: the adapter's (name, path), which vLLM puts in every block's extra keys; ``media``:
        the prompt's images as (content hash, placeholder offset, length), sorted by offset."""
        size = self.block_size
        full = len(token_ids) // size
        if limit is not None:
            full = min(full, limit)
        hashes: list[bytes] = []
        parent = None
        memo = self._memo
        for i in range(full):
            block = tuple(token_ids[i * size : (i + 1) * size])
            extra = extra_keys(i * size, (i + 1) * size, cache_salt, lora, media)
            seen = (parent, block) if extra is None else (parent, block, extra)
            h = memo.get(seen)
            if h is None:
                h = kv_cache_utils.hash_block_tokens(self.hash_fn, parent, block, extra)
                if len(memo) >= self.MEMO:
                    memo.clear()
                memo[seen] = h
            parent = h
            hashes.append(h)
        return hashes

    def key(self, token_ids: Sequence[int], blocks: int, cache_salt: str | None = None) -> str | None:
        """A routing key: the hash of the prefix of up to ``blocks`` full blocks (hex), or None if
        the prompt has no full block. Prompts with the same key share at least that cached prefix."""
        hashes = self.chain(token_ids, cache_salt, limit=blocks)
        return bytes(hashes[-1]).hex() if hashes else None


Media = tuple[str, int, int]  # an image's content hash (vLLM's mm_hash), placeholder offset and length


def extra_keys(
    start: int, end: int, cache_salt: str | None, lora: tuple[str, str] | None, media: Sequence[Media]
) -> tuple | None:
    """vLLM's extra keys of the block of tokens [start, end) (``generate_block_hash_extra_keys``): the
    adapter, then every image whose placeholder overlaps the block with its offset from the block's
    start, then the cache salt on the first block."""
    keys: list[tuple] = [("lora", *lora)] if lora else []
    for digest, offset, length in media:
        if offset >= end:
            break
        if start < offset + length:
            keys.append(("mm", digest, offset - start))
    if start == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) or None


def find(ids: Sequence[int], marker: Sequence[int], start: int = 0) -> int:
    """Where ``marker`` first occurs in ``ids`` at or after ``start``, or -1."""
    if not marker:
        return -1
    first, n = marker[0], len(marker)
    index = ids.index if isinstance(ids, list) else list(ids).index
    i = start
    while True:
        try:
            i = index(first, i)
        except ValueError:
            return -1
        if list(ids[i : i + n]) == list(marker):
            return i
        i += 1


def answer_marker(tokenizer: Any) -> tuple[int, ...]:
    """The token ids that start the first answer in a chat prompt: the shortest head of the chat
    template's generation prompt that does not occur in the prompt before it (Qwen3:
    ``<|im_start|>assistant``; DeepSeek-R1: ``<｜Assistant｜>``). Empty if the template has none."""
    probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    try:  # rendered to text, then tokenized as vLLM tokenizes a rendered chat prompt
        bare, full = (
            tokenizer.encode(
                tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=g), add_special_tokens=False
            )
            for g in (False, True)
        )
    except Exception:  # noqa: BLE001 - a template that refuses the probe: no marker, full-block keys
        return ()
    if full[: len(bare)] != bare or len(full) == len(bare):
        return ()
    generation = full[len(bare) :]
    for n in range(1, len(generation) + 1):
        if find(bare, generation[:n]) < 0:
            return tuple(generation[:n])
    return tuple(generation)


class PrefixKey:
    """The routing key of a prompt: vLLM's chain hash over its first turn, up to and including the
    first answer's header (see above), at most ``max_blocks`` blocks of it. The full blocks are
    hashed as vLLM hashes them; the tokens after the last full block (a partial block, which vLLM
    does not cache) extend the chain the same way, so conversations whose first turns differ only
    there still get different keys."""

    MEMO = 1 << 14  # keys remembered (per process); cleared when full

    def __init__(self, hasher: BlockHasher, marker: Sequence[int] = (), max_blocks: int = 256) -> None:
        self.hasher = hasher
        self.marker = tuple(marker)
        self.max_blocks = max_blocks
        # (tokens, cache_salt, Python's hash of those tokens) -> key: a conversation's later turns
        # cost one hash of the prefix (~10 us for 1k tokens) instead of vLLM's chain (~1-2 us a block).
        self._memo: dict[tuple, str] = {}

    def tokens(self, ids: Sequence[int]) -> int:
        """How many leading tokens the key covers."""
        end = find(ids, self.marker, 1) if self.marker else -1
        end = len(ids) if end < 0 else end + len(self.marker)
        return min(end, self.max_blocks * self.hasher.block_size)

    def key(
        self,
        ids: Sequence[int],
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        media: Sequence[Media] = (),
    ) -> tuple[str | None, int]:
        """(hex key, or None for an empty prompt; the tokens it covers); ``lora``: the adapter's
        (name, path): its prompts key apart from the base model's, as vLLM's blocks do; ``media``: the
        prompt's images (``media_of``): the same placeholder tokens with another picture key apart."""
        n = self.tokens(ids)
        size = self.hasher.block_size
        if n == 0:
            return None, 0
        media = tuple(media)
        seen = (n, cache_salt, lora, media, hash(tuple(ids[:n])))
        key = self._memo.get(seen)
        if key is None:
            full = n // size
            chain = self.hasher.chain(ids, cache_salt, limit=full, lora=lora, media=media)
            last: Any = chain[-1] if chain else None  # vLLM's BlockHash (bytes) or no parent
            if n % size:
                extra = extra_keys(full * size, n, cache_salt, lora, media)
                last = kv_cache_utils.hash_block_tokens(self.hasher.hash_fn, last, tuple(ids[full * size : n]), extra)
            key = bytes(last).hex()
            if len(self._memo) >= self.MEMO:
                self._memo.clear()
            self._memo[seen] = key
        return key, n
