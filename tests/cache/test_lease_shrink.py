"""RadixCache.shrink: a lease gives back the blocks it reserved past the tokens it keeps (a rejected speculative
draft's), never the blocks of its prompt (the matched prefix, a partial block extended in place), and the cache's
invariants hold throughout."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from prefixcache.cache.radix_cache import RadixCache
from prefixcache.errors import InvalidArgumentError, LockError
from prefixcache.testing import assert_quiescent


def test_shrink_frees_the_blocks_past_the_tokens_kept(make_cache: Callable[..., RadixCache], put) -> None:
    cache = make_cache(num_blocks=16, block_size=4)
    put(cache, list(range(10)))  # 3 blocks cached, the last one partial
    lease = cache.acquire(list(range(10)) + [50, 51])  # matches 10, extends the cached partial block in place
    cache.reserve(lease, 25)  # 7 blocks
    free = cache.pool.num_free_blocks
    assert cache.shrink(lease, 13) == 3  # 13 tokens need 4 blocks
    assert len(lease.block_table) == 4 and cache.pool.num_free_blocks == free + 3
    assert cache.shrink(lease, 13) == 0
    assert cache.shrink(lease, 0) == 1  # down to the prompt's 3 blocks, never below
    assert len(lease.block_table) == 3
    cache.check_invariants()
    cache.release(lease)
    assert_quiescent(cache)


def test_shrink_refuses_a_bad_count_and_a_closed_lease(make_cache: Callable[..., RadixCache]) -> None:
    cache = make_cache(num_blocks=8, block_size=4)
    lease = cache.acquire([1, 2, 3, 4, 5])
    with pytest.raises(InvalidArgumentError):
        cache.shrink(lease, -1)
    cache.release(lease)
    with pytest.raises(LockError):
        cache.shrink(lease, 0)
    assert_quiescent(cache)
