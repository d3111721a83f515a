"""Eviction: which cached leaf goes first when the pool runs short.

The candidates are exactly the unlocked leaves of the radix tree.  They sit in a binary heap ordered by the
policy's priority, so adding, re-ranking and popping the next victim cost O(log n) and removing one costs
O(1) however large the tree is.  (SGLang rebuilds a heap of all evictable leaves on every eviction call,
which is O(n); keeping the set incrementally avoids that.)

A policy is a small object with a ``priority(node)`` method: a tuple, smallest evicted first.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Protocol, runtime_checkable

from prefixcache.errors import InvalidArgumentError


class EvictableNode(Protocol):
    """What a policy may read from a tree node."""

    node_id: int
    last_access: int
    hit_count: int


@runtime_checkable
class EvictionPolicy(Protocol):
    """Ranks eviction candidates: ``priority(node)`` is a tuple, smallest evicted first."""

    name: str

    def priority(self, node: EvictableNode) -> tuple[int, ...]: ...


class LRUPolicy:
    """Least recently used first, by the cache's logical clock (one tick per match or insert, not wall time)."""

    name = "lru"

    def priority(self, node: EvictableNode) -> tuple[int, ...]:
        return (node.last_access,)


class LFUPolicy:
    """Least frequently used first (hits since the node was created), ties broken by least recent use."""

    name = "lfu"

    def priority(self, node: EvictableNode) -> tuple[int, ...]:
        return (node.hit_count, node.last_access)


POLICIES: dict[str, type] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy object from its name (``"lru"``, ``"lfu"``) or the object itself.

    Raises:
        InvalidArgumentError: unknown name.
    """
    if isinstance(policy, str):
        try:
            return POLICIES[policy.lower()]()
        except KeyError:
            raise InvalidArgumentError(
                f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}"
            ) from None
    if not isinstance(policy, EvictionPolicy):
        raise InvalidArgumentError(f"an eviction policy needs a name and a priority(node) method, got {policy!r}")
    return policy


class Evictor:
    """The set of eviction candidates, ordered by a policy.

    Each member node carries the key it was filed under (``node.evict_key``, the policy's priority plus the
    node id), so it can be found again after its access time has moved on.  The heap (``heapq``, in C) holds
    ``(key, push number, node)`` entries; removing or re-ranking a member leaves its old entry behind, and an
    entry whose key is no longer its node's key is stale and skipped when it reaches the top.  This is much
    cheaper in CPython than a sorted container's O(log n) Python-level remove.  Stale entries are dropped
    whenever they outnumber the members, so the heap stays O(n) in size.

    ``add``, ``refresh``: O(log n); ``discard``: O(1); ``pop``: O(log n) amortized.
    """

    __slots__ = ("policy", "_heap", "_size", "_pushes")

    def __init__(self, policy: str | EvictionPolicy = "lru") -> None:
        self.policy = make_policy(policy)
        self._heap: list[tuple] = []
        self._size = 0
        # Breaks ties between a stale entry and a live one of equal key, so nodes are never compared.
        self._pushes = itertools.count()

    def __len__(self) -> int:
        return self._size

    def __contains__(self, node: object) -> bool:
        return getattr(node, "evict_key", None) is not None

    def add(self, node) -> None:
        """File ``node`` under its current priority (re-files it if it is a member already).  O(log n)."""
        if node.evict_key is None:
            self._size += 1
        self._push(node)

    def discard(self, node) -> None:
        """Remove ``node`` if it is a member.  O(1): its heap entry goes stale."""
        if node.evict_key is not None:
            node.evict_key = None
            self._size -= 1

    def refresh(self, node) -> None:
        """Re-rank a member whose access time or hit count changed (no-op for non-members).  O(log n)."""
        if node.evict_key is not None:
            self._push(node)

    def pop(self):
        """Remove and return the first victim.  Raises IndexError when empty."""
        heap = self._heap
        while True:
            key, _, node = heapq.heappop(heap)
            if node.evict_key is key:
                node.evict_key = None
                self._size -= 1
                return node

    def members(self) -> list:
        """The candidates in eviction order (for invariant checks and tests), O(n log n)."""
        return [node for key, _, node in sorted(self._heap) if node.evict_key is key]

    def _push(self, node) -> None:
        key = (*self.policy.priority(node), node.node_id)
        node.evict_key = key
        heap = self._heap
        if len(heap) > 2 * self._size + 64:
            heap[:] = [entry for entry in heap if entry[2].evict_key is entry[0]]
            heapq.heapify(heap)
        heapq.heappush(heap, (key, next(self._pushes), node))
