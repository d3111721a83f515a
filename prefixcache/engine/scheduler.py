"""Admission policy of the engine core: in which order waiting requests are admitted, and which wait for a prefill.

``"lpm"`` (prefix-aware), after SGLang's longest-prefix-match policy (Zheng et al., "SGLang: Efficient Execution of
Structured Language Model Programs", 2024):

- Waiting requests are admitted longest cached prefix first (ties in arrival order), so the requests that reuse the
  most run while their prefix is still cached.  Fairness bound: a request that has waited ``max_wait_steps`` steps
  is *due*; due requests are admitted before all others, in arrival order (preempted ones, due at once, first), and
  are never held back.  So a later arrival overtakes a request only during the first ``max_wait_steps`` steps that
  request waits.
- A waiting request whose prompt shares at least one block more with the prompt of a running request still in
  prefill than the cache holds now is held back until that prefill is inserted, then matched again: N requests
  that arrive together behind one uncached system prompt prefill it once, not N times.

``"fcfs"``: arrival order, no holding back.  Only the policy lives here; the core admits.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from prefixcache.cache.radix_cache import RadixCache
from prefixcache.engine.request import EngineRequest

__all__ = ["POLICIES", "admission_order", "held_back"]

POLICIES = ("lpm", "fcfs")
"""Admission policies: longest cached prefix first with shared prefills (``"lpm"``), or arrival order (``"fcfs"``)."""


def admission_order(
    waiting: Sequence[EngineRequest], cache: RadixCache, policy: str, max_wait_steps: int
) -> list[tuple[EngineRequest, int | None]]:
    """``(request, cached tokens)`` in the order to try, the count None where the request may not be held back:
    arrival order under ``"fcfs"``; under ``"lpm"`` the due requests in arrival order, then the others by cached
    prefix, longest first (ties in arrival order).  O(waiting x prompt) C-speed token comparison; counts nothing in
    the cache's stats."""
    if policy == "fcfs":
        return [(request, None) for request in waiting]
    due = [(r, None) for r in waiting if r.waited_steps >= max_wait_steps]
    others = [
        (r, cache.cached_length(r.prompt_array, r.namespace, for_prefill=True))
        for r in waiting
        if r.waited_steps < max_wait_steps
    ]
    others.sort(key=lambda pair: (-pair[1], pair[0].arrival))
    return due + others


def held_back(request: EngineRequest, cached: int, running: Sequence[EngineRequest], block_size: int) -> bool:
    """Whether a running request still in prefill will insert a prompt that gives ``request`` (``cached`` tokens
    cached now) at least one block (``block_size`` tokens) more cached prefix.  O(running x prompt)."""
    limit = len(request.prompt) - 1
    for other in running:
        if other.namespace != request.namespace or other.prompt_inserted or other.position >= len(other.prompt):
            continue
        shared = min(common_prefix(request.prompt_array, other.prompt_array), limit)
        if shared - cached >= block_size:
            return True
    return False


def common_prefix(a: array, b: array) -> int:
    """Length of the common prefix of two token arrays (numpy views, no copy)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.frombuffer(a, dtype=np.uint32, count=n) != np.frombuffer(b, dtype=np.uint32, count=n))
    return int(diff[0]) if diff.size else n
