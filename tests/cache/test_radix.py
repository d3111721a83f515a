"""RadixCache: token-exact matching, splitting, block tables, copy-on-write, namespaces and stats."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from prefixcache import CacheStats, InsertResult, RadixCache
from prefixcache.errors import InvalidArgumentError, LockError

TEN = list(range(1, 11))


def test_match_is_token_exact_not_rounded_down_to_blocks(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, TEN)

    match = cache.match([1, 2, 3, 4, 5, 6, 99])

    assert match.num_tokens == 6
    assert len(match.block_table) == 2


def test_match_block_table_addresses_the_inserted_blocks(make_cache) -> None:
    cache = make_cache(block_size=4)
    blocks = cache.allocate(3)
    cache.insert(TEN, blocks)

    assert cache.match(TEN).block_table.tolist() == blocks.tolist()
    assert cache.match(TEN[:5]).block_table.tolist() == blocks[:2].tolist()
    assert cache.match(TEN).block_table.dtype == np.int32


def test_match_for_prefill_of_a_fully_cached_prompt_leaves_the_last_token(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, TEN[:8])

    assert cache.match(TEN[:8], for_prefill=True).num_tokens == 7
    assert cache.match(TEN[:8]).num_tokens == 8


def test_match_for_prefill_of_a_partly_cached_prompt_is_the_common_prefix(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, TEN[:8])

    assert cache.match([1, 2, 3, 99, 98], for_prefill=True).num_tokens == 3


def test_match_of_an_unknown_namespace_is_empty(make_cache) -> None:
    match = make_cache().match([1, 2, 3], "nobody")

    assert match.num_tokens == 0
    assert match.block_table.tolist() == []


def test_match_ending_mid_edge_does_not_split_the_node(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, TEN)

    cache.match([1, 2, 3, 4, 5, 6])

    assert cache.stats().num_nodes == 1
    assert cache.cached_sequences() == [TEN]
    cache.check_invariants()


def test_insert_splits_where_two_sequences_diverge(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, [1, 2, 3, 4, 5, 6])

    result = put(cache, [1, 2, 3, 7, 8])

    assert result == InsertResult(num_new_tokens=2, num_cached_tokens=3, num_released_blocks=0)
    assert sorted(cache.cached_sequences()) == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8]]
    assert cache.stats().num_nodes == 3
    assert cache.stats().cached_tokens == 3 + 3 + 2
    cache.check_invariants()


def test_insert_of_a_prefix_of_a_cached_sequence_adds_no_node(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, TEN)

    result = put(cache, TEN[:6])

    assert result == InsertResult(num_new_tokens=0, num_cached_tokens=6, num_released_blocks=2)
    assert cache.stats().num_nodes == 1
    assert cache.cached_sequences() == [TEN]


def test_insert_extending_a_leaf_hangs_the_suffix_below_it(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, TEN[:4])

    result = put(cache, TEN)

    assert result == InsertResult(num_new_tokens=6, num_cached_tokens=4, num_released_blocks=1)
    assert cache.cached_sequences() == [TEN]
    assert cache.stats().num_nodes == 2


def test_prompt_sharing_its_first_two_tokens_reuses_exactly_two(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, [5, 6, 7, 8])

    lease = cache.acquire([5, 6, 9, 10])

    assert lease.num_cached_tokens == 2
    assert cache.match([5, 6, 9, 10]).num_tokens == 2


def test_same_sequence_inserted_twice_adds_nothing_and_releases_all_its_blocks(make_cache, put) -> None:
    cache = make_cache(num_blocks=16, block_size=4)
    put(cache, TEN)
    free_before = cache.stats().free_blocks

    result = put(cache, TEN)

    assert result == InsertResult(num_new_tokens=0, num_cached_tokens=10, num_released_blocks=3)
    assert cache.stats().free_blocks == free_before == 13
    cache.check_invariants()


def test_insert_may_lead_with_blocks_of_a_locked_match(make_cache) -> None:
    cache = make_cache(block_size=4)
    tree_blocks = cache.allocate(2)
    cache.insert(TEN[:8], tree_blocks)
    handle = cache.lock(cache.match(TEN))
    own = cache.allocate(1)

    result = cache.insert(TEN, np.concatenate((tree_blocks, own)))
    cache.unlock(handle)

    assert result == InsertResult(num_new_tokens=2, num_cached_tokens=8, num_released_blocks=0)
    assert cache.match(TEN).block_table.tolist() == [*tree_blocks.tolist(), int(own[0])]
    cache.check_invariants()


def test_acquire_ending_mid_block_copies_that_block_into_an_owned_one(make_cache) -> None:
    cache = make_cache(block_size=4)
    tree_blocks = cache.allocate(3)
    cache.insert(TEN, tree_blocks)

    lease = cache.acquire([1, 2, 3, 4, 5, 6, 99])

    assert lease.num_cached_tokens == 6
    assert lease.num_copied_tokens == 6 % 4 == 2
    assert lease.first_owned_block == 1
    copy = int(lease.block_table[-1])
    assert lease.block_table[0] == tree_blocks[0]
    assert copy not in tree_blocks.tolist()
    assert cache.pool.ref_count(copy) == 1
    assert copy not in cache.pool.free_block_ids().tolist()
    cache.check_invariants()


def test_acquire_ending_on_a_block_boundary_copies_nothing(make_cache) -> None:
    cache = make_cache(block_size=4)
    tree_blocks = cache.allocate(3)
    cache.insert(TEN, tree_blocks)

    lease = cache.acquire([1, 2, 3, 4, 5, 6, 7, 8, 99])

    assert lease.num_cached_tokens == 8
    assert lease.num_copied_tokens == 0
    assert lease.first_owned_block == 2
    assert lease.block_table.tolist() == tree_blocks[:2].tolist()


def test_copy_on_write_copies_the_rows_and_never_writes_the_source(make_cache) -> None:
    cache = make_cache(block_size=4, num_layers=1)
    kv = cache.pool.kv
    tree_blocks = cache.allocate(3)
    for block in tree_blocks.tolist():
        kv[:, :, block] = torch.arange(kv[:, :, block].numel(), dtype=kv.dtype).reshape(kv[:, :, block].shape) + block
    cache.insert(TEN, tree_blocks)
    source = int(tree_blocks[1])
    source_rows = kv[:, :, source].clone()

    lease = cache.acquire([1, 2, 3, 4, 5, 6, 99])
    copy = int(lease.block_table[1])
    kv[:, :, copy, 2:] = -7.0

    assert torch.equal(kv[:, :, copy, :2], source_rows[:, :, :2])
    assert torch.equal(kv[:, :, source], source_rows)


def test_block_table_through_a_mid_block_split_uses_the_deeper_nodes_block(make_cache) -> None:
    cache = make_cache(block_size=4)
    tree_blocks = cache.allocate(2)
    cache.insert([1, 2, 3, 4, 5, 6], tree_blocks)
    branch = [1, 2, 3, 4, 5, 9, 10]
    lease = cache.acquire(branch)
    cache.reserve(lease, len(branch))
    copy = int(lease.block_table[1])
    cache.commit(lease, branch)

    assert cache.match(branch).block_table.tolist() == [int(tree_blocks[0]), copy]
    assert cache.match([1, 2, 3, 4, 5, 6]).block_table.tolist() == tree_blocks.tolist()
    assert cache.match([1, 2, 3, 4, 5]).block_table.tolist() == tree_blocks.tolist()
    cache.check_invariants()


def test_split_inside_a_block_shares_that_block_between_both_halves(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    tree_blocks = cache.allocate(3)
    cache.insert(TEN, tree_blocks)

    put(cache, [1, 2, 3, 4, 5, 6, 50])

    assert cache.pool.ref_count(int(tree_blocks[1])) == 2
    assert cache.match(TEN).block_table.tolist() == tree_blocks.tolist()


def test_namespaces_never_share_blocks(make_cache) -> None:
    cache = make_cache(block_size=4)
    blocks_a = cache.allocate(3)
    blocks_b = cache.allocate(3)

    cache.insert(TEN, blocks_a, "a")
    result_b = cache.insert(TEN, blocks_b, "b")

    assert result_b == InsertResult(num_new_tokens=10, num_cached_tokens=0, num_released_blocks=0)
    assert cache.match(TEN, "a").block_table.tolist() == blocks_a.tolist()
    assert cache.match(TEN, "b").block_table.tolist() == blocks_b.tolist()
    assert cache.stats().used_blocks == 6


def test_match_in_one_namespace_never_sees_another(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, TEN, "a")

    assert cache.match(TEN, "b").num_tokens == 0
    assert cache.match(TEN).num_tokens == 0
    assert cache.cached_sequences("b") == []
    assert cache.cached_sequences("a") == [TEN]


def test_commit_caches_prompt_and_generated_tokens_and_drops_the_lock(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, [1, 2, 3, 4, 5])
    lease = cache.acquire([1, 2, 3, 4, 5, 6])
    cache.reserve(lease, 9)

    result = cache.commit(lease, [1, 2, 3, 4, 5, 6, 7, 8, 9])

    assert result == InsertResult(num_new_tokens=4, num_cached_tokens=5, num_released_blocks=0)
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 9
    assert cache.stats().locked_tokens == 0
    cache.check_invariants()


def test_commit_after_another_request_cached_the_same_tokens_releases_the_duplicates(make_cache) -> None:
    cache = make_cache(block_size=4)
    first = cache.acquire(TEN)
    second = cache.acquire(TEN)
    cache.reserve(first, 10)
    cache.reserve(second, 10)
    cache.commit(first, TEN)

    result = cache.commit(second, TEN)

    assert result == InsertResult(num_new_tokens=0, num_cached_tokens=10, num_released_blocks=3)
    assert cache.stats().used_blocks == 3
    cache.check_invariants()


def test_release_frees_the_owned_blocks_and_caches_nothing(make_cache, put) -> None:
    cache = make_cache(num_blocks=16, block_size=4)
    put(cache, TEN)
    lease = cache.acquire([1, 2, 3, 4, 5, 6, 99])
    cache.reserve(lease, 12)

    cache.release(lease)

    assert cache.stats().free_blocks == 13
    assert cache.stats().locked_tokens == 0
    assert cache.cached_sequences() == [TEN]
    cache.check_invariants()


def test_a_match_whose_node_was_evicted_cannot_be_locked(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, TEN)
    match = cache.match(TEN)
    cache.evict_all()

    with pytest.raises(LockError, match="stale"):
        cache.lock(match)


def test_acquire_that_cannot_get_its_copy_block_recomputes_the_partial_rows(make_cache, put) -> None:
    cache = make_cache(num_blocks=2, block_size=4)
    put(cache, [1, 2, 3, 4, 5, 6, 7])
    handle = cache.lock(cache.match([1, 2, 3, 4, 5, 6, 7]))

    lease = cache.acquire([1, 2, 3, 4, 5, 6, 9])  # leaves [.., 7] inside block 1: rows 4, 5 need a copy

    assert (lease.num_cached_tokens, lease.num_copied_tokens, lease.first_owned_block) == (4, 0, 1)
    assert len(lease.block_table) == 1
    cache.check_invariants()
    cache.release(lease)
    assert cache.stats().locked_tokens == 7
    cache.unlock(handle)
    assert cache.stats().locked_tokens == 0
    cache.check_invariants()


def test_a_match_taking_all_of_a_partial_block_extends_it_in_place_without_a_free_block(make_cache, put) -> None:
    cache = make_cache(num_blocks=2, block_size=4)
    put(cache, [1, 2, 3, 4, 5, 6])
    handle = cache.lock(cache.match([1, 2, 3, 4, 5, 6]))
    tree_blocks = cache.match([1, 2, 3, 4, 5, 6]).block_table.tolist()

    lease = cache.acquire([1, 2, 3, 4, 5, 6, 9], num_tokens=8)

    assert (lease.num_cached_tokens, lease.num_copied_tokens, lease.first_owned_block) == (6, 0, 1)
    assert lease.block_table.tolist() == tree_blocks  # the tree's own block 1: rows 6, 7 are the request's
    cache.check_invariants()
    cache.commit(lease, [1, 2, 3, 4, 5, 6, 9, 8])
    assert cache.cached_sequences() == [[1, 2, 3, 4, 5, 6, 9, 8]]
    assert cache.stats().used_blocks == 2  # the new leaf shares block 1 with [5, 6]
    cache.unlock(handle)
    cache.check_invariants()


def test_an_extension_overtaken_inside_its_block_by_another_branch_commits_with_a_copy(make_cache, put) -> None:
    cache = make_cache(num_blocks=8, block_size=4, num_layers=1)
    put(cache, [1, 2, 3, 4, 5, 6])
    ext = cache.acquire([1, 2, 3, 4, 5, 6, 7, 9, 10], num_tokens=9)  # writes rows 6.. of block 1 in place
    other = cache.acquire([1, 2, 3, 4, 5, 6, 7, 20, 21], num_tokens=9)  # the block is taken: this one copies it
    assert (ext.num_copied_tokens, other.num_copied_tokens) == (0, 2)
    kv = cache.pool.kv
    for lease, tail in ((ext, [7, 9, 10]), (other, [7, 20, 21])):
        for pos, token in enumerate(tail, start=6):
            kv[:, :, int(lease.block_table[pos // 4]), pos % 4] = float(token)
    cache.commit(other, [1, 2, 3, 4, 5, 6, 7, 20, 21])
    ext_block = int(ext.block_table[1])

    # [.., 6, 7] is cached below [.., 6] now, inside block 1: the new leaf cannot share the node's block.
    result = cache.commit(ext, [1, 2, 3, 4, 5, 6, 7, 9, 10])

    assert (result.num_new_tokens, result.num_cached_tokens) == (2, 7)
    cache.check_invariants()
    assert sorted(cache.cached_sequences()) == [[1, 2, 3, 4, 5, 6, 7, 9, 10], [1, 2, 3, 4, 5, 6, 7, 20, 21]]
    match = cache.match([1, 2, 3, 4, 5, 6, 7, 9, 10, 0])
    assert match.num_tokens == 9 and int(match.block_table[1]) != ext_block  # the leaf's own copy
    assert (
        kv[0, 0, int(match.block_table[1]), 3, 0, 0].item() == 9.0
        and kv[0, 0, int(match.block_table[2]), 0, 0, 0].item() == 10.0
    )
    assert cache.match([1, 2, 3, 4, 5, 6]).block_table.tolist()[1] == ext_block  # the node keeps its block


def test_allocate_evicts_only_the_blocks_it_is_short_of(make_cache, put) -> None:
    cache = make_cache(num_blocks=4, block_size=4)
    put(cache, TEN)

    blocks = cache.allocate(2)

    assert len(blocks) == 2
    assert cache.cached_sequences() == [TEN[:8]]  # one block cut off the tail
    assert cache.stats().evicted_blocks == 1


def test_a_hundred_finished_requests_leave_nothing_locked_and_leak_no_block(make_cache) -> None:
    cache = make_cache(num_blocks=24, block_size=4)
    system_prompt = [7] * 8
    for i in range(100):
        prompt = [*system_prompt, 100 + i, i % 7, i % 5]
        lease = cache.acquire(prompt)
        assert lease.num_cached_tokens == (0 if i == 0 else 8)
        cache.reserve(lease, len(prompt) + 3)
        cache.commit(lease, [*prompt, 1, 2, 3])

    stats = cache.stats()
    assert stats.locked_tokens == 0
    assert stats.cached_tokens == stats.evictable_tokens > 0
    assert stats.evictions > 0
    cache.check_invariants()
    cache.evict_all()
    assert cache.stats().free_blocks == 24
    assert cache.stats().num_nodes == 0
    assert cache.cached_sequences() == []


def test_stats_of_a_hand_computed_example(make_cache, put) -> None:
    cache = make_cache(num_blocks=16, block_size=4)
    put(cache, TEN)
    put(cache, [1, 2, 3, 4, 5, 6, 20, 21])
    handle = cache.lock(cache.match([1, 2, 3, 30]))
    cache.match([9], "other")

    assert cache.stats() == CacheStats(
        num_blocks=16,
        block_size=4,
        free_blocks=12,
        used_blocks=4,
        cached_tokens=12,
        evictable_tokens=6,
        locked_tokens=6,
        num_nodes=3,
        query_tokens=5,
        hit_tokens=3,
        evictions=0,
        evicted_tokens=0,
        evicted_blocks=0,
        evictable_blocks=2,  # block 2 of [6,10) (its block 1 is its parent's too) and the leaf [6,8)'s own copy
    )
    assert cache.stats().hit_rate == pytest.approx(3 / 5)

    cache.evict_all()
    after = cache.stats()
    assert (after.evictions, after.evicted_tokens, after.evicted_blocks) == (2, 6, 2)
    assert (after.cached_tokens, after.locked_tokens, after.free_blocks) == (6, 6, 14)
    cache.unlock(handle)
    assert cache.stats().evictable_tokens == 6


def test_stats_are_plain_ints_after_blocks_come_and_go(make_cache, put) -> None:
    cache = make_cache(num_blocks=4, block_size=4)
    put(cache, TEN)
    lease = cache.acquire([1, 2, 3, 4, 5, 6, 99])
    cache.reserve(lease, 8)
    cache.release(lease)
    cache.evict_all()
    cache.free(cache.allocate(2))

    stats = dataclasses.asdict(cache.stats())

    assert {name: type(value) for name, value in stats.items() if type(value) is not int} == {}
    assert json.loads(json.dumps(stats)) == stats


def test_hit_rate_of_an_unused_cache_is_zero(make_cache) -> None:
    assert make_cache().stats().hit_rate == 0.0


def test_cache_needs_a_pool() -> None:
    with pytest.raises(InvalidArgumentError, match="pool must be a KVBlockPool"):
        RadixCache("pool")  # type: ignore[arg-type]
