"""What each producer replica holds in its prefix cache, from vLLM's KV cache events (``kvfeed``).

Blocks are known by a 64-bit key (``kvnames.Namer``): a plain block (no salt, adapter or image) by
its name, Python's hash chain of its tokens, which a prompt's blocks get without hashing vLLM's way;
any other by vLLM's external block hash: a 64-bit integer (vLLM's default,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or, from producers that publish bytes, the same 64 bits
taken from them; the filter's own chain (``prefix.BlockHasher``, vLLM's ``hash_block_tokens``) is
turned into that form by ``external``. A prompt's match on a replica is the longest leading run of its
blocks the replica holds (a block hash chains its whole prefix, so a held block implies its parents
were computed; vLLM looks its cache up the same way).

Bounded: at most ``max_blocks`` (block, replica) entries in all; past it the oldest tenth of the
blocks is forgotten (a forgotten block only costs a routing hit, never an answer).

Between a routing decision and the replica's ``BlockStored``, the replica counts as holding the
prompt's blocks for ``predict_s`` seconds (``predict``): a conversation's burst of requests goes to one
replica instead of scattering before the first of them is prefilled.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

MASK = (1 << 64) - 1
# Ops on the index, as a feed's events become (``event_ops``) and as the hub relays them (``kvhub``).
STORED, REMOVED, CLEARED, LEFT = 1, 2, 3, 4


def external(block_hash: object) -> int:
    """vLLM's external form of a block hash (``maybe_convert_block_hash``), as an int."""
    if isinstance(block_hash, int):
        return block_hash & MASK
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(block_hash), "big") & MASK
    raise TypeError(f"a block hash is an int or bytes, not {type(block_hash).__name__}")


def external_all(hashes: Iterable[object]) -> list[int]:
    return [h & MASK if type(h) is int else external(h) for h in hashes]


def event_ops(
    events: Iterable[object],
    stored: Callable[[BlockStored], list[int]] = lambda event: external_all(event.block_hashes),
    removed: Callable[[Sequence[object]], list[int]] = external_all,
) -> list[tuple]:
    """A batch's events as ops on the index: ``(STORED, keys)``, ``(REMOVED, keys)``, ``(CLEARED,)``;
    blocks keyed by ``stored`` and ``removed`` (vLLM's external hashes unless ``kvnames.Namer`` names
    them)."""
    ops: list[tuple] = []
    for event in events:
        kind = type(event)
        if kind is BlockStored:
            ops.append((STORED, stored(event)))  # type: ignore[arg-type]
        elif kind is BlockRemoved:
            ops.append((REMOVED, removed(event.block_hashes)))  # type: ignore[attr-defined]
        elif kind is AllBlocksCleared:
            ops.append((CLEARED,))
    return ops


