"""vLLM's KV cache events, published as ``vllm serve --kv-events-config JSON`` publishes them.

The JSON is vLLM's ``KVEventsConfig``; the publisher is vLLM's own (``EventPublisherFactory``: a ZMQ
PUB socket sending ``(topic, sequence number, msgpack KVEventBatch)`` and a ROUTER replay socket), so
the batches, encoding, topic, sequence numbers and replay are vLLM's. The block hashes are vLLM's
chain (``hash_block_tokens`` with the function ``--prefix-caching-hash-algo`` names and vLLM's
``NONE_HASH``); each block's extra keys are what vLLM 0.33 puts there for a prompt that has them: its
LoRA adapter (``("lora", name, path)``, ``--lora-modules``), its images (``("mm", content hash, offset
in the block)``) and, on the first block, the ``cache_salt``
(``generate_block_hash_extra_keys``). Published block hashes are vLLM's external form
(``maybe_convert_block_hash``: 64-bit integers unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

vLLM is imported only when events are asked for (it takes seconds).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

Media = tuple[str, int, int]  # an image's content hash, placeholder offset and length
MEDIUM = "GPU"  # vLLM's block pool on a GPU


Lora = tuple[str, str, int]  # an adapter's name, path and vLLM's id for it


def extra_keys(
    start: int, end: int, cache_salt: str | None, media: Sequence[Media], lora: Lora | None = None
) -> tuple | None:
    """vLLM's extra keys of the block of tokens [start, end): the LoRA adapter's name and path, every
    image whose placeholder overlaps it, with its offset from the block's start, then the cache salt on
    the first block."""
    keys: list[tuple] = [("lora", lora[0], lora[1])] if lora else []
    for digest, offset, length in media:
        if offset >= end:
            break
        if start < offset + length:
            keys.append(("mm", digest, offset - start))
    if start == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) or None


def media_of(body: dict) -> list[Media]:
    """A generate request's images as (content hash, offset, length), by offset."""
    features = body.get("features") or {}
    out = []
    for modality, digests in (features.get("mm_hashes") or {}).items():
        for digest, where in zip(digests, (features.get("mm_placeholders") or {}).get(modality, ()), strict=False):
            out.append((digest, int(where["offset"]), int(where["length"])))
    return sorted(out, key=lambda m: m[1])


class KvEvents:
    """A simulator's KV cache events: vLLM's hashes for its cache, vLLM's publisher for its events."""

    def __init__(self, config_json: str, block_size: int = 16, hash_algo: str = "sha256") -> None:
        from vllm.config.kv_events import KVEventsConfig
        from vllm.distributed import kv_events
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils

        config = KVEventsConfig(**json.loads(config_json))
        if not config.enable_kv_cache_events or config.publisher != "zmq":
            raise ValueError("--kv-events-config must have enable_kv_cache_events true and the zmq publisher")
        self._vllm = kv_events
        self._utils = kv_cache_utils
        self.block_size = block_size
        self.hash_fn = get_hash_fn_by_name(hash_algo)
        kv_cache_utils.init_none_hash(self.hash_fn)
        self.publisher = kv_events.EventPublisherFactory.create(config, data_parallel_rank=0)
        self.config = config
        self.published = 0  # batches
        self.publish([self.cleared()])  # a fresh start: nothing cached

    def chain(
        self, token_ids: Sequence[int], cache_salt: str | None, media: Sequence[Media], lora: Lora | None = None
    ) -> list[tuple]:
        """(vLLM's block hash, its extra keys, its tokens) of each full block of ``token_ids``."""
        size, out, parent = self.block_size, [], None
        for start in range(0, len(token_ids) // size * size, size):
            block = tuple(token_ids[start : start + size])
            extra = extra_keys(start, start + size, cache_salt, media, lora)
            parent = self._utils.hash_block_tokens(self.hash_fn, parent, block, extra)
            out.append((parent, extra, block))
        return out

    def external(self, block_hash: Any) -> Any:
        return self._utils.maybe_convert_block_hash(block_hash)

    def stored(self, run: list[tuple], parent: Any, lora: Lora | None = None) -> Any:
        """``BlockStored`` for a run of newly cached blocks (``parent``: the hash before the run)."""
        return self._vllm.BlockStored(
            block_hashes=[self.external(h) for h, _, _ in run],
            parent_block_hash=None if parent is None else self.external(parent),
            token_ids=[t for _, _, block in run for t in block],
            block_size=self.block_size,
            lora_id=lora[2] if lora else None,
            medium=MEDIUM,
            lora_name=lora[0] if lora else None,
            extra_keys=self._utils.to_event_extra_keys([extra for _, extra, _ in run]),
            group_idx=0,
        )

    def cleared(self) -> Any:
        return self._vllm.AllBlocksCleared()

    def removed(self, block_hash: Any) -> Any:
        return self._vllm.BlockRemoved(block_hashes=[self.external(block_hash)], medium=MEDIUM, group_idx=0)

    def publish(self, events: list) -> None:
        if events:
            self.publisher.publish(self._vllm.KVEventBatch(ts=time.time(), events=events))
            self.published += 1

    def shutdown(self) -> None:
        self.publisher.shutdown()
