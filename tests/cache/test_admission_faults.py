"""Exception-safe admission: a fault in any function that acquire / reserve / commit / release calls leaves the cache
quiescent once the request is given up (issue 11, item 6).

One setup exercises every path at once: a matched prefix ending inside a block (copy-on-write), an unhealed seam on
the matched path (healed at admission), a lock point inside a node (split), a pool too full for the request (eviction).
Each internal function is faulted on each of its calls in turn; a test first checks it is called at all.
"""

from __future__ import annotations

import pytest

from prefixcache import KVBlockPool, Lease, RadixCache
from prefixcache.testing import InjectedFault, assert_quiescent, fail_on_call

BS = 4
PROMPT = list(range(100, 114))  # 14 tokens
NUM_TOKENS = 22


def setup() -> RadixCache:
    cache = RadixCache(KVBlockPool(12, BS))
    for seq in (PROMPT[:6], [1] * 9, [2] * 9):
        lease = cache.acquire(seq, num_tokens=len(seq))
        cache.commit(lease, seq)
    pin = cache.lock(cache.match(PROMPT[:6]))  # keeps the seam at token 6 from healing at insert
    # A request writing block 1's free rows in place makes the next one copy that block: a seam.
    extending = cache.acquire([*PROMPT[:6], 0, 0], num_tokens=8)
    lease = cache.acquire(PROMPT[:10], num_tokens=12)
    assert (extending.num_copied_tokens, lease.num_copied_tokens) == (0, 2)
    cache.commit(lease, [*PROMPT[:10], 9, 9])  # the request's match ends inside this edge: it copies
    cache.release(extending)
    cache.unlock(pin)
    return cache


def run_request(cache: RadixCache) -> None:
    """The runner's flow: admit, grow, commit; give everything back on any error."""
    lease: Lease | None = None
    try:
        lease = cache.acquire(PROMPT, num_tokens=NUM_TOKENS, request_id="r1")
        cache.reserve(lease, NUM_TOKENS + 2)
        cache.commit(lease, PROMPT + [5] * 10)
    except BaseException:
        if lease is not None and not lease.closed:
            cache.release(lease)
        raise


def targets(cache: RadixCache) -> dict[str, object]:
    return {
        "tree": cache._tree,
        "blocks": cache._blocks,
        "locks": cache._locks,
        "counters": cache._counters,
        "pool": cache.pool,
        "retention": cache._tree.retention,
    }


REQUEST_FUNCTIONS = [
    ("tree", "match"),
    ("tree", "own_tokens"),
    ("tree", "lock_point"),
    ("tree", "split"),
    ("tree", "heal_seam"),
    ("tree", "share_parent_block"),
    ("tree", "lock_path"),
    ("tree", "unlock_path"),
    ("tree", "evict"),
    ("tree", "insert"),
    ("locks", "lock"),
    ("locks", "unlock"),
    ("blocks", "allocate"),
    ("blocks", "check_feasible"),
    ("blocks", "insert_owned"),
    ("blocks", "as_block_ids"),
    ("blocks", "distinct"),
    ("counters", "record_query"),
    ("counters", "record_request"),
    ("pool", "allocate"),
    ("pool", "incref"),
    ("pool", "decref"),
    ("pool", "copy_rows"),
]


def test_the_setup_reaches_every_path() -> None:
    cache = setup()
    cache.check_invariants()
    run_request(cache)
    stats = cache.stats()
    assert stats.evicted_blocks > 0
    assert_quiescent(cache)


@pytest.mark.parametrize(("owner", "name"), REQUEST_FUNCTIONS)
def test_a_fault_in_any_admission_function_leaves_the_cache_quiescent(owner: str, name: str) -> None:
    cache = setup()
    with fail_on_call(targets(cache)[owner], name, 10**9) as calls:
        run_request(cache)
    num_calls = calls[0]
    assert num_calls > 0, f"{owner}.{name} is never called: the setup misses a path"
    for k in range(1, num_calls + 1):
        cache = setup()
        with fail_on_call(targets(cache)[owner], name, k), pytest.raises(InjectedFault):
            run_request(cache)
        assert_quiescent(cache)
        run_request(cache)  # and the cache still serves the request
        assert_quiescent(cache)