class KvIndex:
    """Block hash -> the replicas holding it (confirmed by their events, or predicted for a while).

    A block's holders are one int, a bit per replica (``bits``): an event's blocks cost a dict update
    each and allocate nothing the garbage collector must walk."""

    def __init__(self, max_blocks: int = 1 << 20, predict_s: float = 2.0) -> None:
        self.max_blocks = max_blocks
        self.predict_s = predict_s
        self.holders: dict[int, int] = {}  # block -> bits of its replicas; insertion order: the oldest first
        self.bits: dict[str, int] = {}  # replica -> its bit
        self.names: dict[int, str] = {}  # bit -> replica
        self.entries = 0
        self.predicted: dict[int, dict[str, float]] = {}  # block -> replica -> until (monotonic seconds)

    def bit(self, replica: str) -> int:
        bit = self.bits.get(replica)
        if bit is None:
            bit = self.bits[replica] = 1 << len(self.bits)
            self.names[bit] = replica
        return bit

    # -- events -------------------------------------------------------------------------------
    def apply(self, replica: str, events: list) -> None:
        """One batch of a replica's events, keyed by vLLM's hashes (``kvfeed.Sink``)."""
        self.apply_ops(replica, event_ops(events))

    def apply_ops(self, replica: str, ops: Iterable[tuple]) -> None:
        """``STORED``, ``REMOVED`` and ``CLEARED`` ops, in order (``LEFT`` is its caller's)."""
        for op in ops:
            kind = op[0]
            if kind == STORED:
                self.stored(replica, op[1])
            elif kind == REMOVED:
                self.removed(replica, op[1])
            elif kind == CLEARED:
                self.cleared(replica)

    def left(self, replica: str) -> None:
        self.cleared(replica)

    def stored(self, replica: str, blocks: Iterable[int]) -> None:
        """``replica`` holds these blocks (their keys, ``kvnames.Namer``)."""
        bit = self.bit(replica)
        holders, predicted = self.holders, self.predicted
        added = 0
        for block in blocks:
            owners = holders.get(block, 0)
            if not owners & bit:
                holders[block] = owners | bit
                added += 1
            if predicted:
                guess = predicted.get(block)
                if guess is not None:
                    guess.pop(replica, None)
        self.entries += added
        if self.entries > self.max_blocks:
            self._shrink()

    def removed(self, replica: str, blocks: Iterable[int]) -> None:
        bit = self.bit(replica)
        holders, predicted = self.holders, self.predicted
        for block in blocks:
            if predicted:
                guess = predicted.get(block)
                if guess is not None:
                    guess.pop(replica, None)  # evicted: not held, whatever was predicted
            owners = holders.get(block, 0)
            if owners & bit:
                owners &= ~bit
                self.entries -= 1
                if owners:
                    holders[block] = owners
                else:
                    del holders[block]

    def cleared(self, replica: str) -> None:
        """AllBlocksCleared, or the replica left the index: nothing of it is known any more (a walk
        over the index: rare, a replica's restart or its leaving)."""
        bit = self.bit(replica)
        holders = self.holders
        gone = [block for block, owners in holders.items() if owners & bit]
        for block in gone:
            owners = holders[block] & ~bit
            if owners:
                holders[block] = owners
            else:
                del holders[block]
        self.entries -= len(gone)
        for guess in self.predicted.values():
            guess.pop(replica, None)

    def _shrink(self) -> None:
        for block in list(itertools.islice(self.holders, max(1, len(self.holders) // 10))):
            self.entries -= self.holders.pop(block).bit_count()

    # -- routing ------------------------------------------------------------------------------
    def predict(self, replica: str, chain: Sequence[int], now: float) -> None:
        until = now + self.predict_s
        predicted = self.predicted
        if len(predicted) > self.max_blocks // 4:
            for block in [b for b, g in predicted.items() if all(t < now for t in g.values())]:
                del predicted[block]
        bit, holders = self.bit(replica), self.holders
        for block in chain:
            if not holders.get(block, 0) & bit:  # what its events already confirm needs no guess
                predicted.setdefault(block, {})[replica] = until

    def match(self, chain: Sequence[int], now: float) -> dict[str, int]:
        """Each replica holding a leading run of ``chain``: the run's length in blocks. A replica's
        depth is written once, where its run ends (the walk keeps the bits of the replicas still
        matching, and stops when none is)."""
        depth: dict[str, int] = {}
        alive = -1
        holders, predicted = self.holders, self.predicted
        n = 0
        for block in chain:
            kept = alive & holders.get(block, 0)
            if kept != alive and predicted:  # some replica still matching lacks it: predicted, perhaps
                guess = predicted.get(block)
                if guess:
                    for replica, until in guess.items():
                        if until > now:
                            kept |= alive & self.bit(replica)
            if kept != alive:
                if n:  # the replicas whose run ended at the previous block
                    self._depths(depth, alive & ~kept, n)
                if not kept:
                    return depth
                alive = kept
            n += 1
        if n:
            self._depths(depth, alive, n)
        return depth

    def _depths(self, depth: dict[str, int], bits: int, n: int) -> None:
        names = self.names
        while bits:
            low = bits & -bits
            depth[names[low]] = n
            bits ^= low

    def __len__(self) -> int:
        return self.entries
