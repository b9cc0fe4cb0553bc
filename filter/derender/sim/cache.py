"""vLLM's prefix cache, modelled (``--prefix-cache-blocks``), publishing what it stores and evicts as
vLLM's KV cache events when ``--kv-events-config`` asks (``kvevents``)."""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

from .kvevents import KvEvents, Lora, Media


class PrefixCache:
    """vLLM's prefix cache, modelled: an LRU of full blocks of ``block_size`` tokens, each known by
    the hash of its whole prefix (a chain, as vLLM hashes them). A request finds the leading
    blocks of its prompt that are cached; its prompt's blocks are cached once it is prefilled and its
    output's when it ends. ``capacity`` 0: no cache (nothing is ever found).

    With ``events`` the hashes are vLLM's own (with the cache salt and images as vLLM keys them) and
    each store and eviction is published; without, a cheap stand-in chain over the tokens alone."""

    def __init__(self, capacity: int, block_size: int = 16, events: KvEvents | None = None) -> None:
        self.capacity = max(0, int(capacity))
        self.block_size = block_size if events is None else events.block_size
        self.events = events
        self.blocks: collections.OrderedDict[object, None] = collections.OrderedDict()

    def chain(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        media: Sequence[Media] = (),
        lora: Lora | None = None,
    ) -> list:
        if self.events is not None:
            return self.events.chain(token_ids, cache_salt, media, lora)
        out, parent, size = [], b"", self.block_size
        for start in range(0, len(token_ids) // size * size, size):
            block = tuple(token_ids[start : start + size])
            parent = hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in block), digest_size=16).digest()
            out.append((parent, None, block))
        return out

    def reset(self) -> None:
        """Everything forgotten, as vLLM's ``POST /reset_prefix_cache`` does (and a restart), published
        as vLLM's block pool publishes it: ``AllBlocksCleared``."""
        self.blocks.clear()
        if self.events is not None:
            self.events.publish([self.events.cleared()])

    def cached_tokens(
        self,
        prompt: Sequence[int],
        cache_salt: str | None = None,
        media: Sequence[Media] = (),
        lora: Lora | None = None,
    ) -> int:
        """Tokens of ``prompt`` found in the cache (whole leading blocks), which become recent."""
        found = 0
        for h, _, _ in self.chain(prompt, cache_salt, media, lora):
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            found += 1
        return found * self.block_size

    def store(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        media: Sequence[Media] = (),
        lora: Lora | None = None,
    ) -> None:
        if not self.capacity:
            return
        chain = self.chain(token_ids, cache_salt, media, lora)
        runs: list[tuple[list[tuple], object]] = []  # newly cached blocks, in runs, each with its parent
        run: list[tuple] | None = None
        for i, entry in enumerate(chain):
            h = entry[0]
            if h in self.blocks:
                self.blocks.move_to_end(h)
                run = None
                continue
            if run is None:
                run = []
                runs.append((run, chain[i - 1][0] if i else None))
            self.blocks[h] = None
            run.append(entry)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        if self.events is not None:
            stored = [self.events.stored(run, parent, lora) for run, parent in runs]
            self.events.publish(stored + [self.events.removed(h) for h in evicted])
