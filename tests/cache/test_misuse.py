"""Misuse of leases, handles and matches raises LockError / InvalidTokensError and leaves every cache consistent."""

from __future__ import annotations

import pytest
import torch

from prefixcache import KVBlockPool, PrefixCachingRunner, RadixCache, SamplingParams
from prefixcache.errors import InvalidTokensError, LockError


def fresh() -> RadixCache:
    return RadixCache(KVBlockPool(16, 4))


def test_commit_of_tokens_that_do_not_extend_the_prompt_is_refused() -> None:
    cache = fresh()
    lease = cache.acquire([1, 2, 3, 4, 5, 6, 7, 8])
    cache.reserve(lease, 8)

    with pytest.raises(InvalidTokensError, match="agree with its prompt"):
        cache.commit(lease, [1, 2, 3, 4, 5, 6, 77, 88])

    cache.release(lease)
    assert cache.cached_sequences() == []
    cache.check_invariants()


def test_commit_of_a_prompt_prefix_or_an_extension_is_accepted() -> None:
    cache = fresh()
    lease = cache.acquire([1, 2, 3, 4, 5, 6])
    cache.reserve(lease, 8)

    assert cache.commit(lease, [1, 2, 3, 4, 5, 6, 7, 8]).num_new_tokens == 8
    cache.check_invariants()


@pytest.mark.parametrize("operation", ["release", "commit", "reserve"])
def test_a_lease_from_another_cache_is_refused_and_both_caches_stay_intact(operation: str) -> None:
    a, b = fresh(), fresh()
    lease = b.acquire([1, 2, 3])
    call = {
        "release": lambda: a.release(lease),
        "commit": lambda: a.commit(lease, [1, 2, 3]),
        "reserve": lambda: a.reserve(lease, 3),
    }[operation]

    with pytest.raises(LockError, match="returned by this cache"):
        call()

    a.check_invariants()
    b.release(lease)
    b.check_invariants()


def test_handles_and_matches_from_another_cache_are_refused() -> None:
    a, b = fresh(), fresh()
    for cache in (a, b):
        cache.insert([1, 2, 3], cache.allocate(1))
    handle = b.lock(b.match([1, 2, 3]))

    with pytest.raises(LockError, match="another cache"):
        a.unlock(handle)
    with pytest.raises(LockError, match="returned by this cache"):
        a.lock(b.match([1, 2]))

    b.unlock(handle)
    a.check_invariants()
    b.check_invariants()
    assert (a.stats().locked_tokens, b.stats().locked_tokens) == (0, 0)


def test_release_after_the_lease_blocks_were_inserted_directly_unlocks_and_keeps_the_blocks() -> None:
    cache = fresh()
    lease = cache.acquire([1, 2, 3, 4, 5])
    cache.reserve(lease, 5)
    cache.insert([1, 2, 3, 4, 5], lease.block_table)

    with pytest.raises(LockError, match="already given away"):
        cache.release(lease)

    assert cache.stats().locked_tokens == 0
    assert cache.cached_sequences() == [[1, 2, 3, 4, 5]]
    cache.check_invariants()


def test_commit_after_the_lease_lock_was_released_directly_is_refused_before_inserting() -> None:
    cache = fresh()
    cache.insert([1, 2, 3, 4], cache.allocate(1))
    lease = cache.acquire([1, 2, 3, 4, 5, 6])
    cache.reserve(lease, 6)
    cache.unlock(lease.lock)

    with pytest.raises(LockError, match="lock was released directly"):
        cache.commit(lease, [1, 2, 3, 4, 5, 6])

    assert cache.cached_sequences() == [[1, 2, 3, 4]]


def test_a_listener_raising_keyboard_interrupt_cannot_corrupt_the_cache(tiny) -> None:
    runner = PrefixCachingRunner(tiny, num_blocks=16, block_size=4)

    def listener(event: object) -> None:
        raise KeyboardInterrupt

    runner.cache.subscribe(listener)
    prompt = list(range(1, 11))
    runner.generate(prompt, SamplingParams(max_new_tokens=2))

    runner.cache.check_invariants()
    result = runner.generate(prompt + [40, 41], SamplingParams(max_new_tokens=3))
    expected = []
    sequence = prompt + [40, 41]
    for _ in range(3):
        token = int(tiny.forward_reference(torch.tensor(sequence))[-1].argmax())
        expected.append(token)
        sequence.append(token)
    assert list(result.token_ids) == expected
