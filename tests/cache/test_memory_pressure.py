"""Issue 11's scenarios, with their numbers: evict only what is needed, never for a request that cannot fit, never
pin two copies of one block, count refused requests honestly."""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache import CapacityError, KVBlockPool, OutOfBlocksError, PoolBusyError, RadixCache
from prefixcache.cache.events import BlockIndex, BlockRemoved, block_hashes
from prefixcache.testing import InjectedFault, assert_quiescent, fail_on_call, snapshot

BS = 16


def tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def cache_sequence(cache: RadixCache, seq: list[int], namespace: str | None = None) -> None:
    lease = cache.acquire(seq, namespace, num_tokens=len(seq))
    cache.commit(lease, seq)


def test_evicting_one_block_of_a_cached_document_frees_exactly_its_last_block() -> None:
    cache = RadixCache(KVBlockPool(64, BS))
    doc = tokens(1000)
    cache_sequence(cache, doc)
    assert cache.stats().free_blocks == 1  # 63 blocks hold the document
    result = cache.evict(1)
    assert (result.num_blocks, result.num_nodes, result.num_tokens) == (1, 0, 8)
    assert cache.stats().free_blocks == 2
    cache.check_invariants()
    lease = cache.acquire(doc, num_tokens=len(doc))
    assert lease.num_cached_tokens == 992  # 62 full blocks are still cached
    cache.release(lease)
    assert_quiescent(cache)


def test_leaf_granularity_still_frees_the_whole_leaf() -> None:
    cache = RadixCache(KVBlockPool(64, BS), eviction_granularity="leaf")
    doc = tokens(1000)
    cache_sequence(cache, doc)
    result = cache.evict(1)
    assert (result.num_blocks, result.num_nodes, result.num_tokens) == (63, 1, 1000)
    assert cache.acquire(doc).num_cached_tokens == 0


def test_block_eviction_reaches_into_the_parent_once_a_leaf_is_gone() -> None:
    cache = RadixCache(KVBlockPool(64, BS))
    shared = tokens(64, 1)
    cache_sequence(cache, shared)
    cache_sequence(cache, shared + tokens(32, 2))  # a leaf of 2 blocks under a node of 4
    result = cache.evict(3)
    assert (result.num_blocks, result.num_nodes, result.num_tokens) == (3, 1, 48)
    assert cache.cached_sequences() == [shared[:48]]
    cache.check_invariants()


def test_block_removed_events_name_exactly_the_freed_blocks() -> None:
    cache = RadixCache(KVBlockPool(64, BS))
    seen = BlockIndex()
    removed: list[BlockRemoved] = []
    cache.subscribe(seen)
    cache.subscribe(lambda event: removed.append(event) if isinstance(event, BlockRemoved) else None)
    doc = tokens(100)
    cache_sequence(cache, doc)
    cache.evict(2)  # blocks 5 and 6: block 6 is partial (positions 96..99), so only block 5 was ever announced
    expected = block_hashes(doc, BS, None)
    assert [e.block_hashes for e in removed] == [(expected[5],)]
    assert seen.hashes == {(None, h) for h in expected[:5]}


def test_a_request_that_cannot_fit_evicts_nothing_and_names_the_cause() -> None:
    cache = RadixCache(KVBlockPool(32, BS))
    system = tokens(100, 1)
    cache_sequence(cache, system)  # 7 blocks, unlocked
    running = cache.acquire(tokens(336, 2), num_tokens=336)  # 21 blocks: 4 free + 7 evictable are left
    before = snapshot(cache, [None])
    with pytest.raises(PoolBusyError) as raised:
        cache.acquire(tokens(180, 3), num_tokens=180)  # 12 blocks
    error = raised.value
    assert (error.needed_blocks, error.free_blocks, error.evictable_blocks) == (12, 4, 7)
    assert (error.owned_blocks, error.locked_blocks, error.pool_blocks) == (21, 0, 32)
    assert "nothing was evicted" in str(error)
    after = snapshot(cache, [None])
    assert after.sequences == before.sequences and after.free_block_ids == before.free_block_ids
    assert after.stats.query_tokens == before.stats.query_tokens
    assert after.stats.rejected_requests == before.stats.rejected_requests + 1
    follower = system + tokens(10, 4)
    lease = cache.acquire(follower, num_tokens=len(follower))
    assert lease.num_cached_tokens == 100
    cache.release(lease)
    cache.release(running)
    assert_quiescent(cache)


def test_reserve_for_decode_growth_checks_feasibility_before_evicting() -> None:
    cache = RadixCache(KVBlockPool(10, BS))
    cache_sequence(cache, tokens(32, 1))  # 2 blocks, evictable
    other = cache.acquire(tokens(32, 3), num_tokens=32)  # 2 blocks
    lease = cache.acquire(tokens(64, 2), num_tokens=64)  # 4 blocks: 2 free + 2 evictable left
    before = snapshot(cache, [None])
    with pytest.raises(PoolBusyError):
        cache.reserve(lease, 64 + 5 * BS)
    assert snapshot(cache, [None]).sequences == before.sequences
    cache.reserve(lease, 64 + 4 * BS)
    assert cache.stats().free_blocks == 0
    cache.release(lease)
    cache.release(other)
    assert_quiescent(cache)


