"""Hit accounting: tokens asked for and found, overall and over a window of recent requests, and the stats record.

A token a request finds on nodes it inserted itself (a retried request, named by the same ``request_id``) counts as
a *self-hit*, never as a hit, so a retry loop cannot inflate the hit rate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from prefixcache.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the cache.  Tokens are token counts, blocks block counts.

    ``query_tokens`` / ``hit_tokens`` count the tokens asked for and found by :meth:`~prefixcache.RadixCache.match`
    and :meth:`~prefixcache.RadixCache.acquire`; ``hit_rate = hit_tokens / query_tokens``.  Tokens found on nodes
    inserted by the same ``request_id`` as the query's (a retried request finding its own tokens) count as
    ``self_hit_tokens`` instead, never as hits.  The ``window_*`` fields cover the last ``window_requests``
    :meth:`~prefixcache.RadixCache.acquire` calls (at most the cache's ``hit_rate_window``): ``window_hit_rate`` is
    the recent hit rate.  A request refused at admission (not enough blocks) counts in ``rejected_requests`` only,
    in none of the token counters.  ``evictions`` counts leaves evicted from, whole or in part (block-granular
    eviction shortens a leaf before it removes it); ``evicted_tokens`` / ``evicted_blocks`` what went.
    ``retained_tokens`` / ``retained_blocks`` are what retention keeps (:mod:`prefixcache.cache.retention`);
    ``evictable_blocks`` what evicting every unlocked node would free.

    With a host-memory tier (:mod:`prefixcache.cache.host.tier`): ``host_hit_tokens`` of the hit tokens were promoted
    from host memory (the rest, ``device_hit_tokens``, were on the device already); ``host_num_blocks`` /
    ``host_used_blocks`` size the host pool; ``demoted_blocks``, ``promoted_blocks`` and ``host_dropped_blocks``
    count blocks moved to host, brought back, and dropped by the host LRU.  All 0 without a host tier.

    In a cache that resumes recurrent states (``resume_states=True``, :mod:`prefixcache.cache.resume`): hits count
    only the tokens resumed (what the request really skips); ``resume_shortfall_tokens`` the tokens that matched but
    could not be resumed, no state being kept at or after them.  ``num_states`` / ``state_bytes`` are the states kept
    and their bytes, within ``max_state_bytes``; ``evicted_states`` counts states evicted to stay within it (their
    KV stays), ``dropped_states`` states not kept (larger than the whole budget, or handed over at a position the
    tree does not hold), ``kv_evicted_states`` states freed because KV eviction took their position;
    ``num_branch_marks`` the branch positions marked for a state (:mod:`prefixcache.cache.marks`).  All 0 when the
    cache does not resume states.
    """

    num_blocks: int
    block_size: int
    free_blocks: int
    used_blocks: int
    cached_tokens: int
    evictable_tokens: int
    locked_tokens: int
    num_nodes: int
    query_tokens: int
    hit_tokens: int
    evictions: int
    evicted_tokens: int
    evicted_blocks: int
    self_hit_tokens: int = 0
    window_requests: int = 0
    window_query_tokens: int = 0
    window_hit_tokens: int = 0
    rejected_requests: int = 0
    retained_tokens: int = 0
    retained_blocks: int = 0
    evictable_blocks: int = 0
    host_hit_tokens: int = 0
    host_num_blocks: int = 0
    host_used_blocks: int = 0
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    host_dropped_blocks: int = 0
    resume_shortfall_tokens: int = 0
    num_states: int = 0
    state_bytes: int = 0
    max_state_bytes: int = 0
    evicted_states: int = 0
    dropped_states: int = 0
    kv_evicted_states: int = 0
    num_branch_marks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def device_hit_tokens(self) -> int:
        """Hit tokens found in the device pool (not promoted from host memory)."""
        return self.hit_tokens - self.host_hit_tokens

    @property
    def device_hit_rate(self) -> float:
        return self.device_hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.host_hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def window_hit_rate(self) -> float:
        return self.window_hit_tokens / self.window_query_tokens if self.window_query_tokens else 0.0


