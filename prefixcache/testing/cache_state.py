"""What a cache's state must be: :func:`snapshot` records what a rejected call must not change, and
:func:`assert_quiescent` checks what must hold once no request is running (invariants, no lock, no block owned by a
caller).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixcache.cache.radix_cache import CacheStats, RadixCache

__all__ = ["CacheSnapshot", "assert_engine_quiescent", "assert_quiescent", "snapshot"]


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """What a rejected call must leave as it was: counters, cached sequences, reference counts, the free set."""

    stats: CacheStats
    sequences: dict[str | None, list[tuple[int, ...]]]
    ref_counts: tuple[int, ...]
    free_block_ids: tuple[int, ...]
    owned_block_ids: tuple[int, ...]


def snapshot(cache: RadixCache, namespaces: Iterable[str | None]) -> CacheSnapshot:
    """Record ``cache``'s observable state (the sequences of ``namespaces`` sorted, so order does not matter)."""
    with cache._mutex:
        return CacheSnapshot(
            stats=cache.stats(),
            sequences={ns: sorted(tuple(s) for s in cache.cached_sequences(ns)) for ns in namespaces},
            ref_counts=tuple(cache.pool.ref_counts().tolist()),
            free_block_ids=tuple(sorted(cache.pool.free_block_ids().tolist())),
            owned_block_ids=tuple(np.flatnonzero(cache._blocks.owned).tolist()),
        )


def assert_quiescent(cache: RadixCache) -> None:
    """Assert the state of a cache no request is using: invariants hold, nothing is locked, no lock handle is
    registered, and no block is owned by a caller (every used block is held by the tree).

    Raises:
        AssertionError: naming what is wrong.
    """
    with cache._mutex:
        cache.check_invariants()
        stats = cache.stats()
        assert stats.locked_tokens == 0, f"{stats.locked_tokens} tokens still locked"
        assert not cache._locks.handles, f"{len(cache._locks.handles)} lock handles still registered"
        owned = int(cache._blocks.owned.sum())
        assert owned == 0, f"{owned} blocks still owned by callers"
        held = np.zeros(cache.pool.num_blocks, dtype=bool)
        for root in cache._tree.roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                held[node.blocks] = True
                stack.extend(node.children.values())
        assert int(held.sum()) == stats.used_blocks, (
            f"{stats.used_blocks} blocks in use but the tree holds {int(held.sum())}"
        )


def assert_engine_quiescent(engine: Any) -> None:
    """:func:`assert_quiescent` of a :class:`~prefixcache.engine.batching.BatchEngine`'s cache.  Module-level, so that
    a test runs it in an engine process on its engine thread between two steps
    (``EngineProcess.call(assert_engine_quiescent)``: the future holds the AssertionError)."""
    assert_quiescent(engine.runner.cache)
