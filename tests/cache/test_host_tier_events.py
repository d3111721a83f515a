"""KV events of a cache with a host-memory tier: a BlockIndex fed every event mirrors both tiers after every step.

The mirror is checked with ``cache.check_invariants(index)``: the index's ``"GPU"`` blocks are exactly the device
tree's full blocks (hashes recomputed from its tokens) and its ``"CPU"`` blocks exactly the announced host runs.  The
index is strict, and a listener's exception is swallowed by the cache, so each test also asserts that the index never
raised (a block stored twice in one medium, or removed before it was stored).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_host_tier import DOC, OTHER, make_cache, run

from prefixcache import KVBlockPool, RadixCache
from prefixcache.cache.events import BlockIndex, BlockRemoved, BlockStored, KVEvent, block_hashes, namespace_root_hash
from prefixcache.cache.host import make_host_pool


class Mirror:
    """A strict BlockIndex that records every event and every contradiction instead of letting the cache log it."""

    def __init__(self) -> None:
        self.index = BlockIndex()
        self.events: list[KVEvent] = []
        self.errors: list[str] = []

    def __call__(self, event: KVEvent) -> None:
        self.events.append(event)
        try:
            self.index(event)
        except AssertionError as error:
            self.errors.append(str(error))

    def check(self, cache: RadixCache) -> None:
        assert self.errors == []
        cache.check_invariants(self.index)


def listened(device_blocks: int = 4, host_blocks: int = 8) -> tuple[RadixCache, Mirror]:
    mirror = Mirror()
    return make_cache(device_blocks, host_blocks, event_listener=mirror), mirror


def hashes(tokens: list[int]) -> tuple[int, ...]:
    return tuple(block_hashes(tokens, 4))


def test_a_promoted_document_is_announced_on_the_device_with_its_chain() -> None:
    cache, mirror = listened()
    run(cache, DOC)
    mirror.check(cache)
    run(cache, OTHER)  # demotes the document
    mirror.check(cache)
    assert mirror.index.media[(None, hashes(DOC)[0])] == {"CPU"}
    mirror.events.clear()
    lease = run(cache, DOC + [999])  # promotes it back
    assert lease.num_host_tokens == 12
    mirror.check(cache)
    stored = [e for e in mirror.events if isinstance(e, BlockStored) and e.medium == "GPU"]
    # As the commit path announces a leaf: its chain from the namespace root, its tokens, the block size.
    assert stored[0] == BlockStored(None, hashes(DOC), namespace_root_hash(None), 0, tuple(DOC), 4, "GPU")
    removed = [e for e in mirror.events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert [set(e.block_hashes) for e in removed] == [set(hashes(DOC))]
    assert mirror.events.index(stored[0]) < mirror.events.index(removed[0])  # copied in first, then freed


def test_a_run_dropped_by_the_eviction_that_demoted_it_is_announced_stored_then_removed() -> None:
    # Two 2-block leaves evicted at once into a 3-block host: demoting the second drops the first's tail.
    mirror = Mirror()
    pool = KVBlockPool(4, 2, device="cpu", num_layers=0)
    cache = RadixCache(pool, host_pool=make_host_pool(pool, 3), event_listener=mirror)
    for tokens in ([1, 2, 3, 4], [5, 6, 7, 8]):
        cache.commit(cache.acquire(tokens, num_tokens=4), tokens)
    mirror.check(cache)
    mirror.events.clear()
    cache.evict(4)
    assert cache.stats().host_dropped_blocks == 1
    mirror.check(cache)
    dropped = block_hashes([1, 2, 3, 4], 2)[1]
    kinds = [(type(e).__name__, e.medium) for e in mirror.events if dropped in e.block_hashes]
    assert kinds == [("BlockRemoved", "GPU"), ("BlockStored", "CPU"), ("BlockRemoved", "CPU")]


def test_evicting_everything_leaves_no_device_block_in_the_index() -> None:
    cache, mirror = listened()
    run(cache, DOC)
    run(cache, OTHER)
    cache.evict_all()
    mirror.check(cache)
    assert not any("GPU" in media for media in mirror.index.media.values())


def test_a_restored_snapshot_announces_its_device_blocks_and_promotes_its_host_runs_onto_the_device(
    tmp_path: Path,
) -> None:
    pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")
    old, _ = listened()
    run(old, DOC)
    run(old, OTHER)
    old.save(tmp_path)
    mirror = Mirror()
    pool = KVBlockPool(4, 4, device="cpu", num_layers=2, num_kv_heads=1, head_dim=3)
    cache = RadixCache.load(tmp_path, pool, host_pool=make_host_pool(pool, 8), event_listener=mirror)
    mirror.check(cache)
    assert {h for (_, h), media in mirror.index.media.items() if "GPU" in media} == set(hashes(OTHER))
    lease = run(cache, DOC + [999])
    assert lease.num_host_tokens == 12
    mirror.check(cache)


def test_restoring_over_a_listened_cache_keeps_the_index_in_step(tmp_path: Path) -> None:
    pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")
    cache, mirror = listened()
    run(cache, DOC)
    run(cache, OTHER)
    cache.save(tmp_path)
    run(cache, DOC + [5])
    mirror.check(cache)
    cache.restore(tmp_path, replace=True)
    mirror.check(cache)
    run(cache, DOC + [6])
    mirror.check(cache)


def test_a_block_the_device_recomputes_leaves_the_host_and_each_host_block_is_removed_once() -> None:
    mirror = Mirror()
    pool = KVBlockPool(8, 1, device="cpu", num_layers=0)
    cache = RadixCache(pool, host_pool=make_host_pool(pool, 64), event_listener=mirror)
    seq = [1, 2, 3, 4, 5]
    cache.insert(seq, cache.allocate(5))
    cache.evict(3)  # blocks 2..4 go to host as one run
    # The device computes them again (a request admitted before the demotion): the host's copies go, announced.
    cache.insert(seq, cache.allocate(5))
    assert cache.stats().host_used_blocks == 0
    mirror.check(cache)
    cache.evict(2)  # blocks 3..4 go to host again
    assert cache.stats().host_used_blocks == 2
    mirror.check(cache)
    cache.evict_all()
    mirror.check(cache)
    hashes_on_host = {h for (_, h), media in mirror.index.media.items() if media == {"CPU"}}
    assert hashes_on_host == set(block_hashes(seq, 1))
    # Promotes nothing (no acquire): the device computes blocks 0..3 again, so only block 4 stays on host.
    cache.insert(seq[:4] + [9], cache.allocate(5))
    assert cache.stats().host_used_blocks == 1
    mirror.check(cache)
    # Drop every host run: each block stored on host is removed from it once per time it was stored.
    cache._host.clear()
    mirror.check(cache)
    removed = [h for e in mirror.events if isinstance(e, BlockRemoved) and e.medium == "CPU" for h in e.block_hashes]
    stored = [h for e in mirror.events if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes]
    assert sorted(removed) == sorted(stored) and set(removed) == set(block_hashes(seq, 1))
