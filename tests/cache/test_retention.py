"""Retention priority (issue 11, item 7): a retained prefix goes only when nothing of lower priority is left or its
retention has expired; a cap keeps retention from taking the pool; stats report what is retained."""

from __future__ import annotations

import pytest

from prefixcache import InvalidArgumentError, KVBlockPool, RadixCache
from prefixcache.testing import assert_quiescent

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def put(cache: RadixCache, seq: list[int]) -> None:
    cache.commit(cache.acquire(seq, num_tokens=len(seq)), seq)


def seq(first: int, n: int) -> list[int]:
    return [first] + list(range(1000, 1000 + n - 1))


def make(num_blocks: int = 16, fraction: float = 0.5) -> tuple[RadixCache, Clock]:
    clock = Clock()
    return RadixCache(KVBlockPool(num_blocks, BS), max_retained_fraction=fraction, clock=clock), clock


def test_a_retained_prefix_outlives_more_recent_unretained_ones() -> None:
    cache, _ = make()
    system, a, b = seq(1, 64), seq(2, 64), seq(3, 64)
    put(cache, system)
    assert cache.retain(system, priority=1) == 64
    put(cache, a)
    put(cache, b)
    cache.evict(8)  # all of a and b: 8 unretained blocks
    assert cache.cached_sequences() == [system]
    stats = cache.stats()
    assert (stats.retained_tokens, stats.retained_blocks) == (64, 4)
    cache.evict(1)  # nothing unretained is left: the retained prefix gives up a block
    assert cache.cached_sequences() == [system[:48]]
    assert cache.stats().retained_tokens == 48
    assert_quiescent(cache)


def test_lower_priority_goes_first() -> None:
    cache, _ = make()
    low, high = seq(1, 32), seq(2, 32)
    put(cache, high)
    put(cache, low)
    cache.retain(high, priority=2)
    cache.retain(low, priority=1)
    cache.evict(2)
    assert cache.cached_sequences() == [high]


def test_an_expired_retention_goes_in_lru_order() -> None:
    cache, clock = make()
    system, recent = seq(1, 32), seq(2, 32)
    put(cache, system)
    cache.retain(system, priority=1, retain_s=10.0)
    put(cache, recent)
    clock.now = 9.0
    cache.evict(2)
    assert cache.cached_sequences() == [system]
    put(cache, recent)
    clock.now = 10.0
    assert cache.stats().retained_tokens == 0
    cache.evict(2)  # the system prompt is now the least recently used
    assert cache.cached_sequences() == [recent]
    assert_quiescent(cache)


def test_the_cap_stops_retention_at_the_first_node_that_would_exceed_it() -> None:
    cache, _ = make(num_blocks=16, fraction=0.25)  # 4 blocks
    base = seq(1, 48)
    put(cache, base)
    put(cache, base + list(range(32)))  # a 2-block node below the 3-block one
    assert cache.retain(base + list(range(32)), priority=1) == 48
    stats = cache.stats()
    assert (stats.retained_tokens, stats.retained_blocks) == (48, 3)
    cache.check_invariants()


def test_retaining_what_is_not_cached_retains_nothing() -> None:
    cache, _ = make()
    assert cache.retain(seq(5, 20), priority=1) == 0
    assert cache.stats().retained_tokens == 0


@pytest.mark.parametrize(("priority", "retain_s"), [(0, None), (-1, None), (1.5, None), (1, 0), (1, -2.0), (1, "x")])
def test_bad_retention_arguments_are_refused(priority, retain_s) -> None:
    cache, _ = make()
    put(cache, seq(1, 20))
    with pytest.raises(InvalidArgumentError):
        cache.retain(seq(1, 20), priority=priority, retain_s=retain_s)
    assert cache.stats().retained_tokens == 0


def test_the_fraction_must_be_within_0_and_1() -> None:
    with pytest.raises(InvalidArgumentError):
        RadixCache(KVBlockPool(4, BS), max_retained_fraction=1.5)


def test_a_priority_a_snapshot_could_not_store_is_refused() -> None:
    from prefixcache.cache.retention import MAX_PRIORITY, check_retain
    from prefixcache.errors import InvalidArgumentError

    check_retain(MAX_PRIORITY, None)  # the largest a snapshot keeps as a 64-bit count
    with pytest.raises(InvalidArgumentError, match="2\\*\\*63 - 1"):
        check_retain(MAX_PRIORITY + 1, None)
