"""Misuse of the core cache API found by a breaker session: numpy integer counts, listeners that change the cache
while it announces a change, request ids a snapshot cannot store, and retention or listener arguments of the wrong
kind.  Each must raise a prefixcache error (or work exactly as with a Python int) and leave the cache consistent."""

from __future__ import annotations

import tempfile
import uuid

import numpy as np
import pytest

from prefixcache import KVBlockPool, RadixCache
from prefixcache.errors import CapacityError, InvalidArgumentError, LockError
from prefixcache.testing import InjectedFault, assert_quiescent, fail_on_call

NUMPY_INTS = [np.int64, np.uint64, np.int32, np.uint8]


def put(cache: RadixCache, seq: list[int], **kwargs) -> None:
    lease = cache.acquire(seq, num_tokens=len(seq), **kwargs)
    cache.commit(lease, seq)


@pytest.mark.parametrize("kind", NUMPY_INTS, ids=lambda t: t.__name__)
def test_allocating_a_numpy_count_with_free_blocks_evicts_nothing(kind) -> None:
    cache = RadixCache(KVBlockPool(16, 4))
    put(cache, list(range(1, 9)))
    blocks = cache.allocate(kind(1))
    assert len(blocks) == 1
    assert cache.cached_sequences() == [list(range(1, 9))]  # np.uint64(1) - 14 free used to wrap: all evicted
    assert cache.stats().free_blocks == 13
    cache.free(blocks)
    assert_quiescent(cache)


@pytest.mark.parametrize("kind", NUMPY_INTS, ids=lambda t: t.__name__)
def test_evicting_a_numpy_count_leaves_only_python_ints_in_the_stats(kind) -> None:
    cache = RadixCache(KVBlockPool(128, 4))
    for k in range(3):
        put(cache, [k + 1] * 120)
    result = cache.evict(kind(1))  # np.uint8 used to overflow midway, breaking the evictable count
    assert (result.num_blocks, result.num_tokens) == (1, 4)
    assert type(result.num_tokens) is int
    stats = cache.stats()
    assert stats.cached_tokens == 356 and type(stats.cached_tokens) is int
    assert stats.evicted_tokens == 4 and type(stats.evicted_tokens) is int
    cache.check_invariants()
    cache.evict(kind(2))
    assert cache.stats().cached_tokens == 348
    assert_quiescent(cache)


@pytest.mark.parametrize("kind", NUMPY_INTS, ids=lambda t: t.__name__)
def test_reserving_a_numpy_count_reserves_what_a_python_int_would(kind) -> None:
    cache = RadixCache(KVBlockPool(8, 4))
    lease = cache.acquire([1, 2, 3])
    table = cache.reserve(lease, kind(9))  # np.uint8(9) used to be refused as "9 tokens need 195 blocks"
    assert len(table) == 3
    cache.commit(lease, [1, 2, 3, 7, 7, 7, 7, 7, 7])
    assert cache.cached_sequences() == [[1, 2, 3, 7, 7, 7, 7, 7, 7]]
    assert_quiescent(cache)


def test_reserving_the_largest_uint64_is_refused_as_beyond_the_pool() -> None:
    cache = RadixCache(KVBlockPool(8, 4))
    lease = cache.acquire([1, 2, 3])
    with pytest.raises(CapacityError) as info:
        cache.reserve(lease, np.uint64(2**64 - 1))  # used to return the empty table: -x wrapped to 1
    assert "18446744073709551615 tokens need 4611686018427387904 blocks" in str(info.value)
    assert len(lease.block_table) == 0
    cache.release(lease)
    assert_quiescent(cache)


