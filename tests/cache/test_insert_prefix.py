"""Specification of RadixCache.insert_prefix (a running request's prompt cached when its prefill ends, the lease kept
open) and RadixCache.cached_length (a look-ahead that counts and touches nothing)."""

from __future__ import annotations

import pytest
import torch

from prefixcache import KVBlockPool, RadixCache
from prefixcache.errors import InvalidArgumentError, InvalidTokensError, LockError
from prefixcache.testing import assert_quiescent

BS = 4


def make_cache(num_blocks: int = 32) -> RadixCache:
    return RadixCache(KVBlockPool(num_blocks, BS, num_layers=1, num_kv_heads=1, head_dim=2))


def write_rows(cache: RadixCache, table, start: int, tokens: list[int]) -> None:
    """Write each position's K/V as (token, position): what a model would write, told apart by its values."""
    kv = cache.pool.kv
    for offset, token in enumerate(tokens):
        pos = start + offset
        kv[0, :, int(table[pos // BS]), pos % BS] = torch.tensor([float(token), float(pos)])


def commit_written(cache: RadixCache, tokens: list[int]) -> None:
    """Cache ``tokens`` as a request would: admitted, rows written (:func:`write_rows`), committed."""
    lease = cache.acquire(tokens, num_tokens=len(tokens))
    write_rows(cache, lease.block_table, 0, tokens)
    cache.commit(lease, tokens)


def rows_of(cache: RadixCache, table, n: int) -> list[tuple[float, float]]:
    kv = cache.pool.kv
    return [tuple(kv[0, 0, int(table[p // BS]), p % BS, 0].tolist()) for p in range(n)]


def test_running_request_prompt_is_hit_by_another_while_its_lease_stays_open() -> None:
    cache = make_cache()
    prompt = list(range(100, 110))  # 10 tokens: two whole blocks and 2 rows of a third
    lease = cache.acquire(prompt, num_tokens=14)
    write_rows(cache, lease.block_table, 0, prompt)
    result = cache.insert_prefix(lease, prompt)
    assert (result.num_new_tokens, result.num_cached_tokens) == (10, 0)
    assert not lease.closed and lease.first_owned_block == 2
    assert cache.stats().locked_tokens == 8  # the lease's whole blocks, not the copied partial one
    cache.check_invariants()
    assert cache.cached_sequences() == [prompt]

    # The request goes on writing into its own third block; the tree's copy keeps the prompt's two rows.
    write_rows(cache, lease.block_table, 10, [7, 7, 7])
    other = cache.acquire(prompt + [1, 2], num_tokens=12)  # extends the tree's copy in place: its later rows are free
    assert other.num_cached_tokens == 10 and other.num_copied_tokens == 0
    assert rows_of(cache, other.block_table, 10) == [(float(t), float(p)) for p, t in enumerate(prompt)]
    assert rows_of(cache, lease.block_table, 13)[10:] == [(7.0, 10.0), (7.0, 11.0), (7.0, 12.0)]
    cache.release(other)

    insert = cache.commit(lease, prompt + [7, 7, 7])
    assert (insert.num_new_tokens, insert.num_cached_tokens) == (3, 10)
    assert cache.cached_sequences() == [prompt + [7, 7, 7]]
    assert_quiescent(cache)


def test_second_copy_of_a_prefix_is_released_and_the_lease_reads_the_first() -> None:
    cache = make_cache()
    prompt = list(range(50, 62))  # 12 tokens: three whole blocks, no copy
    first = cache.acquire(prompt, num_tokens=16)
    second = cache.acquire(prompt, num_tokens=16)  # both missed: both computed the prompt
    for lease in (first, second):
        write_rows(cache, lease.block_table, 0, prompt)
    cache.insert_prefix(first, prompt)
    used = cache.stats().used_blocks
    result = cache.insert_prefix(second, prompt)
    assert (result.num_new_tokens, result.num_cached_tokens, result.num_released_blocks) == (0, 12, 3)
    assert cache.stats().used_blocks == used - 3
    assert list(second.block_table[:3]) == list(first.block_table[:3])
    cache.check_invariants()
    for lease, tail in ((first, [1, 2]), (second, [3])):
        write_rows(cache, lease.block_table, 12, tail)
        cache.commit(lease, prompt + tail)
    assert sorted(cache.cached_sequences()) == sorted([prompt + [1, 2], prompt + [3]])
    assert_quiescent(cache)


def test_insert_prefix_after_a_match_ending_inside_a_block() -> None:
    cache = make_cache()
    cached = list(range(10, 16))  # 6 tokens: the next request's match ends inside block 1
    commit_written(cache, cached)
    prompt = cached + list(range(30, 37))  # 13 tokens
    lease = cache.acquire(prompt, num_tokens=16)
    assert lease.num_cached_tokens == 6 and lease.first_owned_block == 1
    write_rows(cache, lease.block_table, 6, prompt[6:])
    cache.insert_prefix(lease, prompt)
    assert lease.first_owned_block == 3
    cache.check_invariants()
    other = cache.acquire(prompt, num_tokens=13)
    assert other.num_cached_tokens == 12
    assert rows_of(cache, other.block_table, 12) == [(float(t), float(p)) for p, t in enumerate(prompt[:12])]
    cache.release(other)
    cache.release(lease)  # a cancelled request: its own blocks go back, the inserted prompt stays cached
    assert cache.cached_sequences() == [prompt]
    assert_quiescent(cache)


def test_insert_prefix_inside_a_block_extended_in_place_shares_it_and_goes_on_extending() -> None:
    cache = make_cache(num_blocks=4)
    cached = list(range(10, 16))  # 6 tokens: block 1 half full
    commit_written(cache, cached)
    prompt = [*cached, 30, 31, 32]
    lease = cache.acquire(prompt, num_tokens=12)
    assert (lease.num_cached_tokens, lease.num_copied_tokens) == (6, 0)  # block 1's rows 6, 7 are the lease's
    write_rows(cache, lease.block_table, 6, prompt[6:])

    cache.insert_prefix(lease, prompt[:7])  # ends inside block 1 again: the tree takes that block, no copy

    cache.check_invariants()
    assert cache.cached_sequences() == [prompt[:7]]
    assert cache.stats().used_blocks == 3  # blocks 0, 1 and the lease's block 2
    other = cache.acquire([*prompt[:7], 99], num_tokens=8)  # block 1 is being extended: this one copies it
    assert (other.num_cached_tokens, other.num_copied_tokens) == (7, 3)
    assert rows_of(cache, other.block_table, 7) == [(float(t), float(p)) for p, t in enumerate(prompt[:7])]
    cache.release(other)
    cache.commit(lease, [*prompt, 40, 41, 42])
    assert cache.cached_sequences() == [[*prompt, 40, 41, 42]]
    assert cache.stats().used_blocks == 3
    assert_quiescent(cache)


def test_insert_prefix_already_cached_through_a_branch_keeps_the_extended_block_locked() -> None:
    # Found by a randomized differential run: the lease extends block 1 in place, another request commits a branch
    # spelling the lease's next tokens inside that block, so the lease's insert_prefix inserts nothing new.  It used
    # to move the lock up to the block boundary: the extended node was left unlocked, counted evictable although the
    # lease still holds its block (evict_all freed less than stats said), and once evicted commit raised IndexError.
    cache = make_cache(num_blocks=8)
    cached = list(range(10, 16))  # 6 tokens: block 1 half full
    commit_written(cache, cached)
    lease = cache.acquire([*cached, 30], num_tokens=8)
    assert (lease.num_cached_tokens, lease.num_copied_tokens) == (6, 0)  # extends block 1 in place
    write_rows(cache, lease.block_table, 6, [30])
    other = cache.acquire([*cached, 30, 31], num_tokens=8)  # copies block 1, then caches a branch through it
    write_rows(cache, other.block_table, 6, [30, 31])
    cache.commit(other, [*cached, 30, 31])

    cache.insert_prefix(lease, [*cached, 30])

    cache.check_invariants()
    assert lease.lock.node.end == 6  # still pins the node whose block the lease writes
    evictable = cache.stats().evictable_blocks
    assert cache.evict_all().num_blocks == evictable
    write_rows(cache, lease.block_table, 7, [40])
    assert cache.commit(lease, [*cached, 30, 40]).num_new_tokens == 2
    assert cache.cached_sequences() == [[*cached, 30, 40]]
    match = cache.match([*cached, 30, 40])
    assert rows_of(cache, match.block_table, 8) == [(float(t), float(p)) for p, t in enumerate([*cached, 30, 40])]
    assert_quiescent(cache)


def test_insert_prefix_shorter_than_an_earlier_one_ending_inside_a_block_leaks_nothing() -> None:
    # Found by a randomized differential run: a second insert_prefix ending inside a block of the prefix the first
    # one locked allocated a copy of that block and never gave it back.
    cache = make_cache(num_blocks=8)
    prompt = list(range(60, 70))  # 10 tokens
    lease = cache.acquire(prompt, num_tokens=12)
    write_rows(cache, lease.block_table, 0, prompt)
    cache.insert_prefix(lease, prompt)
    assert lease.first_owned_block == 2
    used = cache.stats().used_blocks

    result = cache.insert_prefix(lease, prompt[:5])  # ends inside block 1, which the tree holds already

    assert (result.num_new_tokens, result.num_cached_tokens) == (0, 5)
    assert cache.stats().used_blocks == used
    cache.check_invariants()
    cache.release(lease)
    assert_quiescent(cache)


def test_no_block_for_the_copy_inserts_the_whole_blocks_only() -> None:
    cache = make_cache(num_blocks=3)
    prompt = list(range(200, 210))  # needs all 3 blocks; no fourth for the copy of the partial one
    lease = cache.acquire(prompt, num_tokens=10)
    write_rows(cache, lease.block_table, 0, prompt)
    result = cache.insert_prefix(lease, prompt)
    assert (result.num_new_tokens, result.num_cached_tokens) == (8, 0)
    assert cache.cached_sequences() == [prompt[:8]]
    cache.check_invariants()
    cache.commit(lease, prompt)
    assert cache.cached_sequences() == [prompt]
    assert_quiescent(cache)


def test_bad_insert_prefix_changes_nothing() -> None:
    cache = make_cache()
    cached = list(range(1, 9))
    lease = cache.acquire(cached, num_tokens=8)
    cache.commit(lease, cached)
    lease = cache.acquire(cached + [20, 21], num_tokens=10)
    before = (cache.cached_sequences(), cache.stats(), list(lease.block_table), lease.first_owned_block)
    with pytest.raises(InvalidTokensError):
        cache.insert_prefix(lease, cached + [22, 23])  # disagrees with the prompt
    with pytest.raises(InvalidTokensError):
        cache.insert_prefix(lease, cached[:3])  # shorter than the matched prefix
    with pytest.raises(InvalidArgumentError):
        cache.insert_prefix(lease, cached + [20, 21] + [0] * 8)  # more tokens than the lease's blocks hold
    after = (cache.cached_sequences(), cache.stats(), list(lease.block_table), lease.first_owned_block)
    assert after == before and not lease.closed
    cache.check_invariants()
    cache.release(lease)
    with pytest.raises(LockError):
        cache.insert_prefix(lease, cached + [20, 21])
    assert_quiescent(cache)


def test_cached_length_counts_and_touches_nothing() -> None:
    cache = make_cache()
    for seq in ([1, 2, 3, 4, 5, 6], [9, 9, 9]):
        lease = cache.acquire(seq, num_tokens=len(seq))
        cache.commit(lease, seq)
    stats = cache.stats()
    access = {tuple(n.tokens): (n.last_access, n.hit_count) for n in cache._tree.roots[None].children.values()}
    assert cache.cached_length([1, 2, 3, 4, 5, 6, 7]) == 6
    assert cache.cached_length([1, 2, 3, 4, 5, 6], for_prefill=True) == 5
    assert cache.cached_length([1, 2, 3, 4, 5, 6]) == 6
    assert cache.cached_length([9, 8]) == 1
    assert cache.cached_length([7], "other namespace") == 0
    assert cache.stats() == stats
    assert {tuple(n.tokens): (n.last_access, n.hit_count) for n in cache._tree.roots[None].children.values()} == access
    with pytest.raises(InvalidTokensError):
        cache.cached_length([])
