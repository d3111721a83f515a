"""Belady's offline optimal eviction, and LRU beside it, on a block-level model of a prefix cache.

The model.  A request's token sequence (prompt + answer) is cut into full blocks of ``block_size`` tokens; a block
is named by *all* tokens up to its end (a chained key, as vLLM hashes blocks), so equal names mean an equal prefix,
and block ``i`` of a sequence can only be reused after block ``i - 1``.  A request hits the leading blocks of its
prompt that are cached, up to the blocks inside its first ``len(prompt) - 1`` tokens (the last prompt token is
always computed, as :meth:`prefixcache.cache.radix_cache.RadixCache.acquire` does); then every block of its sequence is
touched, and the missing ones are offered to the cache in order.  The cache holds ``capacity`` blocks.

Both policies keep the cached set *prefix-closed* (a cached block's parent is cached), which is what makes "leading
hits" equal "hits", and the tree-shaped cache of :mod:`prefixcache.cache.radix_cache` has the same property:

- LRU ranks a block by the last request that touched it, and within one request evicts the deepest block first
  (the radix tree evicts leaves), so a parent is never evicted before its child.
- Belady (Belady 1966, "MIN") evicts the block whose next use by a prompt is farthest in the future, deepest first
  on ties.  A parent is used by every prompt that uses its child, so its next use is never later.  An offered
  block that is itself the farthest is not admitted (bypass), and neither is anything deeper in that request.

Belady's rule is optimal for plain paging.  Here a request only hits its leading run of cached blocks, and then
farthest-next-use can fall short of the true offline optimum on rare traces (``tests/test_bench_policy.py`` has one:
2 hits against 3); it never exceeds it and always beats or ties LRU in the tests, so it serves as the practical
upper bound for the online policies.  Next uses are precomputed from the whole request list.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from prefixcache.cache.tokens import TokenIds, as_token_array
from prefixcache.errors import InvalidArgumentError

POLICIES = ("lru", "belady")


@dataclass(frozen=True, slots=True)
class BlockTrace:
    """A request list as chains of block ids (dense ints ``0 .. num_blocks - 1``).

    ``blocks[offsets[r]:offsets[r + 1]]`` are request ``r``'s full sequence blocks in order; only the first
    ``hit_limit[r]`` of them can be hits.  ``next_use`` (same layout as ``blocks``) is, for each access, the index of
    the next request whose hittable prompt blocks include that block, or ``num_requests`` if none does.
    ``depth[b]`` is block ``b``'s index in every sequence that holds it.  ``num_blocks`` is the working set of an
    unbounded block cache.
    """

    block_size: int
    num_blocks: int
    prompt_tokens: int
    blocks: np.ndarray
    offsets: np.ndarray
    hit_limit: np.ndarray
    next_use: np.ndarray
    depth: np.ndarray

    @property
    def num_requests(self) -> int:
        return len(self.hit_limit)


@dataclass(frozen=True, slots=True)
class SimResult:
    """What one simulated pass found.  ``hit_tokens = hit_blocks * block_size``; the hit rate is over all prompt
    tokens, the same denominator as the radix tree's ``hit_rate``."""

    policy: str
    capacity_blocks: int
    hit_blocks: int
    hit_tokens: int
    prompt_tokens: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def build_block_trace(requests: Iterable[tuple[TokenIds, TokenIds]], block_size: int) -> BlockTrace:
    """The block trace of ``(prompt, answer)`` token-id pairs, in request order.

    Block names are interned exactly (a dict keyed by parent id and the block's token bytes), so there are no hash
    collisions.  O(total tokens) plus a sort of all accesses.

    Raises:
        InvalidArgumentError: ``block_size < 1``.  InvalidTokensError: bad token ids (as ``as_token_array``).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
    names: dict[tuple[int, bytes], int] = {}
    depth: list[int] = []
    flat: list[int] = []
    offsets = [0]
    hit_limit: list[int] = []
    prompt_tokens = 0
    for prompt, answer in requests:
        prompt = as_token_array(prompt)
        sequence = prompt + as_token_array(answer, allow_empty=True)
        data = sequence.tobytes()
        step = block_size * sequence.itemsize
        parent = -1
        for i in range(len(sequence) // block_size):
            key = (parent, data[i * step : (i + 1) * step])
            block = names.get(key)
            if block is None:
                block = names[key] = len(depth)
                depth.append(i)
            flat.append(block)
            parent = block
        offsets.append(len(flat))
        hit_limit.append((len(prompt) - 1) // block_size)
        prompt_tokens += len(prompt)
    blocks = np.asarray(flat, dtype=np.int32)
    offsets_arr = np.asarray(offsets, dtype=np.int64)
    limits = np.asarray(hit_limit, dtype=np.int32)
    return BlockTrace(
        block_size=block_size,
        num_blocks=len(depth),
        prompt_tokens=prompt_tokens,
        blocks=blocks,
        offsets=offsets_arr,
        hit_limit=limits,
        next_use=_next_prompt_use(blocks, offsets_arr, limits),
        depth=np.asarray(depth, dtype=np.int32),
    )


def _next_prompt_use(blocks: np.ndarray, offsets: np.ndarray, hit_limit: np.ndarray) -> np.ndarray:
    """For each access, the next request (after its own) whose hittable prompt blocks hold the same block."""
    num_requests = len(hit_limit)
    n = len(blocks)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    lengths = np.diff(offsets)
    request = np.repeat(np.arange(num_requests, dtype=np.int32), lengths)
    index_in_request = np.arange(n) - np.repeat(offsets[:-1], lengths)
    in_prompt = index_in_request < np.repeat(hit_limit, lengths)
    # Sorted by block, then by time: each block's accesses are contiguous and in order.
    order = np.lexsort((np.arange(n), blocks))
    sorted_blocks = blocks[order]
    prompt_positions = np.where(in_prompt[order], np.arange(n), n)
    # The first prompt access at or after each sorted position; shift by one for "strictly after".
    first_from = np.minimum.accumulate(prompt_positions[::-1])[::-1]
    following = np.append(first_from[1:], n)
    same_block = following < n
    same_block[same_block] = sorted_blocks[following[same_block]] == sorted_blocks[same_block]
    next_sorted = np.full(n, num_requests, dtype=np.int32)
    next_sorted[same_block] = request[order][following[same_block]]
    out = np.empty(n, dtype=np.int32)
    out[order] = next_sorted
    return out


def simulate(trace: BlockTrace, capacity_blocks: int, policy: str) -> SimResult:
    """Replay ``trace`` through a cache of ``capacity_blocks`` blocks under ``policy`` (``"lru"`` or ``"belady"``).

    O(accesses) for LRU (an ordered dict), O(accesses * log capacity) for Belady (a heap with lazy deletion); a
    capacity that holds every block takes a vectorized shortcut (nothing is evicted, so every policy is the same).

    Raises:
        InvalidArgumentError: ``capacity_blocks < 1`` or an unknown policy.
    """
    if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) or capacity_blocks < 1:
        raise InvalidArgumentError(f"capacity_blocks must be a positive int, got {capacity_blocks!r}")
    if policy not in POLICIES:
        raise InvalidArgumentError(f"unknown policy {policy!r}; choose one of {POLICIES}")
    if capacity_blocks >= trace.num_blocks:
        hits, evictions = _unbounded_hits(trace), 0
    elif policy == "lru":
        hits, evictions = _simulate_lru(trace, capacity_blocks)
    else:
        hits, evictions = _simulate_belady(trace, capacity_blocks)
    return SimResult(policy, capacity_blocks, hits, hits * trace.block_size, trace.prompt_tokens, evictions)


def _unbounded_hits(trace: BlockTrace) -> int:
    """Hits when nothing is ever evicted (every policy agrees): a prompt block hits iff an earlier request had it."""
    n = len(trace.blocks)
    if n == 0:
        return 0
    lengths = np.diff(trace.offsets)
    request = np.repeat(np.arange(trace.num_requests), lengths)
    in_prompt = np.arange(n) - np.repeat(trace.offsets[:-1], lengths) < np.repeat(trace.hit_limit, lengths)
    first_request = np.full(trace.num_blocks, trace.num_requests)
    np.minimum.at(first_request, trace.blocks, request)
    return int((in_prompt & (first_request[trace.blocks] < request)).sum())


def _simulate_lru(trace: BlockTrace, capacity: int) -> tuple[int, int]:
    blocks = trace.blocks.tolist()
    offsets = trace.offsets.tolist()
    limits = trace.hit_limit.tolist()
    # Oldest first.  Within a request the order is deepest .. shallowest, so the deepest goes first.
    order: OrderedDict[int, None] = OrderedDict()
    move = order.move_to_end
    hits = evictions = 0
    for r, limit in enumerate(limits):
        chain = blocks[offsets[r] : offsets[r + 1]]
        k = 0
        for block in chain:
            if block not in order:
                break
            k += 1
        hits += min(k, limit)
        cached = chain[:k]
        admit = min(len(chain), capacity) - k
        if admit <= 0:
            for block in reversed(cached):
                move(block)
            continue
        excess = len(order) + admit - capacity
        if excess > 0:
            for block in reversed(cached):  # out of reach of the evictions below
                move(block)
            for _ in range(excess):
                order.popitem(last=False)
            evictions += excess
        for block in reversed(chain[k : k + admit]):
            order[block] = None
        for block in reversed(cached):
            move(block)
    return hits, evictions


def _simulate_belady(trace: BlockTrace, capacity: int) -> tuple[int, int]:
    blocks = trace.blocks.tolist()
    next_use = trace.next_use.tolist()
    offsets = trace.offsets.tolist()
    limits = trace.hit_limit.tolist()
    num_blocks = max(trace.num_blocks, 1)
    # A block's rank is next_use * span + depth (farthest first, deepest on ties); a heap entry is
    # -(rank * num_blocks + block), so the heap's top is the victim.  Entries go stale when a block is re-ranked
    # or evicted and are skipped when they surface.
    span = int(trace.depth.max()) + 1 if trace.num_blocks else 1
    rank = [-1] * num_blocks  # -1: not cached
    heap: list[int] = []
    push, pop = heapq.heappush, heapq.heappop
    size = hits = evictions = 0
    for r, limit in enumerate(limits):
        lo, hi = offsets[r], offsets[r + 1]
        k = 0
        for j in range(lo, hi):
            block = blocks[j]
            if rank[block] < 0:
                break
            k += 1
            new_rank = next_use[j] * span + (j - lo)
            rank[block] = new_rank
            push(heap, -(new_rank * num_blocks + block))
        hits += min(k, limit)
        for j in range(lo + k, hi):
            block = blocks[j]
            new_rank = next_use[j] * span + (j - lo)
            if size >= capacity:
                while True:
                    victim_rank, victim = divmod(-heap[0], num_blocks)
                    if rank[victim] == victim_rank:
                        break
                    pop(heap)
                if victim_rank <= new_rank:
                    break  # the offered block is the farthest: bypass it and the rest of the chain
                pop(heap)
                rank[victim] = -1
                size -= 1
                evictions += 1
            rank[block] = new_rank
            push(heap, -(new_rank * num_blocks + block))
            size += 1
        if len(heap) > 4 * capacity + 4096:
            heap = [-(rank[b] * num_blocks + b) for b in range(num_blocks) if rank[b] >= 0]
            heapq.heapify(heap)
    return hits, evictions
