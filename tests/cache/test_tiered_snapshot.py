"""Snapshots of a cache with a host-memory tier: its runs are saved and put back (prefixcache.cache.snapshot.host).

A 4-block device pool of 4-token blocks: a 12-token document is demoted to host by a 16-token one, the cache is saved
and loaded into a new cache, and the next request for the document finds all 12 tokens, counted as host hits, with the
K/V that was written for them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash
from test_host_tier import BS, DOC, OTHER, SHAPE, kv_rows, make_cache, run

from prefixcache import KVBlockPool, RadixCache, SnapshotCorruptError, SnapshotError
from prefixcache.cache.host import make_host_pool
from prefixcache.cache.snapshot.tree import CURRENT, MANIFEST

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")


def saved_with_document_on_host(folder: Path) -> RadixCache:
    cache = make_cache(device_blocks=4, host_blocks=8)
    run(cache, DOC)
    run(cache, OTHER)  # fills the device pool: the document's 3 blocks are demoted
    assert cache.cached_sequences() == [OTHER] and cache.stats().host_used_blocks == 3
    summary = cache.save(folder)
    assert (summary.num_tokens, summary.num_blocks) == (16, 4)
    assert (summary.host_runs, summary.host_tokens, summary.host_blocks) == (1, 12, 3)
    # Both tiers' K/V: 7 blocks of 4 tokens, 2 layers, K and V, 1 head of 3 floats.
    assert summary.kv_bytes == 7 * BS * 2 * 2 * 3 * 4
    return cache


def load(folder: Path, device_blocks: int = 4, host_blocks: int | None = 8) -> tuple[RadixCache, object]:
    pool = KVBlockPool(device_blocks, BS, device="cpu", **SHAPE)
    cache = RadixCache(pool, host_pool=None if host_blocks is None else make_host_pool(pool, host_blocks))
    summary = cache.restore(folder)
    cache.check_invariants()
    return cache, summary


def test_a_document_on_host_survives_a_restart_and_is_found_whole(tmp_path: Path) -> None:
    old = saved_with_document_on_host(tmp_path)
    old_rows = old.host_pool.kv[:, :, torch.from_numpy(next(iter(old._host.runs.values())).block_ids)].clone()

    cache, summary = load(tmp_path)

    assert (summary.num_tokens, summary.host_runs, summary.host_tokens, summary.host_blocks) == (16, 1, 12, 3)
    assert (summary.skipped_host_runs, summary.skipped_host_tokens) == (0, 0)
    stats = cache.stats()
    assert (stats.cached_tokens, stats.host_used_blocks, stats.demoted_blocks, stats.promoted_blocks) == (16, 3, 0, 0)
    host_run = next(iter(cache._host.runs.values()))
    assert torch.equal(cache.host_pool.kv[:, :, torch.from_numpy(host_run.block_ids)], old_rows)
    lease = run(cache, DOC + [999])  # checks every cached row against the K/V written before the restart
    assert (lease.num_cached_tokens, lease.num_host_tokens) == (12, 12)
    stats = cache.stats()
    assert (stats.hit_tokens, stats.host_hit_tokens, stats.device_hit_tokens, stats.promoted_blocks) == (12, 12, 0, 3)


def test_a_smaller_host_tier_keeps_the_head_of_the_run(tmp_path: Path) -> None:
    saved_with_document_on_host(tmp_path)

    cache, summary = load(tmp_path, host_blocks=2)

    assert (summary.host_runs, summary.host_tokens, summary.skipped_host_runs, summary.skipped_host_tokens) == (
        1,
        8,
        0,
        4,
    )
    lease = run(cache, DOC + [999])
    assert (lease.num_cached_tokens, lease.num_host_tokens) == (8, 8)


def test_a_cache_without_a_host_tier_drops_the_host_runs_and_counts_them(tmp_path: Path) -> None:
    saved_with_document_on_host(tmp_path)

    cache, summary = load(tmp_path, host_blocks=None)

    assert (summary.num_tokens, summary.host_runs, summary.skipped_host_runs, summary.skipped_host_tokens) == (
        16,
        0,
        1,
        12,
    )
    assert cache.match(DOC).num_tokens == 0 and cache.match(OTHER).num_tokens == 16


def test_the_most_recently_demoted_runs_are_kept_first(tmp_path: Path) -> None:
    cache = make_cache(device_blocks=4, host_blocks=8)
    first, second = [7] * 8, [8] * 8
    run(cache, first)
    run(cache, OTHER)  # demotes first (2 blocks)
    run(cache, second)  # demotes 2 of OTHER's blocks
    cache.evict(4)  # the rest: OTHER's remaining 2 blocks (older), then second
    keys = list(cache._host.runs)
    assert cache.stats().host_used_blocks == 8
    cache.save(tmp_path)

    loaded, summary = load(tmp_path, host_blocks=4)

    assert list(loaded._host.runs) == keys[len(keys) - len(loaded._host.runs) :]
    assert summary.host_blocks == 4 and summary.skipped_host_tokens == 4 * BS
    assert run(loaded, second + [1]).num_host_tokens == 8


def test_restoring_into_a_host_tier_that_holds_runs_is_refused(tmp_path: Path) -> None:
    saved_with_document_on_host(tmp_path)
    cache = make_cache(device_blocks=4, host_blocks=8)
    run(cache, list(range(50, 62)))
    cache.evict_all()
    before = cache.stats()

    with pytest.raises(SnapshotError, match="empty host tier"):
        cache.restore(tmp_path)

    assert cache.stats() == before
    cache.check_invariants()
    summary = cache.restore(tmp_path, replace=True)  # replace drops the host runs first
    assert (summary.host_runs, cache.stats().host_used_blocks) == (1, 3)
    assert cache.match(list(range(50, 62))).num_tokens == 0
    cache.check_invariants()


def test_a_malformed_host_run_is_refused_and_nothing_is_loaded(tmp_path: Path) -> None:
    saved_with_document_on_host(tmp_path)
    version = tmp_path / (tmp_path / CURRENT).read_text().strip()
    document = json.loads((version / MANIFEST).read_text())
    manifest = document["manifest"]
    manifest["host_runs"][0]["blocks"] = [0, 1, 99]  # outside the saved blocks; re-checksummed, so only this is wrong
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    document["checksum"]["xxh3_128"] = xxhash.xxh3_128_hexdigest(body)
    (version / MANIFEST).write_text(json.dumps(document))
    pool = KVBlockPool(4, BS, device="cpu", **SHAPE)
    cache = RadixCache(pool, host_pool=make_host_pool(pool, 8))

    with pytest.raises(SnapshotCorruptError, match="host run"):
        cache.restore(tmp_path)

    stats = cache.stats()
    assert (stats.cached_tokens, stats.used_blocks, stats.host_used_blocks) == (0, 0, 0)
    cache.check_invariants()


def test_a_damaged_host_kv_file_is_refused(tmp_path: Path) -> None:
    saved_with_document_on_host(tmp_path)
    version = tmp_path / (tmp_path / CURRENT).read_text().strip()
    kv_file = version / "kv.safetensors"
    data = bytearray(kv_file.read_bytes())
    data[-1] ^= 0xFF
    kv_file.write_bytes(bytes(data))

    with pytest.raises(SnapshotCorruptError):
        load(tmp_path)


def test_saved_host_rows_are_the_rows_written(tmp_path: Path) -> None:
    saved_with_document_on_host(tmp_path)
    cache, _ = load(tmp_path)
    host_run = next(iter(cache._host.runs.values()))
    kv = cache.host_pool.kv[:, :, torch.from_numpy(host_run.block_ids)].flatten(2, 3)
    assert torch.equal(kv, kv_rows(DOC))


def test_a_refused_device_restore_leaves_the_host_tier_empty(tmp_path: Path) -> None:
    saved_with_document_on_host(tmp_path)
    cache = make_cache(device_blocks=4, host_blocks=8)
    run(cache, list(range(50, 58)))  # on the device: the cache is not empty
    before = cache.stats()

    with pytest.raises(SnapshotError, match="empty cache"):
        cache.restore(tmp_path)

    assert cache.stats() == before and before.host_used_blocks == 0
    cache.check_invariants()


def test_a_metadata_only_cache_saves_and_restores_its_host_runs(tmp_path: Path) -> None:
    pool = KVBlockPool(4, BS)
    cache = RadixCache(pool, host_pool=make_host_pool(pool, 8))
    for tokens in (DOC, OTHER):
        lease = cache.acquire(tokens, num_tokens=len(tokens))
        cache.commit(lease, tokens)
    saved = cache.save(tmp_path)
    assert (saved.host_tokens, saved.kv_bytes) == (12, 0)

    new_pool = KVBlockPool(4, BS)
    loaded = RadixCache.load(tmp_path, new_pool, host_pool=make_host_pool(new_pool, 8))

    lease = loaded.acquire(DOC + [1], num_tokens=13)
    assert (lease.num_cached_tokens, lease.num_host_tokens) == (12, 12)
    loaded.release(lease)
    loaded.check_invariants()
