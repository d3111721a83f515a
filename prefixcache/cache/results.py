"""What the cache's operations return: a match, an insert, an eviction, a promotion from host memory, as frozen
records.

Kept apart from the tree that makes them (:mod:`prefixcache.cache.tree`) so that every layer above reads them without
the tree's machinery; :class:`~prefixcache.RadixCache` hands them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from prefixcache.cache.node import Node


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a query.

    ``num_tokens`` is exact (not rounded to blocks).  ``block_table`` (int32, ``ceil(num_tokens / block_size)``
    block ids) addresses the KV of those tokens; when ``num_tokens % block_size != 0`` its last block is shared and
    only its first ``num_tokens % block_size`` rows belong to this prefix.  ``node`` is what
    :meth:`~prefixcache.RadixCache.lock` takes; the result goes stale if that node is evicted, or shortened below
    ``num_tokens`` by block-granular eviction, before it is locked.
    """

    num_tokens: int
    block_table: np.ndarray
    namespace: str | None
    node: Node = field(repr=False)
    owner: object = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What an insert did: tokens newly cached, tokens that were cached already, blocks released."""

    num_new_tokens: int
    num_cached_tokens: int
    num_released_blocks: int


@dataclass(frozen=True, slots=True)
class EvictResult:
    """What one eviction call freed: ``num_blocks`` blocks back on the free list, ``num_nodes`` leaves removed from the
    tree, ``num_tokens`` tokens no longer cached (whole leaves and the tails cut off trimmed ones)."""

    num_blocks: int
    num_nodes: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Promotion:
    """What the host tier's promotion (:meth:`~prefixcache.cache.host.tier.HostTier.promote`) did for a prompt: the
    device match before it (``device_tokens``) and the end of the promoted blocks (``host_end``, a token position;
    equal to ``device_tokens`` when nothing was promoted)."""

    device_tokens: int
    host_end: int

    def host_tokens(self, num_cached_tokens: int) -> int:
        """Of a request's ``num_cached_tokens``, those that came from host memory."""
        return max(0, min(num_cached_tokens, self.host_end) - self.device_tokens)
