"""Eviction: which cached leaf goes first when the pool runs short.

The candidates are exactly the unlocked leaves of the radix tree.  They sit in a
``sortedcontainers.SortedList`` ordered by the policy's priority, so adding, removing, re-ranking and
popping the next victim each cost O(log n) however large the tree is.  (SGLang rebuilds a heap of all
evictable leaves on every eviction call, which is O(n); keeping the set incrementally avoids that.)

A policy is a small object with a ``priority(node)`` method: a tuple, smallest evicted first.  Every key starts with
the node's retention priority (:mod:`prefixcache.cache.retention`; 0 when not retained), so a retained prefix goes
only once no unretained candidate is left.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from sortedcontainers import SortedList

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

    Each member node carries the key it was filed under (``node.evict_key``), so it can be found again after
    its access time has moved on.  All operations O(log n) in the number of candidates.
    """

    __slots__ = ("policy", "_order", "_nodes")

    def __init__(self, policy: str | EvictionPolicy = "lru") -> None:
        self.policy = make_policy(policy)
        self._order: SortedList = SortedList()
        self._nodes: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return getattr(node, "evict_key", None) is not None

    def key(self, node) -> tuple:
        """The key ``node`` is filed under: retention priority, the policy's priority, node id."""
        return (node.priority, *self.policy.priority(node), node.node_id)

    def add(self, node) -> None:
        key = (node.priority, *self.policy.priority(node), node.node_id)
        node.evict_key = key
        self._order.add(key)
        self._nodes[node.node_id] = node

    def discard(self, node) -> None:
        key = node.evict_key
        if key is not None:
            self._order.remove(key)
            del self._nodes[node.node_id]
            node.evict_key = None

    def refresh(self, node) -> None:
        """Re-rank a member whose access time or hit count changed (no-op for non-members)."""
        if node.evict_key is not None:
            self.discard(node)
            self.add(node)

    def first(self):
        """The next victim, left in place.  Raises IndexError when empty."""
        return self._nodes[self._order[0][-1]]

    def pop(self):
        """Remove and return the first victim. Raises IndexError when empty."""
        key = self._order.pop(0)
        node = self._nodes.pop(key[-1])
        node.evict_key = None
        return node

    def members(self) -> list:
        """The candidates in eviction order (for invariant checks and tests), O(n)."""
        return [self._nodes[key[-1]] for key in self._order]
