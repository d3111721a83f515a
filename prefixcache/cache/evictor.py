"""Eviction: which cached leaf goes first when the pool runs short.

The candidates are exactly the unlocked leaves of the radix tree.  They sit in a
``sortedcontainers.SortedList`` ordered by the policy's priority, so adding, removing, re-ranking and
popping the next victim each cost O(log n) however large the tree is.  (SGLang rebuilds a heap of all
evictable leaves on every eviction call, which is O(n); keeping the set incrementally avoids that.)

A policy is a small object with a ``priority(node)`` method: a tuple of ints, smallest evicted first.  A retained
node (:mod:`prefixcache.cache.retention`, priority >= 1) is filed under ``(RETAINED, priority, *policy key, node_id)``
and any other under ``(*policy key, node_id)``: ``RETAINED`` is larger than any int, so a retained prefix goes only once
no unretained candidate is left, lower priority first.  The order is that of ``(priority, *policy key, node_id)`` with
priority 0 when not retained, but the common, unretained key stays as short as before retention existed: keys are
compared O(log c) times per lock and unlock, and a shared leading 0 in each of them cost measurable time (issue 11).
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

from sortedcontainers import SortedList

from prefixcache.errors import InvalidArgumentError

RETAINED = math.inf


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

    __slots__ = ("policy", "_order", "_nodes", "_builtin")

    def __init__(self, policy: str | EvictionPolicy = "lru") -> None:
        self.policy = make_policy(policy)
        self._order: SortedList = SortedList()
        self._nodes: dict[int, object] = {}
        # The built-in policies' keys are built inline: a call to priority() and unpacking its tuple cost as much
        # as the rest of add.
        self._builtin = {LRUPolicy: "lru", LFUPolicy: "lfu"}.get(type(self.policy))

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node: object) -> bool:
        return getattr(node, "evict_key", None) is not None

    def key(self, node) -> tuple:
        """The key ``node`` is filed under (see the module docstring)."""
        if node.priority:
            return (RETAINED, node.priority, *self.policy.priority(node), node.node_id)
        return (*self.policy.priority(node), node.node_id)

    def add(self, node) -> None:
        builtin = self._builtin
        if node.priority:
            key = (RETAINED, node.priority, *self.policy.priority(node), node.node_id)
        elif builtin == "lru":
            key = (node.last_access, node.node_id)
        elif builtin == "lfu":
            key = (node.hit_count, node.last_access, node.node_id)
        else:
            key = (*self.policy.priority(node), node.node_id)
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

    def pop(self):
        """Remove and return the first victim. Raises IndexError when empty."""
        key = self._order.pop(0)
        node = self._nodes.pop(key[-1])
        node.evict_key = None
        return node

    def members(self) -> list:
        """The candidates in eviction order (for invariant checks and tests), O(n)."""
        return [self._nodes[key[-1]] for key in self._order]
