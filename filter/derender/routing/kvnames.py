"""Names for the blocks replicas store, so that a prompt finds their vLLM hashes without hashing
vLLM's way (``kvroute``): Python's own 64-bit hash of each block chained to its parent's, from the
events' own tokens (``Namer``) and from a prompt's ids (``python_chain``) alike."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from vllm.distributed.kv_events import BlockStored

from .kvindex import MASK, external

PLAIN = (None, None, ())  # the seed of a prompt's chain without salt, adapter or images
PLAIN_SEED = hash(PLAIN)


def python_chain(ids: Sequence[int], size: int, full: int, parent: int) -> Iterator[int]:
    """One 64-bit name per full block of the first ``full``: Python's hash of the block chained to its
    parent's, the first to ``parent`` (``hash(seed)`` for a prompt's first block). Lazy: a caller that
    stops at the first unknown name hashes no further."""
    for block in zip(*[iter(ids[: full * size])] * size, strict=False):
        parent = hash((parent, block))
        yield parent


class Namer:
    """Plain blocks (no salt, adapter or image) named from the events' own tokens as ``python_chain``
    names a prompt's: name -> vLLM's external hash, and back (a stored block's children are named
    from their parent's name). At most ``max_named`` names; past it the oldest tenth is forgotten."""

    def __init__(self, block_size: int, max_named: int = 1 << 20) -> None:
        self.block_size = block_size
        self.max_named = max_named
        self.named: dict[int, int] = {}
        self.name_of: dict[int, int] = {}

    def learn(self, event: BlockStored) -> list[int] | None:
        """Name a stored run of plain blocks; their names (in the event's order), or None when they
        cannot be named (not plain, another block size, a parent never seen)."""
        keys = event.extra_keys
        if keys and any(k is not None for k in keys):
            return None  # a salt, adapter or image: such prompts are hashed vLLM's way (``chain``)
        size, hashes, tokens = self.block_size, event.block_hashes, event.token_ids
        if event.block_size != size or len(tokens) != size * len(hashes) or not hashes:
            return None
        if event.parent_block_hash is None:
            parent = PLAIN_SEED
        else:
            known = self.name_of.get(external(event.parent_block_hash))
            if known is None:
                return None  # its parent was never seen: its prompts match as far as the parent
            parent = known
        named, name_of = self.named, self.name_of
        names: list[int] = []
        name = parent  # python_chain's names, its loop written out (every stored block passes here)
        for tokens_of, h in zip(zip(*[iter(tokens)] * size, strict=False), hashes, strict=True):
            name = hash((name, tokens_of))
            block = h & MASK if type(h) is int else external(h)
            named[name] = block
            name_of[block] = name
            names.append(name)
        if len(named) > self.max_named:
            self.shrink()
        return names

    def shrink(self) -> None:
        named, name_of = self.named, self.name_of
        for old in list(itertools.islice(named, len(named) // 10)):
            name_of.pop(named.pop(old), None)