RELEASE_FUNCTIONS = [("pool", "decref"), ("locks", "unlock"), ("tree", "unlock_path")]


@pytest.mark.parametrize(("owner", "name"), RELEASE_FUNCTIONS)
def test_a_release_that_fails_midway_can_be_called_again(owner: str, name: str) -> None:
    cache = setup()
    lease = cache.acquire(PROMPT, num_tokens=NUM_TOKENS, request_id="r1")
    with fail_on_call(targets(cache)[owner], name, 1), pytest.raises(InjectedFault):
        cache.release(lease)
    cache.check_invariants()
    cache.release(lease)
    assert_quiescent(cache)


def extending_setup(branch: bool) -> tuple[RadixCache, Lease]:
    """A lease writing block 1 in place; with ``branch``, another request's branch inside that block cached since."""
    cache = RadixCache(KVBlockPool(8, BS))
    lease = cache.acquire(PROMPT[:6], num_tokens=6)
    cache.commit(lease, PROMPT[:6])
    lease = cache.acquire(PROMPT[:7], num_tokens=8)
    assert lease.num_copied_tokens == 0  # block 1's free rows are the lease's
    if branch:
        other = cache.acquire(PROMPT[:8], num_tokens=8)
        cache.commit(other, PROMPT[:8])
    return cache, lease


@pytest.mark.parametrize(
    ("branch", "tokens", "name"),
    [
        (False, PROMPT[:6], "decref"),  # commit gives the extended block back to its node alone
        (True, [*PROMPT[:7], 0], "copy_rows"),  # commit copies the extended block for a leaf below the branch
        (True, [*PROMPT[:7], 0], "decref"),
    ],
)
def test_a_fault_in_the_commit_of_a_block_extended_in_place_leaves_the_cache_quiescent(
    branch: bool, tokens: list[int], name: str
) -> None:
    # Found by a randomized fault run: a fault here left the lease's blocks neither its own nor given back (release
    # raised LockError, a block leaked), or the copy allocated but in no table (a block owned forever).
    cache, lease = extending_setup(branch)
    with fail_on_call(cache.pool, name, 1), pytest.raises(InjectedFault):
        cache.commit(lease, tokens)
    if not lease.closed:
        cache.release(lease)
    assert_quiescent(cache)
    cache.evict_all()
    assert cache.stats().free_blocks == cache.stats().num_blocks


INSERT_PREFIX_FUNCTIONS = [
    ("tree", "match"),
    ("tree", "lock_point"),
    ("tree", "split"),
    ("tree", "insert"),
    ("tree", "lock_path"),
    ("tree", "unlock_path"),
    ("locks", "lock"),
    ("locks", "unlock"),
    ("blocks", "allocate"),
    ("blocks", "insert_owned"),
    ("pool", "allocate"),
    ("pool", "incref"),
    ("pool", "decref"),
    ("pool", "copy_rows"),
]


def insert_prefix_setup(extending: bool) -> tuple[RadixCache, Lease]:
    """A lease that has written its prompt: one extending block 1 in place (``extending``), or one with no match."""
    cache = RadixCache(KVBlockPool(8, BS))
    if extending:
        lease = cache.acquire(PROMPT[:6], num_tokens=6)
        cache.commit(lease, PROMPT[:6])
    lease = cache.acquire(PROMPT, num_tokens=NUM_TOKENS)
    assert lease.num_copied_tokens == 0
    return cache, lease


def run_insert_prefix(cache: RadixCache, lease: Lease, length: int) -> None:
    """A running request caches its first ``length`` tokens, then finishes; gives everything back on any error."""
    try:
        cache.insert_prefix(lease, PROMPT[:length])
        cache.commit(lease, PROMPT + [5] * 8)
    except BaseException:
        if not lease.closed:
            cache.release(lease)
        raise