def test_a_prompt_that_fits_an_empty_pool_is_served_whatever_was_cached_before() -> None:
    cache = RadixCache(KVBlockPool(10, BS))
    prompt = tokens(160, 5)
    cache_sequence(cache, prompt[:20])
    cache_sequence(cache, prompt[:40])
    cache.check_invariants()
    assert cache.stats().used_blocks == 3  # the seam at token 20 keeps one copy of block 1, not two
    for _ in range(3):
        lease = cache.acquire(prompt, num_tokens=len(prompt))
        assert lease.num_cached_tokens == 40
        assert len(lease.block_table) == 10
        cache.commit(lease, prompt)
        cache.check_invariants()
        cache.evict_all()
        cache_sequence(cache, prompt[:20])
        cache_sequence(cache, prompt[:40])
    stats = cache.stats()
    assert stats.rejected_requests == 0
    assert_quiescent(cache)


def test_a_seam_whose_parent_copy_is_locked_by_a_running_request_is_healed_once_it_finishes() -> None:
    cache = RadixCache(KVBlockPool(10, BS))
    prompt = tokens(160, 5)
    cache_sequence(cache, prompt[:20])
    holder = cache.acquire(prompt[:20] + [7] * 20, num_tokens=40)  # extends block 1 in place
    lock = cache.lock(cache.match(prompt[:20]))  # pins the parent's copy of block 1
    cache_sequence(cache, prompt[:40])  # block 1 is being written by the holder: this one copies it
    assert cache.stats().used_blocks == 4 + 1  # two copies of block 1 while pinned, plus the holder's block 2
    cache.unlock(lock)
    cache.release(holder)
    assert cache.stats().used_blocks == 4
    lease = cache.acquire(prompt, num_tokens=len(prompt))
    assert lease.num_cached_tokens == 40
    cache.commit(lease, prompt)
    assert cache.stats().used_blocks == 10
    assert_quiescent(cache)


def test_refused_requests_count_as_rejected_not_as_queries() -> None:
    cache = RadixCache(KVBlockPool(4, BS))
    cache_sequence(cache, tokens(40, 1))
    before = cache.stats()
    with pytest.raises(CapacityError):
        cache.acquire(tokens(40, 1) + tokens(40, 2), num_tokens=80)  # 5 blocks > 4: never fits
    running = cache.acquire(tokens(48, 3), num_tokens=48)
    with pytest.raises(PoolBusyError):
        cache.acquire(tokens(40, 1) + [1], num_tokens=41)
    after = cache.stats()
    assert after.rejected_requests == 2
    assert after.query_tokens == before.query_tokens + 48
    assert after.window_requests == before.window_requests + 1
    cache.release(running)
    assert_quiescent(cache)


def test_an_exception_after_the_lock_in_acquire_leaves_no_lock_held() -> None:
    cache = RadixCache(KVBlockPool(16, BS))
    cache_sequence(cache, tokens(40, 1))
    prompt = tokens(40, 1) + tokens(10, 2)  # matches 40 tokens: ends inside block 2, so a copy-on-write
    with fail_on_call(cache.pool, "incref", 1), pytest.raises(InjectedFault):
        cache.acquire(prompt)
    assert_quiescent(cache)


def test_copy_on_write_whose_only_block_is_its_source_takes_the_source_over() -> None:
    cache = RadixCache(KVBlockPool(4, BS))
    cache_sequence(cache, tokens(44, 1))
    running = cache.acquire(tokens(16, 9), num_tokens=16)
    lease = cache.acquire(tokens(40, 1) + [1001])  # leaves the cached sequence inside its last block: a copy
    # No free block; the only evictable one is the partial block itself, so admission takes it over, no copy.
    assert lease.num_cached_tokens == 40 and lease.num_copied_tokens == 8
    cache.release(lease)
    cache.release(running)
    assert_quiescent(cache)


def test_out_of_blocks_is_still_the_base_of_the_new_error() -> None:
    assert issubclass(PoolBusyError, CapacityError) and issubclass(PoolBusyError, OutOfBlocksError)


def test_a_seam_below_a_split_inside_one_block_heals_the_whole_sharing_chain() -> None:
    cache = RadixCache(KVBlockPool(8, 4))
    cache_sequence(cache, [1, 2, 3, 4, 5, 6])
    cache_sequence(cache, [1, 2, 3, 4, 5, 9])  # splits at 5: [4,5) and [5,6) share block 1
    assert cache.stats().used_blocks == 3
    cache_sequence(cache, [1, 2, 3, 4, 5, 6, 7])  # a new leaf at 6 with its own copy of block 1
    cache.check_invariants()
    assert cache.stats().used_blocks == 3  # both holders of the old copy switched to the new one; the old is free
    lease = cache.acquire([1, 2, 3, 4, 5, 6, 7, 8], num_tokens=8)
    assert lease.num_cached_tokens == 7
    cache.release(lease)
    assert_quiescent(cache)
