"""Specification of snapshots of a cache that keeps recurrent states (prefixcache.cache.snapshot.states): the states
kept on the saved nodes come back with them, value included, checked as the K/V are; a restored cache resumes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixcache import KVBlockPool, RadixCache, StateMarker
from prefixcache.errors import SnapshotCorruptError

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")

BS = 4
SEQ = list(range(100, 120))


def make_cache(max_state_bytes: int | None = 100, num_blocks: int = 64) -> RadixCache:
    pool = KVBlockPool(num_blocks, BS, num_layers=1, num_kv_heads=1, head_dim=2)
    if max_state_bytes is None:
        return RadixCache(pool)
    return RadixCache(pool, resume_states=True, max_state_bytes=max_state_bytes)


def run(cache: RadixCache, prompt: list[int], answer: list[int], nbytes: int = 1) -> None:
    lease = cache.acquire(prompt, num_tokens=len(prompt))
    for point in lease.state_points:  # as the engine does: a state where its prefill passes a branch mark
        assert cache.put_state(lease, point, StateMarker(nbytes))
    cache.insert_prefix(lease, prompt, state=StateMarker(nbytes))
    cache.reserve(lease, len(prompt) + len(answer))
    cache.commit(lease, prompt + answer, state=StateMarker(nbytes))


def saved(tmp_path: Path) -> Path:
    cache = make_cache()
    run(cache, SEQ[:10], SEQ[10:14])
    run(cache, SEQ[:6] + [7, 7, 7], [8, 8])  # parts at 6: a state there from now on (a branch mark)
    summary = cache.save(tmp_path / "snap")
    assert (summary.num_states, summary.state_bytes) == (5, 5)  # 6, 9, 10, 11 and 14
    return tmp_path / "snap"


def test_a_restored_cache_resumes_the_saved_states(tmp_path: Path) -> None:
    loaded = RadixCache.load(saved(tmp_path), make_cache().pool, resume_states=True, max_state_bytes=100)
    assert loaded.state_positions(SEQ[:14]) == [6, 10, 14]
    lease = loaded.acquire(SEQ[:18])
    assert (lease.num_matched_tokens, lease.num_cached_tokens) == (14, 14)
    loaded.release(lease)
    assert loaded.stats().num_states == 5
    loaded.check_invariants()


def test_a_smaller_state_budget_keeps_the_most_valuable_states(tmp_path: Path) -> None:
    pool = make_cache().pool
    loaded = RadixCache.load(saved(tmp_path), pool, resume_states=True, max_state_bytes=2)
    # By tokens resumed per byte: the deepest two, 14 and 11.
    assert loaded.state_positions(SEQ[:14]) == [14] and loaded.state_positions(SEQ[:6] + [7, 7, 7, 8, 8]) == [11]
    loaded.check_invariants()


def test_a_cache_that_keeps_no_states_restores_the_kv_alone(tmp_path: Path) -> None:
    plain = RadixCache.load(saved(tmp_path), make_cache(None).pool)
    assert (plain.stats().cached_tokens, plain.stats().num_states) == (19, 0)  # 14 tokens and a branch of 5
    plain.check_invariants()


def test_a_state_record_outside_its_node_is_refused_before_the_cache_changes(tmp_path: Path) -> None:
    folder = saved(tmp_path)
    version = folder / (folder / "CURRENT").read_text().strip()
    document = json.loads((version / "snapshot.json").read_text())
    node = next(n for n in document["manifest"]["nodes"] if n.get("states"))
    node["states"][0]["position"] = node["start"]  # a state must stand after at least one of its node's tokens
    from prefixcache.cache.snapshot.folder import canonical, digest

    document["checksum"]["xxh3_128"] = digest(canonical(document["manifest"]))
    (version / "snapshot.json").write_text(json.dumps(document))
    cache = make_cache()
    run(cache, [1, 2, 3], [4])
    with pytest.raises(SnapshotCorruptError, match="malformed state"):
        cache.restore(folder, replace=True)
    assert cache.stats().num_states == 2 and cache.stats().cached_tokens == 4
    cache.check_invariants()
