"""Recompute preemption for the engine core: which running request gives its blocks back when another runs short.

A running request whose next block cannot be had (the pool is held by the other running requests) does not fail:
running requests are preempted, latest admitted first, until the block can be had or the request itself is the one
preempted (vLLM V1's scheduler: the last request in the running queue is the victim, and a request that is itself
the last preempts itself).  A preempted request commits the tokens whose K/V it has computed, so they stay cached
(unlocked, evictable) and its resumption mostly hits the cache, releases its lease and goes back to the front of
the waiting queue; re-admitted, it matches its prompt and the tokens it generated, recomputes the rest and samples on
(vLLM's "recompute" preemption, where the tree makes the recomputation a prefix hit).

Only the policy lives here; :class:`~prefixcache.engine.core.EngineCore` does the preempting.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TypeVar

from prefixcache.errors import CapacityError, OutOfBlocksError, PoolBusyError

R = TypeVar("R")


def can_preempt_for(error: BaseException) -> bool:
    """Whether ``error`` from reserving a running request's blocks is a shortage that preempting others can cure:
    :class:`PoolBusyError` (running requests hold what it needs) or a bare :class:`OutOfBlocksError`, but not a
    :class:`CapacityError` saying the request needs more than the whole pool."""
    return isinstance(error, PoolBusyError) or (
        isinstance(error, OutOfBlocksError) and not isinstance(error, CapacityError)
    )


def choose_victim(running: Sequence[R], protected: Collection[R], needing: R) -> R | None:
    """The request to preempt so that ``needing`` may get its blocks, or None when there is none to preempt.

    ``running`` is in admission order; ``protected`` are the requests already in this step's batch (their rows
    address their blocks, so they keep them until the forward has run).  The victim is the latest admitted request
    not protected, which may be ``needing`` itself; None when ``needing`` is the only running request (nothing else
    holds the pool, so no preemption can make room: the request fails).  O(len(running)).
    """
    if len(running) <= 1:
        return None
    for request in reversed(running):
        if request not in protected:
            return request
    return None
