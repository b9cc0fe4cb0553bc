"""vLLM's prefix cache, modelled (``--prefix-cache-blocks``)."""

from __future__ import annotations

import collections
import hashlib


class PrefixCache:
    """vLLM's prefix cache, modelled: an LRU of full blocks of ``BLOCK`` tokens, each known by
    the hash of its whole prefix (a chain, as vLLM hashes them). A request finds the leading
    blocks of its prompt that are cached; when it ends, its prompt and output blocks are cached.
    ``capacity`` 0: no cache (nothing is ever found)."""

    BLOCK = 16

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self.blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def chain(self, token_ids: list[int]) -> list[bytes]:
        hashes, parent = [], b""
        for start in range(0, len(token_ids) // self.BLOCK * self.BLOCK, self.BLOCK):
            block = token_ids[start : start + self.BLOCK]
            parent = hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in block), digest_size=16).digest()
            hashes.append(parent)
        return hashes

    def cached_tokens(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` found in the cache (whole leading blocks), which become recent."""
        found = 0
        for h in self.chain(prompt):
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            found += 1
        return found * self.BLOCK

    def store(self, token_ids: list[int]) -> None:
        if not self.capacity:
            return
        for h in self.chain(token_ids):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
