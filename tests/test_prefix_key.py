"""The routing key is vLLM's own prefix-cache block-hash chain (issue 13's foundation).

Checked against vLLM's request block hasher (``get_request_block_hasher``, what the engine runs
for every request) on the same ids: so two prompts share a key prefix exactly when vLLM's
prefix cache could share their blocks.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from derender.routing.prefix import BlockHasher


def vllm_chain(ids: list[int], block_size: int, algo: str, cache_salt: str | None = None,
               lora: tuple[str, str] | None = None, media: tuple = ()) -> list[bytes]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    # The attributes vLLM's hasher reads of a Request (no prompt embeddings); images as the engine
    # holds them, an identifier (the content hash) and a placeholder range each.
    adapter = SimpleNamespace(lora_name=lora[0], lora_path=lora[1]) if lora else None
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=digest, mm_position=PlaceholderRange(
        offset=offset, length=length)) for digest, offset, length in media]
    request = SimpleNamespace(block_hashes=[], num_tokens=len(ids), all_token_ids=ids, mm_features=features,
                              lora_request=adapter, cache_salt=cache_salt, prompt_embeds=None,
                              _prompt_embeds_per_block_hashes={})
    return list(get_request_block_hasher(block_size, hash_fn)(request))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
@pytest.mark.parametrize("lora", [None, ("my-lora", "/adapters/my-lora")])
def test_the_chain_is_vllms(algo, block_size, salt, lora):
    """Cache salt on the first block, a LoRA adapter's name and path on every block, as vLLM hashes them."""
    rng = random.Random(f"{algo}{block_size}{salt}")
    for length in (0, 1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3, 300):
        ids = [rng.randrange(151_000) for _ in range(length)]
        ours = BlockHasher(block_size, algo).chain(ids, salt, lora=lora)
        assert ours == vllm_chain(ids, block_size, algo, salt, lora), length
        if lora and length >= block_size:  # an adapter's blocks are not the base model's
            assert ours[0] != BlockHasher(block_size, algo).chain(ids, salt)[0]
        assert len(ours) == length // block_size


def test_keys_share_exactly_the_shared_blocks():
    hasher = BlockHasher(16)
    rng = random.Random(7)
    system = [rng.randrange(151_000) for _ in range(100)]  # 6 full blocks and 4 tokens
    a = system + [rng.randrange(151_000) for _ in range(50)]
    b = system + [rng.randrange(151_000) for _ in range(50)]
    ca, cb = hasher.chain(a), hasher.chain(b)
    assert ca[:6] == cb[:6] and all(x != y for x, y in zip(ca[6:], cb[6:]))
    assert hasher.key(a, 6) == hasher.key(b, 6) and hasher.key(a, 7) != hasher.key(b, 7)
    assert hasher.key(a[:15], 4) is None  # no full block
    assert hasher.key(a, 6, cache_salt="x") != hasher.key(a, 6)  # vLLM's cache_salt isolates tenants


def test_an_adapters_prompt_keys_apart_from_the_base_models():
    """The routing key of a prompt asked of a LoRA adapter is the adapter's chain (vLLM caches its blocks
    apart), and the same adapter keys the same prompt alike."""
    from derender.routing.prefix import PrefixKey

    key = PrefixKey(BlockHasher(16))
    ids = list(range(1000, 1100))
    adapter = ("my-lora", "/adapters/my-lora")
    base, lora = key.key(ids)[0], key.key(ids, lora=adapter)[0]
    assert base != lora and key.key(ids, lora=adapter)[0] == lora
    assert key.key(ids, lora=("other", "/adapters/other"))[0] not in (base, lora)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("lora", [None, ("my-lora", "/adapters/my-lora")])
def test_images_are_in_the_chain_as_vllm_hashes_them(block_size, lora):
    """Each block an image's placeholder tokens fall in carries the image's content hash and its offset
    from the block's start, as vLLM's extra keys do: the same placeholder tokens with another picture
    (or the same picture elsewhere) are other blocks, text blocks before them are the same."""
    from derender.routing.prefix import PrefixKey

    rng = random.Random(block_size)
    ids = [rng.randrange(151_000) for _ in range(300)]
    for media in ([("a" * 64, 5, 81)], [("a" * 64, 40, 3), ("b" * 64, 44, 100)], [("c" * 64, 16, 16)],
                  [("a" * 64, 290, 10)]):
        ours = BlockHasher(block_size, "sha256").chain(ids, "salt", lora=lora, media=media)
        assert ours == vllm_chain(ids, block_size, "sha256", "salt", lora, tuple(media)), media
    one = BlockHasher(block_size).chain(ids, media=[("a" * 64, 40, 81)])
    other = BlockHasher(block_size).chain(ids, media=[("d" * 64, 40, 81)])
    first = 40 // block_size
    assert one[:first] == other[:first] and all(x != y for x, y in zip(one[first:], other[first:]))
    key = PrefixKey(BlockHasher(block_size))
    assert key.key(ids, media=[("a" * 64, 40, 81)]) != key.key(ids, media=[("d" * 64, 40, 81)])
    assert key.key(ids, media=[("a" * 64, 40, 81)]) == key.key(ids, media=[("a" * 64, 40, 81)])
