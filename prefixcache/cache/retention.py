"""Retention: shared prefixes a caller asks the cache to keep, ahead of everything else, for a while.

Keeping a long system prompt or a few-shot preamble is the most requested prefix-caching feature in vLLM's and
SGLang's trackers (SGLang's priority-aware radix cache is one answer).  Here a caller marks the nodes of a cached prefix
with a ``priority`` (a positive int) and, optionally, a retention time in seconds.  Eviction candidates are ordered by
priority first (:class:`~prefixcache.cache.evictor.Evictor` puts it at the head of every key), so a retained node goes
only when no unretained candidate (or one of lower priority) is left, or once its retention has expired; expiry resets
its priority to 0.

A cap, ``max_retained_fraction`` of the pool's blocks, keeps retention from starving requests: marking stops at the
first node of the path (from the root) that would take the retained blocks past it.

Sizes kept incrementally: ``retained_tokens`` and ``retained_blocks`` (own blocks of retained nodes).  Deadlines sit in
a heap, so expiring costs O(log n) per retention that ends.  Callers hold the cache's mutex.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prefixcache.errors import InvalidArgumentError

if TYPE_CHECKING:
    from prefixcache.cache.evictor import Evictor
    from prefixcache.cache.node import Node


MAX_PRIORITY = 2**63 - 1
"""The largest retention priority: a snapshot stores it as a 64-bit count, so a larger one could not be restored."""


def check_retain(priority: object, retain_s: object) -> None:
    """Raises InvalidArgumentError unless ``priority`` is an int in 1..:data:`MAX_PRIORITY` and ``retain_s`` a
    positive number or None."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not 1 <= priority <= MAX_PRIORITY:
        raise InvalidArgumentError(f"priority must be an int from 1 to 2**63 - 1, got {priority!r}")
    if retain_s is not None and (
        isinstance(retain_s, bool) or not isinstance(retain_s, (int, float)) or not retain_s > 0
    ):
        raise InvalidArgumentError(f"retain_s must be a positive number of seconds or None, got {retain_s!r}")


def path_to(node: Node) -> list[Node]:
    """The nodes from the root's child down to ``node``, root side first (empty for a root).  O(depth)."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


def check_fraction(fraction: object) -> float:
    """``fraction`` as a float in ``[0, 1]``.

    Raises:
        InvalidArgumentError: anything else.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise InvalidArgumentError(f"max_retained_fraction must be a number in [0, 1], got {fraction!r}")
    return float(fraction)


def _seconds(retain_s: float) -> float:
    # An int too large for a float (10**400) retains for ever, as math.inf does, instead of an OverflowError.
    try:
        return float(retain_s)
    except OverflowError:
        return math.inf


class Retention:
    """The retained nodes of one tree: their priorities, deadlines and sizes, and the cap on them.

    ``clock`` gives seconds (``time.monotonic`` unless a test drives it).
    """

    def __init__(
        self,
        num_blocks: int,
        evictor: Evictor,
        max_retained_fraction: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cap_blocks = int(check_fraction(max_retained_fraction) * num_blocks)
        if not callable(clock):
            raise InvalidArgumentError(f"clock must be callable (returning seconds), got {clock!r}")
        self.evictor = evictor
        self.clock = clock
        self.retained_tokens = 0
        self.retained_blocks = 0
        self.deadlines: list[tuple[float, int, Node]] = []
        self._seq = itertools.count()

    def retain(self, path: list[Node], priority: int, retain_s: float | None) -> int:
        """Mark the nodes of ``path`` (root side first) with ``priority`` until ``retain_s`` seconds from now
        (forever when None).  A node keeps the higher of its old and new priority and the later deadline.  Stops at
        the first node that would exceed the cap.  Returns the tokens of ``path`` now retained.  O(len(path) log n).
        """
        if self.deadlines:
            self.expire()  # an expired node is marked afresh, not revived with its old priority
        until = None if retain_s is None else self.clock() + _seconds(retain_s)
        covered = 0
        for node in path:
            if not node.priority:
                own = node.num_own_blocks
                if self.retained_blocks + own > self.cap_blocks:
                    break
                self.retained_blocks += own
                self.retained_tokens += len(node.tokens)
                node.priority = priority
                node.retain_until = until
            else:
                node.priority = max(node.priority, priority)
                if node.retain_until is not None:
                    node.retain_until = None if until is None else max(node.retain_until, until)
            if node.retain_until is not None:
                heapq.heappush(self.deadlines, (node.retain_until, next(self._seq), node))
            self.evictor.refresh(node)
            covered += len(node.tokens)
        return covered

    def expire(self) -> int:
        """Drop every retention whose deadline has passed; returns how many.  O(log n) each."""
        now = self.clock()
        deadlines = self.deadlines
        expired = 0
        while deadlines and deadlines[0][0] <= now:
            until, _, node = heapq.heappop(deadlines)
            if node.evicted or not node.priority or node.retain_until != until:
                continue  # evicted, or re-marked since: a newer entry (or none) stands for it
            self.retained_blocks -= node.num_own_blocks
            self.retained_tokens -= len(node.tokens)
            node.priority = 0
            node.retain_until = None
            self.evictor.refresh(node)
            expired += 1
        return expired

    def split(self, upper: Node) -> None:
        """``upper`` was cut off a retained node and copied its retention: it needs its own deadline entry."""
        if upper.retain_until is not None:
            heapq.heappush(self.deadlines, (upper.retain_until, next(self._seq), upper))

    def removed(self, node: Node, num_tokens: int, num_blocks: int) -> None:
        """``num_tokens`` tokens and ``num_blocks`` own blocks of retained ``node`` left the cache."""
        self.retained_tokens -= num_tokens
        self.retained_blocks -= num_blocks
