"""The pieces a snapshot writer thread works from: a capture that later changes do not reach, the K/V file written
from views of the captured tensors, the manifest encoded an item at a time, block numbering in NumPy, and the
pre-touched staging buffer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import RadixCache
from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.snapshot import tree as snapshot
from prefixcache.cache.snapshot import writer as snapshot_write
from prefixcache.cache.snapshot.folder import canonical, canonical_parts
from prefixcache.cache.snapshot.staging import StagingBuffer, staging_for

safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs: pip install 'prefixcache[snapshot]'")

SEQUENCES = [list(range(1, 11)), list(range(1, 6)) + [40, 41, 42], list(range(50, 57))]


def filled(make_cache: Callable[..., RadixCache], put) -> RadixCache:
    cache = make_cache(num_blocks=16, block_size=4, num_layers=2)
    for tokens in SEQUENCES:
        put(cache, tokens)
    cache.pool.kv.copy_(torch.randn_like(cache.pool.kv))
    return cache


def sequence_kv(cache: RadixCache) -> dict[tuple[int, ...], torch.Tensor]:
    """Per cached sequence, the K/V of its positions: ``[num_layers, 2, tokens, heads, dim]``."""
    match_kv = {}
    for tokens in cache.cached_sequences():
        match = cache.match(tokens)
        blocks = torch.as_tensor(match.block_table.astype(np.int64))
        kv = cache.pool.kv.index_select(2, blocks).flatten(2, 3)[:, :, : len(tokens)]
        match_kv[tuple(tokens)] = kv.clone()
    return match_kv


def test_a_capture_is_what_was_cached_though_its_blocks_are_rewritten_before_the_write(
    make_cache, put, tmp_path: Path
) -> None:
    cache = filled(make_cache, put)
    expected = sequence_kv(cache)
    captured = cache.capture()

    cache.evict_all()
    for tokens in (list(range(100, 116)), list(range(200, 216)), list(range(300, 316))):
        put(cache, tokens)  # the freed blocks, lowest ids first
    cache.pool.kv.fill_(7.0)
    snapshot_write.write(captured, tmp_path / "snap")

    loaded = RadixCache.load(tmp_path / "snap", KVBlockPool(16, 4, num_layers=2, num_kv_heads=2, head_dim=3))
    loaded.check_invariants()
    assert sorted(loaded.cached_sequences()) == sorted(map(list, expected))
    for tokens, kv in sequence_kv(loaded).items():
        assert torch.equal(kv, expected[tokens]), tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_streamed_k_v_file_is_a_safetensors_file_of_the_tensors(dtype: torch.dtype) -> None:
    tensors = {"kv": torch.randn(2, 2, 5, 4, 2, 3).to(dtype), "host_kv": torch.randn(2, 2, 3, 4, 2, 3).to(dtype)}

    parts = snapshot_write.kv_file_parts(tensors, {"format": snapshot.FORMAT})
    blob = b"".join(bytes(part) for part in parts)

    header_bytes = int.from_bytes(blob[:8], "little")
    assert header_bytes % 8 == 0
    loaded = safetensors_torch.load(blob)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())


def test_the_k_v_file_is_written_in_views_of_at_most_the_chunk_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot_write, "WRITE_CHUNK_BYTES", 64)
    tensor = torch.arange(100, dtype=torch.float32)  # 400 bytes

    parts = snapshot_write.kv_file_parts({"kv": tensor}, {})

    assert [len(part) for part in parts[1:]] == [64] * 6 + [16]
    assert all(np.shares_memory(part, tensor.numpy()) for part in parts[1:])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.text(max_size=6), JSON, max_size=5),
    st.lists(st.dictionaries(st.text(max_size=6), JSON, max_size=4), max_size=4),
)
def test_the_manifest_encoded_item_by_item_is_its_canonical_json(manifest: dict, nodes: list) -> None:
    manifest = {**manifest, "nodes": nodes, "host_runs": nodes[::-1]}
    assert b"".join(canonical_parts(manifest)) == canonical(manifest)


def test_a_captured_manifest_with_arrays_encodes_as_its_lists(make_cache, put) -> None:
    captured = filled(make_cache, put).capture().manifest
    listed = {
        **captured,
        "nodes": [
            {**node, "tokens": node["tokens"].tolist(), "blocks": node["blocks"].tolist()} for node in captured["nodes"]
        ],
    }

    assert b"".join(canonical_parts(captured)) == canonical(listed)


def number_blocks_by_dict(node_blocks: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    index: dict[int, int] = {}
    numbered = [[index.setdefault(block, len(index)) for block in blocks] for blocks in node_blocks]
    return list(index), numbered


@given(st.lists(st.lists(st.integers(0, 30), max_size=6), max_size=8))
def test_blocks_are_numbered_in_order_of_first_appearance(node_blocks: list[list[int]]) -> None:
    saved, numbered = snapshot.number_blocks([np.array(blocks, dtype=np.int32) for blocks in node_blocks])

    assert (saved.tolist(), [blocks.tolist() for blocks in numbered]) == number_blocks_by_dict(node_blocks)


def test_the_staging_buffer_hands_out_its_memory_then_new_memory() -> None:
    staging = StagingBuffer(10, torch.float32)

    first = staging.take((2, 3), torch.float32)
    second = staging.take((2, 2), torch.float32)
    beyond = staging.take((1,), torch.float32)
    other_dtype = StagingBuffer(10, torch.float32).take((2,), torch.float16)

    assert staging.num_free_elements == 0
    assert first.data_ptr() + 6 * 4 == second.data_ptr()
    assert not np.shares_memory(beyond.numpy(), first.numpy())
    assert other_dtype.dtype == torch.float16 and other_dtype.shape == (2,)


def test_staging_covers_the_blocks_in_use_with_headroom(make_cache, put) -> None:
    cache = filled(make_cache, put)
    used = cache.pool.num_used_blocks
    per_block = cache.pool.kv[:, :, 0].numel()

    staging = staging_for(cache.pool)

    assert staging.num_free_elements == (used + -(-used // 4) + 1) * per_block
    assert staging_for(KVBlockPool(4, 4)) is None  # metadata only


@pytest.mark.parametrize("num_blocks", [0, 2, 64], ids=["none", "too_small", "ample"])
def test_a_capture_into_staging_of_any_size_saves_the_same(make_cache, put, tmp_path: Path, num_blocks: int) -> None:
    cache = filled(make_cache, put)
    expected = sequence_kv(cache)
    per_block = cache.pool.kv[:, :, 0].numel()

    captured = cache.capture(staging=StagingBuffer(num_blocks * per_block, torch.float32))
    snapshot_write.write(captured, tmp_path / "snap")

    loaded = RadixCache.load(tmp_path / "snap", KVBlockPool(16, 4, num_layers=2, num_kv_heads=2, head_dim=3))
    assert sequence_kv(loaded).keys() == expected.keys()
    assert all(torch.equal(kv, expected[tokens]) for tokens, kv in sequence_kv(loaded).items())


def test_a_pinned_staging_buffer_falls_back_to_pageable_memory_where_none_can_be_pinned() -> None:
    staging = StagingBuffer(8, torch.float32, pin=True)

    part = staging.take((2, 4), torch.float32)

    assert torch.equal(part, torch.zeros(2, 4)) and staging.num_free_elements == 0
