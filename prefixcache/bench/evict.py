"""The ``evict`` benchmark: the cost of one ``evict(1)`` call as the number of cached leaves grows.

Each tree is a shared 64-token prefix with ``n`` distinct one-block (16-token) sequences below it, so every
unlocked leaf is an eviction candidate and each ``evict(1)`` call frees exactly one block.  An evictor that
keeps its candidates sorted pays O(log n) a call; one that scans the leaves pays O(n), which shows up as a
100k/1k ratio near 100 instead of near 1.
"""

from __future__ import annotations

from array import array

import numpy as np

from prefixcache.bench.common import BenchResult, Table, frozen_gc, progress, us_per
from prefixcache.bench.device_clock import now_ns
from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.cache.tokens import TOKEN_TYPECODE

BLOCK_SIZE = 16
PREFIX_BLOCKS = 4
MAX_CALLS = 10_000


def build_tree(num_leaves: int, *, seed: int = 0, show_progress: bool = True) -> RadixCache:
    """A cache holding a 64-token prefix and ``num_leaves`` distinct one-block leaves under it, pool exactly sized."""
    rng = np.random.default_rng(seed)
    prefix_len = PREFIX_BLOCKS * BLOCK_SIZE
    prefix = rng.integers(0, 2**31, prefix_len, dtype=np.uint32)
    suffixes = rng.integers(0, 2**31, (num_leaves, BLOCK_SIZE), dtype=np.uint32)
    # A distinct first token per leaf, so the leaves never share a node below the prefix.
    suffixes[:, 0] = np.arange(num_leaves, dtype=np.uint32)
    rows = np.concatenate((np.broadcast_to(prefix, (num_leaves, prefix_len)), suffixes), axis=1)
    seq_blocks = PREFIX_BLOCKS + 1
    pool = KVBlockPool(PREFIX_BLOCKS + num_leaves + seq_blocks, BLOCK_SIZE, device="cpu")
    cache = RadixCache(pool)
    for row in progress(rows, f"evict: build {num_leaves:,} leaves", num_leaves, show_progress):
        cache.insert(array(TOKEN_TYPECODE, row.tobytes()), cache.allocate(seq_blocks))
    return cache


def time_evictions(cache: RadixCache, num_calls: int, rounds: int = 5) -> float:
    """Microseconds per ``evict(1)`` call: ``num_calls`` calls in ``rounds`` timed rounds, the best round's mean.

    Raises:
        AssertionError: a call did not free exactly one block.
    """
    evict = cache.evict
    per_round = max(num_calls // rounds, 1)
    best = float("inf")
    for _ in range(rounds):
        start = now_ns()
        results = [evict(1) for _ in range(per_round)]
        best = min(best, us_per(now_ns() - start, per_round))
        assert all(r.num_blocks == 1 and r.num_nodes == 1 for r in results), "each call evicts one one-block leaf"
    return best


def run(quick: bool = False) -> BenchResult:
    """Time ``evict(1)`` on trees of 1k, 10k and 100k leaves (100, 1k, 10k with ``quick``)."""
    sizes = (100, 1_000, 10_000) if quick else (1_000, 10_000, 100_000)
    per_call: dict[int, float] = {}
    calls: dict[int, int] = {}
    for num_leaves in sizes:
        cache = build_tree(num_leaves, show_progress=not quick)
        # At most half the leaves, so the tree stays within a factor 2 of its nominal size while timed.
        calls[num_leaves] = min(num_leaves // 2, MAX_CALLS)
        with frozen_gc():
            per_call[num_leaves] = time_evictions(cache, calls[num_leaves])
        cache.check_invariants()
    smallest, largest = sizes[0], sizes[-1]
    ratio = per_call[largest] / per_call[smallest]
    rows = tuple((f"{n:,}", calls[n], per_call[n], f"{per_call[n] / per_call[smallest]:.2f}x") for n in sizes)
    table = Table(
        title=(
            f"evict: one evict(1) call, block size {BLOCK_SIZE}, "
            f"leaves under a {PREFIX_BLOCKS * BLOCK_SIZE}-token prefix"
        ),
        headers=("cached leaves", "calls", "us/call (best of 5 rounds)", f"vs {smallest:,}"),
        rows=rows,
        notes=(f"{largest:,}/{smallest:,} ratio: {ratio:.2f} (goal: flat, O(log n)); times are thread CPU time.",),
    )
    data = {
        "block_size": BLOCK_SIZE,
        "us_per_call": {str(n): per_call[n] for n in sizes},
        "calls": {str(n): calls[n] for n in sizes},
        "ratio_largest_to_smallest": ratio,
    }
    return BenchResult("evict", (table,), data)