class HitCounters:
    """Query, hit and self-hit token totals, and the last ``window`` requests' query and hit tokens.  O(1) per
    record."""

    def __init__(self, window: int) -> None:
        self.query_tokens = 0
        self.hit_tokens = 0
        self.self_hit_tokens = 0
        self.host_hit_tokens = 0  # of hit_tokens, those promoted from the host-memory tier
        self.rejected_requests = 0
        self.window: deque[tuple[int, int]] = deque(maxlen=window)
        self.window_query_tokens = 0
        self.window_hit_tokens = 0

    def record_query(self, query_tokens: int, found_tokens: int, own_tokens: int) -> None:
        """A lookup of ``query_tokens`` that found ``found_tokens``, ``own_tokens`` of them self-hits."""
        self.query_tokens += query_tokens
        self.hit_tokens += found_tokens - own_tokens
        self.self_hit_tokens += own_tokens

    def record_request(self, query_tokens: int, hit_tokens: int) -> None:
        """One admitted request, for the recent window (its tokens are recorded by :meth:`record_query` too)."""
        window = self.window
        if len(window) == window.maxlen:
            old_query, old_hit = window[0]
            self.window_query_tokens -= old_query
            self.window_hit_tokens -= old_hit
        window.append((query_tokens, hit_tokens))
        self.window_query_tokens += query_tokens
        self.window_hit_tokens += hit_tokens


def collect_stats(pool: Any, tree: Any, counters: HitCounters, host: Any, states: Any) -> CacheStats:
    """The :class:`CacheStats` of a cache made of ``pool``, ``tree`` (a :class:`~prefixcache.cache.tree.RadixTree`),
    ``counters``, its host tier and its state store (each None when absent).  Expired retentions are dropped first.
    O(1)."""
    if tree.retention.deadlines:
        tree.retention.expire()
    fields = {
        "num_blocks": pool.num_blocks,
        "block_size": pool.block_size,
        "free_blocks": pool.num_free_blocks,
        "used_blocks": pool.num_used_blocks,
        "cached_tokens": tree.cached_tokens,
        "evictable_tokens": tree.evictable_tokens,
        "locked_tokens": tree.locked_tokens,
        "num_nodes": tree.num_nodes,
        "query_tokens": counters.query_tokens,
        "hit_tokens": counters.hit_tokens,
        "evictions": tree.evictions,
        "evicted_tokens": tree.evicted_tokens,
        "evicted_blocks": tree.evicted_blocks,
        "self_hit_tokens": counters.self_hit_tokens,
        "window_requests": len(counters.window),
        "window_query_tokens": counters.window_query_tokens,
        "window_hit_tokens": counters.window_hit_tokens,
        "rejected_requests": counters.rejected_requests,
        "retained_tokens": tree.retention.retained_tokens,
        "retained_blocks": tree.retention.retained_blocks,
        "evictable_blocks": tree.evictable_blocks,
    }
    if host is not None:
        fields["host_hit_tokens"] = counters.host_hit_tokens
        fields["host_num_blocks"] = host.pool.num_blocks
        fields["host_used_blocks"] = host.pool.num_used_blocks
        fields["demoted_blocks"] = host.demoted_blocks
        fields["promoted_blocks"] = host.promoted_blocks
        fields["host_dropped_blocks"] = host.dropped_blocks
    if states is not None:
        fields.update(states.stats())
    return CacheStats(**fields)


def check_request_id(request_id: object) -> None:
    """Raises InvalidArgumentError unless ``request_id`` is None or a str: it is stored on the nodes a request inserts
    and saved in snapshots (a UUID there failed the save), and compared with later queries' ids."""
    if request_id is not None and type(request_id) is not str:
        raise InvalidArgumentError(f"request_id must be a str or None, got {type(request_id).__name__}")
