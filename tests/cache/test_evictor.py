"""Eviction: which unlocked leaf goes first, and what is never evicted."""

from __future__ import annotations

import pytest

from prefixcache import EvictResult, LFUPolicy, LRUPolicy
from prefixcache.cache.evictor import make_policy
from prefixcache.errors import InvalidArgumentError

A, B, C = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]


def cached(cache, namespace=None) -> list[list[int]]:
    return sorted(cache.cached_sequences(namespace))


def test_lru_evicts_the_least_recently_used_leaf(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    for seq in (A, B, C):
        put(cache, seq)
    cache.match(A)

    result = cache.evict(1)

    assert result == EvictResult(num_blocks=1, num_nodes=1, num_tokens=4)
    assert cached(cache) == [A, C]


def test_lru_is_refreshed_by_insert_of_a_cached_sequence(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    for seq in (A, B, C):
        put(cache, seq)
    put(cache, A)

    cache.evict(1)

    assert cached(cache) == [A, C]


def test_lru_evicts_in_order_of_last_access(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    for seq in (A, B, C):
        put(cache, seq)
    cache.match(B)
    cache.match(A)

    evicted_order = []
    for _ in range(3):
        before = cached(cache)
        cache.evict(1)
        evicted_order.extend(seq for seq in before if seq not in cached(cache))

    assert evicted_order == [C, B, A]


def test_a_locked_leaf_survives_evict_all(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, A)
    put(cache, B)
    cache.lock(cache.match(A))

    cache.evict_all()

    assert cached(cache) == [A]
    assert cache.stats().free_blocks == 15


def test_a_locked_match_protects_every_ancestor(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    put(cache, [1, 2, 3, 4, 9, 9, 9, 9])
    handle = cache.lock(cache.match([1, 2, 3, 4, 9]))

    cache.evict_all()

    assert cached(cache) == [[1, 2, 3, 4, 9, 9, 9, 9]]
    cache.unlock(handle)
    cache.evict_all()
    assert cached(cache) == []
    assert cache.stats().free_blocks == 16


def test_an_interior_node_becomes_a_candidate_only_when_its_last_child_goes(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    put(cache, [1, 2, 3, 4, 9, 9, 9, 9])

    assert cache.evict(2) == EvictResult(num_blocks=2, num_nodes=2, num_tokens=8)
    assert cached(cache) == [[1, 2, 3, 4]]
    assert cache.evict(1) == EvictResult(num_blocks=1, num_nodes=1, num_tokens=4)
    assert cached(cache) == []


def test_evict_keeps_going_until_blocks_are_actually_freed(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, [1, 2, 3, 4, 5, 6])
    put(cache, [1, 2, 3, 4, 5, 7])

    result = cache.evict(1)

    # [6] shares its block with the parent [1..5]; evicting it frees none by itself, but [7]'s seam heals at once
    # (the parent takes [7]'s copy of the block), so the parent's own copy is freed and [7] stays.
    assert result == EvictResult(num_blocks=1, num_nodes=1, num_tokens=1)
    assert cached(cache) == [[1, 2, 3, 4, 5, 7]]


def test_evict_with_nothing_evictable_frees_nothing(make_cache, put) -> None:
    cache = make_cache(block_size=4)
    put(cache, A)
    cache.lock(cache.match(A))

    assert cache.evict(3) == EvictResult(num_blocks=0, num_nodes=0, num_tokens=0)
    assert cached(cache) == [A]


def lfu_and_lru_disagree(cache, put) -> None:
    """A was used most often but least recently; B least often; C in between and most recently."""
    for seq in (A, B, C):
        put(cache, seq)
    for seq in (A, A, A, B, C, C):
        cache.match(seq)


def test_lfu_evicts_the_least_hit_leaf_first(make_cache, put) -> None:
    cache = make_cache(block_size=4, policy="lfu")
    lfu_and_lru_disagree(cache, put)

    cache.evict(1)
    assert cached(cache) == [A, C]
    cache.evict(1)
    assert cached(cache) == [A]


def test_lru_evicts_the_stalest_leaf_even_if_it_was_hit_most(make_cache, put) -> None:
    cache = make_cache(block_size=4, policy="lru")
    lfu_and_lru_disagree(cache, put)

    cache.evict(1)

    assert cached(cache) == [B, C]


def test_lfu_breaks_ties_by_least_recent_use(make_cache, put) -> None:
    cache = make_cache(block_size=4, policy="lfu")
    for seq in (A, B, C):
        put(cache, seq)
    for seq in (C, A, B):
        cache.match(seq)

    cache.evict(1)

    assert cached(cache) == [A, B]


class MostRecentlyUsedFirst:
    name = "mru"

    def priority(self, node) -> tuple[int, ...]:
        return (-node.last_access,)


def test_a_custom_policy_object_decides_the_order(make_cache, put) -> None:
    policy = MostRecentlyUsedFirst()
    cache = make_cache(block_size=4, policy=policy)
    for seq in (A, B, C):
        put(cache, seq)
    cache.match(A)

    cache.evict(1)

    assert cache.policy is policy
    assert cached(cache) == [B, C]
    cache.check_invariants()


@pytest.mark.parametrize(("name", "policy_type"), [("lru", LRUPolicy), ("lfu", LFUPolicy), ("LFU", LFUPolicy)])
def test_policies_are_chosen_by_case_insensitive_name(name: str, policy_type: type) -> None:
    assert type(make_policy(name)) is policy_type


def test_an_unknown_policy_name_is_refused(make_cache) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown eviction policy 'fifo'; choose one of"):
        make_cache(policy="fifo")


def test_an_object_without_priority_is_refused_as_a_policy(make_cache) -> None:
    with pytest.raises(InvalidArgumentError, match="needs a name and a priority"):
        make_cache(policy=object())
