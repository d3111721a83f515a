"""A lease's commit inserts from its lock rather than from the root: the outcome must be the one an insert from the
root gives (same tree, same blocks, same eviction order), also when the locked path changed shape meanwhile."""

from __future__ import annotations

from prefixcache import KVBlockPool, RadixCache

BS = 4
SYSTEM = list(range(100, 118))  # 18 tokens: the lock ends inside the fifth block's node, split there
TURN = [7, 8, 9, 10, 11, 12]


def by_lease(cache: RadixCache, prompt: list[int], answer: list[int]) -> None:
    lease = cache.acquire(prompt)
    cache.reserve(lease, len(prompt) + len(answer))
    cache.commit(lease, prompt + answer)


def from_the_root(cache: RadixCache) -> RadixCache:
    """The same cache with every insert walking from the root, as before commits started at the lock."""
    insert = cache._tree.insert
    cache._tree.insert = lambda q, owned, first, namespace, origin, start=None: insert(
        q, owned, first, namespace, origin
    )
    return cache


def eviction_order(cache: RadixCache) -> list[list[list[int]]]:
    order = []
    while cache.stats().cached_tokens:
        cache.evict(1)
        order.append(sorted(cache.cached_sequences()))
    return order


def scenario(cache: RadixCache) -> RadixCache:
    by_lease(cache, SYSTEM, [1, 2, 3, 4, 5])
    by_lease(cache, SYSTEM + [1, 2, 3, 4, 5] + TURN, [20, 21, 22])
    by_lease(cache, SYSTEM[:10] + [50, 51, 52], [53])  # another branch, higher up the path
    by_lease(cache, SYSTEM + [9], [60, 61])
    by_lease(cache, SYSTEM + [1, 2, 3, 4, 5] + TURN + [20, 21, 22, 30], [31, 32, 33, 34, 35])
    return cache


def test_commit_leaves_the_tree_an_insert_from_the_root_leaves() -> None:
    leased = scenario(RadixCache(KVBlockPool(64, BS)))
    inserted = scenario(from_the_root(RadixCache(KVBlockPool(64, BS))))

    leased.check_invariants()
    assert sorted(leased.cached_sequences()) == sorted(inserted.cached_sequences())
    assert leased.stats().num_nodes == inserted.stats().num_nodes
    assert eviction_order(leased) == eviction_order(inserted)


def test_commit_after_the_locked_path_was_split_above_the_lock() -> None:
    cache = RadixCache(KVBlockPool(64, BS))
    by_lease(cache, SYSTEM, [1, 2, 3, 4])
    prompt = SYSTEM + [1, 2, 3, 4, 5, 6]
    lease = cache.acquire(prompt)
    by_lease(cache, SYSTEM[:6] + [90, 91], [92])  # splits a node the lease holds locked

    cache.reserve(lease, len(prompt) + 3)
    result = cache.commit(lease, prompt + [70, 71, 72])

    assert result.num_cached_tokens == len(SYSTEM) + 4
    assert cache.match(prompt + [70, 71, 72]).num_tokens == len(prompt) + 3
    cache.check_invariants()
    assert cache.stats().locked_tokens == 0


def test_commit_of_fewer_tokens_than_an_inserted_prefix_locks() -> None:
    cache = RadixCache(KVBlockPool(64, BS))
    prompt = SYSTEM + [1, 2, 3, 4, 5, 6]
    lease = cache.acquire(prompt, num_tokens=len(prompt))
    cache.insert_prefix(lease, prompt)  # the lock moves down to the end of the prompt's whole blocks

    result = cache.commit(lease, prompt[:6])

    assert (result.num_new_tokens, result.num_cached_tokens) == (0, 6)
    cache.check_invariants()
    assert cache.stats().locked_tokens == 0


def test_commit_refreshes_the_locked_path_as_an_insert_from_the_root_does() -> None:
    def run(cache: RadixCache) -> list[list[list[int]]]:
        by_lease(cache, SYSTEM[:8] + [1, 2, 3, 4], [5, 6, 7, 8])
        by_lease(cache, SYSTEM[:8] + [40, 41, 42, 43], [44])
        prompt = SYSTEM[:8] + [1, 2, 3, 4, 5, 6, 7, 8, 9]
        lease = cache.acquire(prompt)  # locks the branch through [5, 6, 7, 8], a leaf
        by_lease(cache, SYSTEM[:8] + [40, 41, 42, 43, 44], [45, 46, 47])  # used after the lease's match
        cache.commit(lease, prompt[:-1])  # nothing new: the leaf's access time is the commit's, not the match's
        return eviction_order(cache)

    assert run(RadixCache(KVBlockPool(64, BS))) == run(from_the_root(RadixCache(KVBlockPool(64, BS))))
