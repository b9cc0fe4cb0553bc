"""A prompt's token ids as vLLM's prefix cache sees them: the chain of block hashes.

vLLM caches a prompt's KV in blocks of ``block_size`` tokens (16 by default) and
finds a block again by its hash, which chains the parent block's hash, the
block's token ids and extra keys (the request's ``cache_salt`` on the first
block; LoRA and media, which the filter does not send). Only full blocks count.
Two prompts share cached blocks exactly as far as their chains agree, so a
routing key made from a chain hash sends prompts that can share cache to the
same place.

The hashing is vLLM's own (``hash_block_tokens`` with the function
``--prefix-caching-hash-algo`` names, ``sha256`` by default, and the same
``NONE_HASH`` seed), so the chain equals the producer's when both run with the
same algorithm and ``PYTHONHASHSEED`` (unset by default). A key only has to be
stable to spread and stick; equal to the producer's, it can also be matched
against what a replica reports it holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

BLOCK_SIZE = 16  # vLLM's default prefix-cache block size on GPUs
HASH_ALGO = "sha256"  # vLLM's default --prefix-caching-hash-algo


class BlockHasher:
    """The block-hash chain of token ids, as vLLM's prefix cache computes it."""

    def __init__(self, block_size: int = BLOCK_SIZE, algo: str = HASH_ALGO) -> None:
        if block_size < 1:
            raise ValueError("the prefix block size must be >= 1")
        self.block_size = block_size
        self.hash_fn = get_hash_fn_by_name(algo)
        # vLLM's root of every chain; its seed is PYTHONHASHSEED if set, else a fixed
        # string for the cryptographic algorithms (random for xxhash: not reproducible).
        kv_cache_utils.init_none_hash(self.hash_fn)

    def chain(self, token_ids: Sequence[int], cache_salt: str | None = None, limit: int | None = None) -> list[bytes]:
        """The hashes of the full blocks of ``token_ids`` (the first ``limit`` of them, if given)."""
        size = self.block_size
        full = len(token_ids) // size
        if limit is not None:
            full = min(full, limit)
        hashes: list[bytes] = []
        parent = None
        for i in range(full):
            extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt else None
            parent = kv_cache_utils.hash_block_tokens(self.hash_fn, parent, token_ids[i * size : (i + 1) * size], extra)
            hashes.append(parent)
        return hashes

    def key(self, token_ids: Sequence[int], blocks: int, cache_salt: str | None = None) -> str | None:
        """A routing key: the hash of the prefix of up to ``blocks`` full blocks (hex), or None if
        the prompt has no full block. Prompts with the same key share at least that cached prefix."""
        hashes = self.chain(token_ids, cache_salt, limit=blocks)
        return bytes(hashes[-1]).hex() if hashes else None
