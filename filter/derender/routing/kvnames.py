"""Names for the blocks replicas store, so that a prompt finds their vLLM hashes without hashing
vLLM's way (``kvroute``): Python's own 64-bit hash of each block chained to its parent's, from the
events' own tokens (``Namer``) and from a prompt's ids (``python_chain``) alike."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from vllm.distributed.kv_events import BlockStored

from .kvindex import event_ops, external, external_all

PLAIN = (None, None, ())  # the seed of a prompt's chain without salt, adapter or images
# Its first block's parent name: a tuple of ints hashes alike in every process (None's hash, before
# Python 3.12, is its address).
PLAIN_SEED = hash((0x6B76, 16))


def python_chain(ids: Sequence[int], size: int, full: int, parent: int) -> Iterator[int]:
    """One 64-bit name per full block of the first ``full``: Python's hash of the block chained to its
    parent's, the first to ``parent`` (``hash(seed)`` for a prompt's first block). Lazy: a caller that
    stops at the first unknown name hashes no further."""
    for block in zip(*[iter(ids[: full * size])] * size, strict=False):
        parent = hash((parent, block))
        yield parent


class Namer:
    """The index's keys for a replica's blocks (``kvindex``): a plain block (no salt, adapter or image)
    whose parent is known is keyed by its name, Python's hash chain of the event's own tokens as
    ``python_chain`` names a prompt's blocks; any other block by vLLM's external hash (a prompt that
    carries a salt, adapter or image is hashed vLLM's way). ``name_of``: vLLM's external hash -> the
    name, to key a removal and to name a stored run's children from its parent's name. At most
    ``max_named`` names; past it the oldest tenth is forgotten."""

    def __init__(self, block_size: int, max_named: int = 1 << 20) -> None:
        self.block_size = block_size
        self.max_named = max_named
        self.name_of: dict[int, int] = {}

    def stored(self, event: BlockStored) -> list[int]:
        """The keys of a stored run's blocks, in the event's order (each named if it can be)."""
        hashes = event.block_hashes
        blocks = external_all(hashes)
        keys = event.extra_keys
        if keys and any(k is not None for k in keys):
            return blocks  # a salt, adapter or image: such prompts are hashed vLLM's way (``chain``)
        size, tokens = self.block_size, event.token_ids
        if event.block_size != size or len(tokens) != size * len(hashes) or not hashes:
            return blocks
        name_of = self.name_of
        if event.parent_block_hash is None:
            name = PLAIN_SEED
        else:
            parent = name_of.get(external(event.parent_block_hash))
            if parent is None:
                return blocks  # its parent was never seen: its prompts match as far as the parent
            name = parent
        names: list[int] = []
        # python_chain's names, its loop written out (every stored block passes here)
        for tokens_of, block in zip(zip(*[iter(tokens)] * size, strict=False), blocks, strict=True):
            name = hash((name, tokens_of))
            name_of[block] = name
            names.append(name)
        if len(name_of) > self.max_named:
            for old in list(itertools.islice(name_of, len(name_of) // 10)):
                del name_of[old]
        return names

    def removed(self, hashes: Sequence[object]) -> list[int]:
        """The keys of removed blocks (named ones by their names)."""
        name_of = self.name_of
        return [name_of.get(block, block) for block in external_all(hashes)]

    def ops(self, events: list) -> list[tuple]:
        """A batch's events as ops on the index, their blocks keyed by this namer."""
        return event_ops(events, self.stored, self.removed)