CHANGES = {
    "evict_all": lambda c: c.evict_all(),
    "evict": lambda c: c.evict(1),
    "acquire": lambda c: c.acquire([90, 91, 92], num_tokens=3),
    "allocate": lambda c: c.allocate(1),
    "retain": lambda c: c.retain([1, 2, 3, 4]),
    "lock": lambda c: c.lock(c.match([1, 2, 3, 4])),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_a_listener_cannot_change_the_cache_while_it_announces_a_change(change) -> None:
    cache = RadixCache(KVBlockPool(16, 4))
    put(cache, [50] * 8)
    refused: list[BaseException] = []

    def listener(event) -> None:
        try:
            change(cache)
        except BaseException as error:
            refused.append(error)
            raise

    lease = cache.acquire(list(range(1, 11)), num_tokens=14)
    cache.subscribe(listener)  # the cached [50] * 8 is announced: a change from here is allowed to be refused
    refused.clear()
    before = cache.cached_sequences()
    # An evict_all() from the listener used to empty the tree under insert_prefix, which then failed with a numpy
    # ValueError and left the lease unable to release its blocks.
    cache.insert_prefix(lease, list(range(1, 11)))
    assert refused and all(isinstance(e, LockError) and "KV event listener" in str(e) for e in refused)
    assert sorted(cache.cached_sequences()) == sorted([*before, list(range(1, 11))])
    cache.check_invariants()
    cache.commit(lease, list(range(1, 13)))
    cache.unsubscribe(listener)
    assert_quiescent(cache)
    change(cache)  # allowed again outside a listener


def test_a_listener_may_read_and_subscribe_during_an_event() -> None:
    cache = RadixCache(KVBlockPool(16, 4))
    seen: list[object] = []

    def late(event) -> None:
        seen.append(("late", type(event).__name__))

    def listener(event) -> None:
        seen.append((cache.stats().cached_tokens, cache.cached_length([1, 2, 3, 4, 5])))
        if late not in cache._events.listeners:
            cache.subscribe(late)

    cache.subscribe(listener)
    put(cache, list(range(1, 9)))
    assert seen == [(8, 5), ("late", "BlockStored")]
    assert_quiescent(cache)


BAD_REQUEST_IDS = [uuid.UUID(int=7), 7, b"r1", ("r", 1)]


@pytest.mark.parametrize("request_id", BAD_REQUEST_IDS, ids=repr)
def test_a_request_id_that_is_not_a_str_is_refused_before_anything_changes(request_id) -> None:
    cache = RadixCache(KVBlockPool(8, 4))
    put(cache, [1, 2, 3, 4, 5], request_id="r0")
    before = (cache.stats(), cache.cached_sequences())
    for call in (
        lambda: cache.acquire([1, 2, 3, 4, 5, 6], num_tokens=6, request_id=request_id),
        lambda: cache.match([1, 2, 3], request_id=request_id),
        lambda: cache.insert([9, 9], cache._blocks.pool.free_block_ids()[:1], request_id=request_id),
    ):
        with pytest.raises(InvalidArgumentError, match="request_id must be a str or None"):
            call()
    assert (cache.stats(), cache.cached_sequences()) == before
    assert_quiescent(cache)
    # A UUID used to be stored on the node, and save() then failed with json's TypeError.
    with tempfile.TemporaryDirectory() as folder:
        cache.save(folder)
        assert RadixCache.load(folder, KVBlockPool(8, 4)).cached_sequences() == [[1, 2, 3, 4, 5]]


@pytest.mark.parametrize("listener", [5, None, "print"], ids=repr)
def test_a_listener_that_is_not_callable_is_refused(listener) -> None:
    cache = RadixCache(KVBlockPool(8, 4))
    with pytest.raises(InvalidArgumentError, match="must be callable"):
        cache.subscribe(listener)  # used to be kept, and to fail (logged) on every event from then on
    assert cache._events.listeners == []
    with pytest.raises(InvalidArgumentError, match="must be callable"):
        RadixCache(KVBlockPool(8, 4), event_listener=listener) if listener is not None else cache.subscribe(None)


def test_a_clock_that_is_not_callable_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="clock must be callable"):
        RadixCache(KVBlockPool(8, 4), clock=5.0)  # used to fail with TypeError at the first timed retain


def test_a_retention_time_too_large_for_a_float_retains_for_ever() -> None:
    cache = RadixCache(KVBlockPool(8, 4), max_retained_fraction=1.0)
    put(cache, [1, 2, 3, 4, 5])
    assert cache.retain([1, 2, 3, 4, 5], retain_s=10**400) == 5  # used to raise OverflowError
    assert cache.stats().retained_tokens == 5
    put(cache, [7] * 8)
    cache.evict(2)
    assert cache.cached_sequences() == [[1, 2, 3, 4, 5]]
    assert_quiescent(cache)


@pytest.mark.parametrize("k", [1, 2])
def test_a_failed_release_during_eviction_of_a_leaf_sharing_its_first_block_leaks_nothing(k: int) -> None:
    # [1..6, 50, 51, 52] leaves [1..10] inside block 1 (tokens 4-7): its leaf shares that block with the parent.
    cache = RadixCache(KVBlockPool(12, 4))
    for seq in (list(range(1, 11)), [*range(1, 7), 50, 51, 52], [9] * 8):
        cache.commit(cache.acquire(seq, num_tokens=len(seq)), seq)
    with fail_on_call(cache.pool, "decref", k), pytest.raises(InjectedFault):
        cache.evict_all()
    cache.check_invariants()  # every block the tree let go of went back to the pool: counts equal holders
    assert cache.pool.num_free_blocks + cache.stats().used_blocks == 12
    cache.evict_all()
    assert cache.pool.num_free_blocks == 12
    assert_quiescent(cache)


def _seam_cache() -> RadixCache:
    cache = RadixCache(KVBlockPool(12, 4))
    for seq in (list(range(1, 11)), [*range(1, 7), 50, 51, 52], [9] * 8):
        cache.commit(cache.acquire(seq, num_tokens=len(seq)), seq)
    return cache


def test_a_failed_incref_while_splitting_a_node_inside_a_block_changes_nothing() -> None:
    prompt = [*range(1, 10), 70, 71, 72]  # leaves [1..10] after token 9, inside block 2: a split that shares it
    cache = _seam_cache()
    lease = cache.acquire(prompt, num_tokens=16)
    with fail_on_call(cache.pool, "incref", 10**9) as calls:
        cache.insert_prefix(lease, prompt)
    assert calls[0] >= 1
    for k in range(1, calls[0] + 1):  # fail each incref of insert_prefix in turn, the split's among them
        cache = _seam_cache()
        lease = cache.acquire(prompt, num_tokens=16)
        before = cache.cached_sequences(None)
        with fail_on_call(cache.pool, "incref", k), pytest.raises(InjectedFault):
            cache.insert_prefix(lease, prompt)
        cache.check_invariants()
        assert cache.cached_sequences(None) == before, k
        cache.release(lease)
        cache.check_invariants()
        assert_quiescent(cache)