@pytest.mark.parametrize("length", [7, 10, 13])  # inside the extended block, past it inside a block, further on
@pytest.mark.parametrize("extending", [True, False])
@pytest.mark.parametrize(("owner", "name"), INSERT_PREFIX_FUNCTIONS)
def test_a_fault_in_insert_prefix_leaves_the_lease_releasable_and_the_cache_quiescent(
    owner: str, name: str, extending: bool, length: int
) -> None:
    # Found by a randomized fault run: a fault in insert_prefix after its allocation of the partial block's copy
    # (copy_rows) left that copy owned by nobody's table, and one after the insert (the lock of the new path, the
    # unlock of the old, the hold on a block extended in place taken again) left the lease's table naming blocks the
    # tree had taken: release() raised LockError, the lease's later blocks leaked, a new lock stayed held forever.
    cache, lease = insert_prefix_setup(extending)
    with fail_on_call(targets(cache)[owner], name, 10**9) as calls:
        run_insert_prefix(cache, lease, length)
    for k in range(1, calls[0] + 1):
        cache, lease = insert_prefix_setup(extending)
        with fail_on_call(targets(cache)[owner], name, k), pytest.raises(InjectedFault):
            run_insert_prefix(cache, lease, length)
        assert_quiescent(cache)
        cache.evict_all()
        assert cache.stats().free_blocks == cache.stats().num_blocks


class DecrefFaultWhileUndoing:
    """Arm with :meth:`arm` at the first fault; the next ``decref`` of ``pool`` then raises once (a second fault, in
    the undo of the first)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pool: KVBlockPool) -> None:
        self.armed, self._decref = False, pool.decref
        monkeypatch.setattr(pool, "decref", self)

    def arm(self) -> None:
        self.armed = True

    def __call__(self, blocks: object) -> object:
        if self.armed:
            self.armed = False
            raise InjectedFault("injected fault in decref while undoing")
        return self._decref(blocks)


@pytest.mark.parametrize("first_fault", ["copy_rows", "record_query"])
def test_a_fault_while_undoing_a_failed_acquire_still_drops_its_lock(
    monkeypatch: pytest.MonkeyPatch, first_fault: str
) -> None:
    # A second fault while acquire gives back what it took (the copy-on-write source's reference, or the blocks it
    # allocated) used to skip the rest of the undo: the lock stayed held, the path unevictable for good; and a
    # decref that raised left its blocks referenced by nobody.
    cache = setup()
    second = DecrefFaultWhileUndoing(monkeypatch, cache.pool)

    def fail(*args: object, **kwargs: object) -> None:
        second.arm()
        raise InjectedFault(f"injected fault in {first_fault}")

    monkeypatch.setattr(cache.pool if first_fault == "copy_rows" else cache._counters, first_fault, fail)
    with pytest.raises(InjectedFault, match="while undoing") as raised:
        cache.acquire(PROMPT, num_tokens=NUM_TOKENS, request_id="r1")
    assert str(raised.value.__context__) == f"injected fault in {first_fault}"
    monkeypatch.undo()
    stats = cache.stats()
    assert stats.locked_tokens == 0
    assert not cache._locks.handles
    assert int(cache._blocks.owned.sum()) == 0
    cache.check_invariants()
    cache.evict_all()
    assert cache.stats().free_blocks == stats.num_blocks  # the interrupted decref was repeated: no block lost


def test_a_refusal_whose_undo_faults_still_counts_as_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixcache.errors import OutOfBlocksError

    cache = setup()
    second = DecrefFaultWhileUndoing(monkeypatch, cache.pool)
    allocate = cache._blocks.allocate

    def out_of_blocks(count: int, what: str) -> object:
        if what == "copy-on-write":  # refused there, acquire recomputes the rows instead; let it copy
            return allocate(count, what)
        second.arm()
        raise OutOfBlocksError("injected: no blocks")

    monkeypatch.setattr(cache._blocks, "allocate", out_of_blocks)
    before = cache.stats().rejected_requests
    with pytest.raises(InjectedFault) as raised:
        cache.acquire(PROMPT, num_tokens=NUM_TOKENS, request_id="r1")
    assert isinstance(raised.value.__context__, OutOfBlocksError)
    monkeypatch.undo()
    assert cache.stats().rejected_requests == before + 1
    cache.check_invariants()
