"""Choose a replica for a prompt by the exact number of its tokens that replica has cached.

Each replica's cached blocks are mirrored in a :class:`~prefixcache.cache.events.BlockIndex` fed by its KV events
(in process, or over ZMQ with :mod:`prefixcache.distributed.subscriber`).  A prompt's full blocks are named by
chained hashes (:func:`~prefixcache.cache.events.block_hashes`); because a radix cache holds whole prefixes, the
blocks a replica holds of a prompt are always its first ``k`` ones, so ``k`` is found by binary search:
O(log(prompt blocks)) set lookups per replica, after hashing the prompt once.

The decision, as NVIDIA Dynamo's KV router and SGLang's cache-aware router make it, but on exact block hashes:

1. The best replica by score ``cached_tokens - penalty * (load - min_load) - memory_cost``; ties go to the
   replica with more free blocks (when replicas report them), then the less loaded one, then the lower index.
   ``penalty`` is ``load_penalty_tokens`` per unit of load, or, with ``relative_above`` set,
   ``load_penalty_tokens * min(1, relative_above / mean_load)``: relative to the mean
   load once it passes ``relative_above``, since one request ahead matters when replicas have served ten each and
   hardly at all when they have served two hundred.  So early on a short shared prefix is spread for balance, and
   later a conversation (or a group sharing a first turn) stays with its cached prefix while the load guard below
   keeps the balance.

   ``memory_cost`` prices the memory a request takes, so that replicas fill evenly when together they barely hold
   the working set (one LRU cache overflowing evicts exactly the prefixes that come back next, whatever the
   router does).  With each replica's free blocks and pool size (which a replica publishes beside its KV events),
   ``memory_cost = memory_weight * uncached_tokens * (max_free - free) / num_blocks``: the prompt tokens the
   replica would have to store, times how much fuller it is than the emptiest replica.  A conversation coming back
   to its replica stores little there and stays; a prompt with little cached anywhere goes where memory is
   plentiful instead of where requests were fewest, so the fleet evicts more like one LRU cache of all its
   memory.  (NVIDIA Dynamo's KV router prices the blocks a request must *prefill*; this prices the blocks it must
   *keep*, by how full the replica already is.)
   ``evict_cost = evict_weight * max(0, uncached_tokens + expected_new_tokens - free_tokens)`` prices what the
   request would make a *full* replica evict: the tokens it stores there (its uncached prompt and the answer the
   caller expects, say the mean answer seen so far) beyond that replica's free blocks.  Once a replica is full,
   the least recently used prefixes it drops are those of the conversations due back soonest, so a short
   conversation coming back to a full replica goes where memory is free (losing its few cached tokens) rather
   than push out a longer one; a long one still stays.
2. If that replica's load is too far above the lightest one (``load - min_load > max(imbalance_abs,
   imbalance_rel * mean_load)``), power of two choices instead: two random replicas, the less loaded one
   (Mitzenmacher), ignoring the cache, so one hot prefix cannot pile work onto one replica.  Judging the
   preferred replica rather than the whole fleet (as Ray's router does) keeps every other conversation where its
   prefix is while one replica is busy.

   With ``continuation_rel`` set, a *continuation* (the chosen replica holds at least ``continuation_share`` of
   the prompt) is judged against the mean instead: power of two choices only when ``load - mean_load >
   max(continuation_abs, continuation_rel * mean_load)``.  Moving a conversation that came back loses its whole
   cached prefix and stores it twice, and those duplicates are what overflows replicas that together barely hold
   the working set; new conversations, whose move costs little, keep the tight guard, so the balance is kept by
   where new work goes.

``load`` is whatever the caller balances: requests in flight for a live router, requests served so far in the
``bench route`` simulation.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.cache.events import BlockIndex, block_hashes, check_hash_seed
from prefixcache.cache.pool import check_block_size
from prefixcache.errors import InvalidArgumentError

__all__ = ["ExactPrefixRouter", "RouteDecision", "cached_prefix_blocks", "power_of_two"]


def cached_prefix_blocks(index: BlockIndex, hashes: Sequence[int], namespace: str | None = None) -> int:
    """How many leading blocks of ``hashes`` ``index`` holds under ``namespace``.  O(log len(hashes)).

    Relies on the index being prefix-closed (true for any radix cache's events): if block ``j`` is held, so are
    blocks ``0..j-1``.
    """
    held = index.hashes
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if (namespace, hashes[mid - 1]) in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


def power_of_two(loads: Sequence[int], rng: random.Random) -> int:
    """Two distinct random replicas, the less loaded one (the first drawn on a tie).

    Raises:
        InvalidArgumentError: no replica.
    """
    if not loads:
        raise InvalidArgumentError("no replica to choose from")
    if len(loads) == 1:
        return 0
    a, b = rng.sample(range(len(loads)), 2)
    return b if loads[b] < loads[a] else a


def too_uneven(loads: Sequence[int], imbalance_abs: float, imbalance_rel: float) -> bool:
    """Whether ``max(loads) - min(loads)`` exceeds ``max(imbalance_abs, imbalance_rel * mean)``.

    Raises:
        InvalidArgumentError: no replica.
    """
    if not loads:
        raise InvalidArgumentError("no replica to judge")
    mean = sum(loads) / len(loads)
    return max(loads) - min(loads) > max(imbalance_abs, imbalance_rel * mean)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where a request goes and why: ``cached_tokens[i]`` is replica ``i``'s exact cached prefix (block-aligned)."""

    replica: int
    cached_tokens: tuple[int, ...]
    balanced_by_load: bool
    """True when loads were too uneven and power of two choices decided."""


class ExactPrefixRouter:
    """Scores replicas by the prompt tokens whose block hashes their :class:`BlockIndex` holds, minus a load penalty.

    Args:
        block_size: the replicas' block size in tokens (all replicas must share it, and ``hash_seed``).
        hash_seed: the replicas' ``hash_seed``.
        load_penalty_tokens: tokens of cached prefix one unit of extra load is worth ...
        relative_above: ... while the mean load is at most this; above it the penalty falls as ``1 / mean_load``
            (``None``: never, an absolute penalty, right for queue lengths).
        imbalance_abs: the preferred replica's load may exceed the lightest by this much before power of two
            choices takes over ...
        imbalance_rel: ... or by this fraction of the mean load, whichever is larger.
        memory_weight: weight of ``memory_cost`` (0: memory ignored; free blocks then only settle ties).
        evict_weight: weight of ``evict_cost``, per token a full replica would have to evict (0: off; needs
            ``free_blocks``).
        continuation_share: a request is a continuation when the chosen replica holds at least this share of its
            prompt ...
        continuation_abs: ... and then the load guard allows its replica this many requests above the mean ...
        continuation_rel: ... or this fraction of the mean, whichever is larger (``None``: continuations get the
            same guard as new work).
        seed: seed of the power-of-two draws.
        index_namespace: ``None`` for indexes fed over the wire (which keep every block under ``None``); the default
            ``...`` looks blocks up under the request's own namespace (indexes fed in process).

    Raises:
        InvalidArgumentError: ``block_size`` no cache accepts (an int in 1..256), ``hash_seed`` outside
            ``[0, 2**64)``, a penalty or weight that is negative or not finite, a threshold that is negative or NaN
            (``inf`` turns its guard off), or ``continuation_share`` outside ``(0, 1]``.
    """

    def __init__(
        self,
        block_size: int,
        *,
        hash_seed: int = 0,
        load_penalty_tokens: float = 0.0,
        relative_above: float | None = None,
        imbalance_abs: float = 8,
        imbalance_rel: float = 0.1,
        memory_weight: float = 0.0,
        evict_weight: float = 0.0,
        continuation_share: float = 0.5,
        continuation_abs: float = 4,
        continuation_rel: float | None = None,
        seed: int = 0,
        index_namespace: object = ...,
    ) -> None:
        check_block_size(block_size)
        check_hash_seed(hash_seed)
        weights = (load_penalty_tokens, memory_weight, evict_weight)
        thresholds = (imbalance_abs, imbalance_rel, continuation_abs, continuation_rel or 0)
        # ``not 0 <= x`` is true for NaN too.
        if not all(0 <= w < math.inf for w in weights) or not all(0 <= t for t in thresholds):
            raise InvalidArgumentError(
                f"penalties and weights must be finite and >= 0, thresholds >= 0, got {weights} and {thresholds}"
            )
        if relative_above is not None and not relative_above > 0:
            raise InvalidArgumentError(f"relative_above must be > 0 or None, got {relative_above}")
        if not 0 < continuation_share <= 1:
            raise InvalidArgumentError(f"continuation_share must be in (0, 1], got {continuation_share}")
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.load_penalty_tokens = load_penalty_tokens
        self.relative_above = relative_above
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self.memory_weight = memory_weight
        self.evict_weight = evict_weight
        self.continuation_share = continuation_share
        self.continuation_abs = continuation_abs
        self.continuation_rel = continuation_rel
        self.index_namespace = index_namespace
        self._rng = random.Random(seed)

    def cached_tokens(
        self, token_ids: Sequence[int], indexes: Sequence[BlockIndex], namespace: str | None = None
    ) -> list[int]:
        """Per replica, the prompt's leading tokens it holds in full blocks.  O(prompt + replicas * log blocks)."""
        hashes = block_hashes(token_ids, self.block_size, namespace, self.hash_seed)
        key = namespace if self.index_namespace is ... else self.index_namespace
        return [cached_prefix_blocks(index, hashes, key) * self.block_size for index in indexes]

    def choose(
        self,
        token_ids: Sequence[int],
        indexes: Sequence[BlockIndex],
        loads: Sequence[int],
        namespace: str | None = None,
        tiebreak: Sequence[int] | None = None,
        free_blocks: Sequence[int] | None = None,
        num_blocks: Sequence[int] | None = None,
        expected_new_tokens: float = 0.0,
    ) -> RouteDecision:
        """Pick a replica for a prompt (see the module docstring for the rule).  ``tiebreak`` (say, requests routed
        so far) settles ties of score and load before the index does, so equal replicas share new prompts.
        ``free_blocks`` and ``num_blocks`` (blocks, per replica) enable the memory cost; ``free_blocks`` alone only
        settles ties (and enables the eviction cost).  ``expected_new_tokens``: tokens the request is expected to
        add after its prompt (its answer), for the eviction cost.

        Raises:
            InvalidArgumentError: no replica; ``indexes``, ``loads`` (and ``tiebreak``, ``free_blocks``,
                ``num_blocks``) of different lengths; a load, tiebreak or free block count that is negative or not
                finite; ``num_blocks`` without ``free_blocks``, or one below 1, not finite, or below its replica's
                ``free_blocks``; an ``expected_new_tokens`` that is negative or not finite.
            InvalidTokensError, NamespaceError: a prompt or namespace no cache would accept.
            Nothing changes when it raises (the power-of-two draws included).
        """
        n = len(loads)
        if not indexes or len(indexes) != n or any(x is not None and len(x) != n for x in (tiebreak, free_blocks)):
            raise InvalidArgumentError(
                f"need one load (and tiebreak, free block count) per index, got {len(indexes)} indexes and {n} loads"
            )
        for name, values in (("loads", loads), ("tiebreak", tiebreak), ("free_blocks", free_blocks)):
            # ``0 <= x < inf`` is false for NaN too.
            if values is not None and not all(0 <= x < math.inf for x in values):
                raise InvalidArgumentError(f"{name} must be finite and >= 0, got {list(values)}")
        if num_blocks is not None and (
            free_blocks is None
            or len(num_blocks) != n
            or not all(1 <= p < math.inf and f <= p for p, f in zip(num_blocks, free_blocks, strict=True))
        ):
            raise InvalidArgumentError("num_blocks needs free_blocks, one finite pool size >= 1 and >= free each")
        if not 0 <= expected_new_tokens < math.inf:
            raise InvalidArgumentError(f"expected_new_tokens must be finite and >= 0, got {expected_new_tokens}")
        cached = self.cached_tokens(token_ids, indexes, namespace)
        low = min(loads)
        mean = sum(loads) / n
        per_unit = self.load_penalty_tokens
        if self.relative_above is not None and mean > self.relative_above:
            per_unit *= self.relative_above / mean
        memory = [0.0] * n
        if free_blocks is not None and num_blocks is not None and self.memory_weight > 0:
            most_free = max(free_blocks)
            memory = [
                self.memory_weight * (len(token_ids) - cached[i]) * (most_free - free_blocks[i]) / num_blocks[i]
                for i in range(n)
            ]
        if free_blocks is not None and self.evict_weight > 0:
            for i in range(n):
                stored = len(token_ids) - cached[i] + expected_new_tokens
                memory[i] += self.evict_weight * max(0.0, stored - free_blocks[i] * self.block_size)
        best = max(
            range(n),
            key=lambda i: (
                cached[i] - per_unit * (loads[i] - low) - memory[i],
                free_blocks[i] if free_blocks is not None else 0,
                -loads[i],
                -tiebreak[i] if tiebreak is not None else 0,
                -i,
            ),
        )
        share = cached[best] / len(token_ids) if len(token_ids) else 0.0
        continuation = self.continuation_rel is not None and share >= self.continuation_share
        if continuation:
            uneven = loads[best] - mean > max(self.continuation_abs, self.continuation_rel * mean)
        else:
            uneven = loads[best] - low > max(self.imbalance_abs, self.imbalance_rel * mean)
        if uneven:
            return RouteDecision(power_of_two(loads, self._rng), tuple(cached), True)
        return RouteDecision(best, tuple(cached), False)
