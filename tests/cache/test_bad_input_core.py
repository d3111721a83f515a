"""Bad input to the core cache: each row names the call, the error class, a piece of its message, and what the
call may change.  A rejected call changes nothing, except an allocation that evicts before giving up, which
leaves the cache exactly as ``evict_all()`` would."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from prefixcache import KVBlockPool, Lease, LockHandle, MatchResult, RadixCache
from prefixcache.errors import (
    CapacityError,
    InvalidArgumentError,
    InvalidTokensError,
    LockError,
    NamespaceError,
    PoolBusyError,
    PrefixCacheError,
)

NAMESPACES = (None, "a", "c", "fresh")
TEN = list(range(1, 11))


@dataclass
class World:
    """A small cache (8 blocks of 4 tokens) with one of everything a bad call can meet:

    namespace "a": [1..10] locked (3 blocks) plus [11] below it (committed, 1 block); namespace None: [5, 6, 7]
    unlocked (1 block); one block owned by the caller; one block freed; a released lock; a committed lease; an open
    lease on [1, 2, 3, 4]; a stale match.  Three blocks are free ([11] went into the last block of [1..10], whose
    later rows were free: extended in place, not copied).
    """

    cache: RadixCache
    tree_block: int
    owned_block: int
    freed_block: int
    released_handle: LockHandle
    committed_lease: Lease
    open_lease: Lease
    stale_match: MatchResult


def build_world() -> World:
    cache = RadixCache(KVBlockPool(8, 4))
    blocks = cache.allocate(1)
    cache.insert([8, 8, 8], blocks, "c")
    stale_match = cache.match([8, 8, 8], "c")
    cache.evict_all()

    tree_blocks = cache.allocate(3)
    cache.insert(TEN, tree_blocks, "a")
    cache.lock(cache.match(TEN, "a"))
    cache.insert([5, 6, 7], cache.allocate(1))
    released_handle = cache.lock(cache.match([5, 6, 7]))
    cache.unlock(released_handle)

    committed_lease = cache.acquire([*TEN, 11], "a")
    cache.reserve(committed_lease, 11)
    cache.commit(committed_lease, [*TEN, 11])
    open_lease = cache.acquire([1, 2, 3, 4, 50], "a")
    owned_block = int(cache.allocate(1)[0])
    freed_block = int(cache.allocate(1)[0])
    cache.free([freed_block])
    assert cache.stats().free_blocks == 3
    assert cache.pool.ref_count(freed_block) == 0
    return World(
        cache, int(tree_blocks[0]), owned_block, freed_block, released_handle, committed_lease, open_lease, stale_match
    )


def snapshot(cache: RadixCache) -> tuple:
    return (
        cache.stats(),
        {ns: sorted(cache.cached_sequences(ns)) for ns in NAMESPACES},
        cache.pool.ref_counts().tolist(),
        sorted(cache.pool.free_block_ids().tolist()),
    )


@dataclass(frozen=True)
class Case:
    call: Callable[[World], Any]
    error: type[PrefixCacheError]
    message: str
    effect: str = "none"  # "none": nothing changes; "evict_all": unlocked material may go, nothing else


def match(tokens: Any, namespace: Any = None) -> Callable[[World], Any]:
    return lambda w: w.cache.match(tokens, namespace)


def acquire(tokens: Any, namespace: Any = None) -> Callable[[World], Any]:
    return lambda w: w.cache.acquire(tokens, namespace)


def insert_owned(tokens: Any, namespace: Any = None) -> Callable[[World], Any]:
    return lambda w: w.cache.insert(tokens, [w.owned_block], namespace)


CASES = {
    "empty sequence": Case(match([]), InvalidTokensError, "must not be empty"),
    "empty tensor": Case(acquire(torch.zeros(0, dtype=torch.int64)), InvalidTokensError, "must not be empty"),
    "negative id": Case(insert_owned([1, -1]), InvalidTokensError, "token id at index 1 is -1"),
    "float id": Case(acquire([1, 2.5]), InvalidTokensError, "index 1 is 2.5 of type float"),
    "nested list": Case(match([[1, 2], [3]]), InvalidTokensError, "of type list"),
    "str": Case(match("hello"), InvalidTokensError, "got str"),
    "bytes": Case(match(b"\x01\x02"), InvalidTokensError, "got bytes: bytes are not token ids"),
    "bytes to insert": Case(insert_owned(b"\x01"), InvalidTokensError, "got bytes: bytes are not token ids"),
    "bytearray": Case(match(bytearray(b"\x01\x02")), InvalidTokensError, "got bytearray: bytes are not token ids"),
    "bytearray to insert": Case(insert_owned(bytearray([5])), InvalidTokensError, "got bytearray"),
    "memoryview": Case(acquire(memoryview(b"\x01\x02")), InvalidTokensError, "got memoryview: bytes are not token"),
    "memoryview of array('I')": Case(
        acquire(memoryview(array("I", [1, 2, 3, 4, 50])), "a"), InvalidTokensError, "got memoryview"
    ),
    "memoryview to insert": Case(insert_owned(memoryview(bytearray([5]))), InvalidTokensError, "got memoryview"),
    "None as tokens": Case(acquire(None), InvalidTokensError, "got NoneType"),
    "2-D numpy array": Case(match(np.array([[1, 2], [3, 4]])), InvalidTokensError, "must be 1-D"),
    "float numpy array": Case(match(np.array([1.0, 2.0])), InvalidTokensError, "integer array, got dtype float64"),
    "2-D tensor": Case(acquire(torch.tensor([[1, 2]])), InvalidTokensError, "must be 1-D"),
    "float tensor": Case(
        match(torch.tensor([1.0, 2.0])), InvalidTokensError, "integer tensor, got dtype torch.float32"
    ),
    "bool tensor": Case(insert_owned(torch.tensor([True, False])), InvalidTokensError, "got dtype torch.bool"),
    "id 2**32": Case(match([1, 2**32]), InvalidTokensError, "allowed token ids are 0 .. 4294967295"),
    "float array typecode": Case(match(array("d", [1.0])), InvalidTokensError, "typecode 'd'"),
    "bool list": Case(match([True, False]), InvalidTokensError, "of type bool"),
    "int namespace": Case(match([1], 1), NamespaceError, "got int"),
    "bytes namespace": Case(insert_owned([1], b"a"), NamespaceError, "got bytes"),
    "tuple namespace": Case(acquire([1, 2], ("a",)), NamespaceError, "got tuple"),
    "unlocking twice": Case(lambda w: w.cache.unlock(w.released_handle), LockError, "released twice"),
    "unlocking a non-handle": Case(lambda w: w.cache.unlock("handle"), LockError, "got str"),
    "locking a stale match": Case(lambda w: w.cache.lock(w.stale_match), LockError, "stale match"),
    "freeing a block twice": Case(lambda w: w.cache.free([w.freed_block]), LockError, "not owned by the caller"),
    "freeing a tree block": Case(lambda w: w.cache.free([w.tree_block]), LockError, "not owned by the caller"),
    "freeing a block out of range": Case(lambda w: w.cache.free([8]), InvalidArgumentError, "must be in 0..7"),
    "inserting with too few blocks": Case(
        lambda w: w.cache.insert(list(range(9)), [w.owned_block]), InvalidArgumentError, "9 tokens need 3 blocks"
    ),
    "inserting with a freed block": Case(
        lambda w: w.cache.insert([1, 2], [w.freed_block]), LockError, "neither owned by the caller nor cached"
    ),
    "inserting with a tree block after an owned one": Case(
        lambda w: w.cache.insert(list(range(6)), [w.owned_block, w.tree_block]), LockError, "not owned by the caller"
    ),
    "inserting new tokens into a borrowed tree block": Case(
        lambda w: w.cache.insert([40, 41], [w.tree_block], "fresh"), InvalidArgumentError, "borrowed"
    ),
    "inserting with 2-D block ids": Case(
        lambda w: w.cache.insert([1], [[w.owned_block]]), InvalidArgumentError, "1-D sequence of ints"
    ),
    "inserting with float block ids": Case(
        lambda w: w.cache.insert([1], [float(w.owned_block)]), InvalidArgumentError, "1-D sequence of ints"
    ),
    "lease committed twice": Case(
        lambda w: w.cache.commit(w.committed_lease, [*TEN, 11]), LockError, "commit on a closed lease"
    ),
    "lease released after commit": Case(lambda w: w.cache.release(w.committed_lease), LockError, "released twice"),
    "reserve on a committed lease": Case(lambda w: w.cache.reserve(w.committed_lease, 20), LockError, "closed lease"),
    "commit not starting with the matched prefix": Case(
        lambda w: w.cache.commit(w.open_lease, [9, 9, 9, 9, 9]), InvalidTokensError, "must start with the prefix"
    ),
    "commit of more tokens than the lease holds": Case(
        lambda w: w.cache.commit(w.open_lease, [1, 2, 3, 4, 50, 51]), InvalidArgumentError, "need 2 blocks"
    ),
    "reserve beyond the pool": Case(
        lambda w: w.cache.reserve(w.open_lease, 33), CapacityError, "33 tokens need 9 blocks"
    ),
    "allocation larger than the pool": Case(
        lambda w: w.cache.allocate(9), CapacityError, "9 blocks needed but the pool only has 8 blocks"
    ),
    "allocation short because the rest is locked": Case(
        lambda w: w.cache.allocate(5), PoolBusyError, "5 blocks needed, only 4 can be had now (3 free + 1 evictable)"
    ),
    "negative allocation": Case(lambda w: w.cache.allocate(-1), InvalidArgumentError, "non-negative int"),
    "float allocation": Case(lambda w: w.cache.allocate(1.0), InvalidArgumentError, "non-negative int"),
    "negative eviction": Case(lambda w: w.cache.evict(-1), InvalidArgumentError, "non-negative int, got -1"),
    "str eviction": Case(lambda w: w.cache.evict("3"), InvalidArgumentError, "non-negative int, got '3'"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input_raises_and_changes_nothing_it_should_not(case: Case) -> None:
    world = build_world()
    if case.effect == "evict_all":
        twin = build_world().cache
        twin.evict_all()
        expected = snapshot(twin)
    else:
        expected = snapshot(world.cache)

    with pytest.raises(PrefixCacheError) as raised:
        case.call(world)

    assert raised.type is case.error
    assert case.message in str(raised.value)
    assert snapshot(world.cache) == expected
    world.cache.check_invariants()


def test_an_allocation_that_cannot_be_met_evicts_nothing() -> None:
    world = build_world()
    before = {ns: world.cache.cached_sequences(ns) for ns in NAMESPACES}
    evictable = world.cache.stats().evictable_tokens

    with pytest.raises(PoolBusyError):
        world.cache.allocate(5)

    assert {ns: world.cache.cached_sequences(ns) for ns in NAMESPACES} == before
    assert world.cache.stats().evictable_tokens == evictable > 0


ACCEPTED_FORMS = {
    "list": [1, 2, 3, 4, 5, 6, 99],
    "tuple": (1, 2, 3, 4, 5, 6, 99),
    "array('I')": array("I", [1, 2, 3, 4, 5, 6, 99]),
    "array('q')": array("q", [1, 2, 3, 4, 5, 6, 99]),
    "numpy int64": np.array([1, 2, 3, 4, 5, 6, 99], dtype=np.int64),
    "numpy uint32": np.array([1, 2, 3, 4, 5, 6, 99], dtype=np.uint32),
    "torch int64": torch.tensor([1, 2, 3, 4, 5, 6, 99], dtype=torch.int64),
    "torch int32": torch.tensor([1, 2, 3, 4, 5, 6, 99], dtype=torch.int32),
    "range": range(1, 7),
}


@pytest.mark.parametrize("tokens", ACCEPTED_FORMS.values(), ids=ACCEPTED_FORMS.keys())
def test_every_accepted_token_form_matches_the_same(tokens: Any) -> None:
    cache = RadixCache(KVBlockPool(8, 4))
    blocks = cache.allocate(3)
    cache.insert(TEN, blocks, "a")

    result = cache.match(tokens, "a")

    assert result.num_tokens == 6
    assert result.block_table.tolist() == blocks[:2].tolist()
