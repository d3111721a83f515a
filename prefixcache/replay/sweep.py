"""Every cache size in one pass: the LRU hit curve of a replay from stack distances.

LRU is a *stack algorithm* (Mattson, Gecsei, Slutz and Traiger, "Evaluation techniques for storage hierarchies",
IBM Systems Journal 9(2), 1970): the content of a cache of ``C`` blocks is always the top ``C`` entries of one
recency stack, so one pass that records each access's *stack distance* (its depth in the stack) gives the hits of
every capacity at once: an access hits a cache of ``C`` blocks iff its distance is at most ``C``.

The stack here is the radix tree's, at block granularity.  A block is named by every token up to its end (a
chained key, as vLLM hashes blocks); the last block of a sequence may be partial.  A request's whole sequence
(prompt and answer) is touched when it commits, so its blocks go to the top of the stack with the shallowest on top:
a parent is never older than its child, and within one request the deepest block goes first, which is the order in
which :mod:`prefixcache.cache.tree` trims the least recently used leaf from its tail.  Recency is kept as time
stamps in a Fenwick tree (a binary indexed tree over stamps), so a distance is a count of the live stamps at or
above a block's stamp: O(log n) per access, batched per request with numpy.

How the tree's blocks are counted.  A partial block that a later block at the same place extends (a chat's next turn
continues the previous answer inside its last block) is one pool block once the seam heals, so the shorter one
leaves the stack when the longer one is touched, and a sequence that ends inside a cached block touches that block.
Hits are token-exact as :meth:`prefixcache.RadixCache.acquire` counts them: the leading blocks of the prompt that are
cached, then the longest common prefix with any cached block at the next position (copy-on-write), at most
``len(prompt) - 1`` tokens in all.

Capacity is counted as the pool counts it, in blocks (``--cache-tokens N`` is ``ceil(N / block_size)`` blocks).  The
request in flight holds its whole path while it allocates (the matched prefix locked, its new blocks owned), and the
model has that path on top of the stack, so neither evicts it; a request larger than the pool is refused by the
replay, so sizes below ``min_blocks`` are the model's alone.

Where the tree is not a pure stack algorithm.  :meth:`SweepResult.hit_tokens` is exact for the block model above
(``tests/replay/test_sweep.py`` checks it against a direct simulation at every size).  The radix tree evicts as this
stack does: a lookup refreshes only the blocks it matched, a partial block is extended in place where no other branch
holds rows past its end, eviction trims a leaf down to the block it shares with its parent and heals a sibling's seam
when the sharing leaf goes (:mod:`prefixcache.cache.tree`, :mod:`prefixcache.cache.seams`).  Two things remain that one
recency stack cannot follow, both capacity-dependent and both rare:

- the request in flight holds blocks it does not keep: a copy of a partial block another branch goes on writing, and
  blocks for tokens its commit then finds cached (a repeated request allocates its whole answer again); at a full
  pool each of them evicts a least recently used block that the stack keeps;
- "a sequence ending inside a cached block touches it" assumes the block that extends it is still cached, which at a
  pool too small to keep it is not.

Measured against separate ``--cache-tokens`` replays at 6 sizes from the smallest pool to the working set on the
whole shared files (byte tokenizer, block size 16, ``tests/replay/test_sweep_shared.py``): equal token for token on
MT-Bench and both Mooncake traces at every size; OpenAssistant 9 tokens apart at the smallest pool (0.0017 points),
tau-bench 48 tokens of 50.7 million at a quarter of the working set (0.0001 points), equal at the other sizes; equal
everywhere when nothing is evicted.  ``--check-knee`` replays the tree at the knee for the exact figure there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from sortedcontainers import SortedList

from prefixcache.cache.tokens import TokenIds, as_token_array
from prefixcache.errors import InvalidArgumentError
from prefixcache.replay.ideal import common_prefix_tokens

__all__ = ["SweepResult", "sweep_lru"]


@dataclass(frozen=True, slots=True)
class SweepResult:
    """The LRU hit curve of one request list.

    ``hits_by_blocks[c]`` is the number of prompt tokens served from a cache of ``c`` blocks of ``block_size``
    tokens (index 0 is 0 hits); from ``len(hits_by_blocks) - 1`` blocks on, nothing is ever evicted and the hits stay
    at the last value, ``unlimited_hit_tokens``.  ``min_blocks`` is the smallest pool that replays the list (its
    largest request's prompt and answer at once, as :func:`~prefixcache.replay.requests.smallest_pool_tokens`).
    """

    block_size: int
    num_requests: int
    prompt_tokens: int
    min_blocks: int
    hits_by_blocks: np.ndarray
    whole_block_hits_by_blocks: np.ndarray

    def whole_block_hit_tokens(self, capacity_blocks: int) -> int:
        """Of :meth:`hit_tokens`, those in whole shared blocks (no copied rows): the measure of
        :mod:`prefixcache.replay.belady`, to set beside its bound.  O(1)."""
        hits = self.whole_block_hits_by_blocks
        return int(hits[min(int(capacity_blocks), len(hits) - 1)]) if len(hits) else 0

    @property
    def unlimited_hit_tokens(self) -> int:
        """Hits of a cache that never evicts (tokens)."""
        return int(self.hits_by_blocks[-1]) if len(self.hits_by_blocks) else 0

    @property
    def working_set_blocks(self) -> int:
        """The smallest number of blocks at which the hits equal the unlimited hits."""
        hits = self.hits_by_blocks
        if not len(hits):
            return 0
        below = np.flatnonzero(hits < hits[-1])
        return int(below[-1]) + 1 if len(below) else 0

    def hit_tokens(self, capacity_blocks: int) -> int:
        """Prompt tokens hit by a cache of ``capacity_blocks`` blocks.  O(1).

        Raises:
            InvalidArgumentError: ``capacity_blocks`` is not a non-negative int.
        """
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, (int, np.integer)):
            raise InvalidArgumentError(f"capacity_blocks must be an int, got {capacity_blocks!r}")
        if capacity_blocks < 0:
            raise InvalidArgumentError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        hits = self.hits_by_blocks
        return int(hits[min(int(capacity_blocks), len(hits) - 1)]) if len(hits) else 0

    def hit_rate(self, capacity_blocks: int) -> float:
        """``hit_tokens(capacity_blocks) / prompt_tokens`` (0 without prompt tokens)."""
        return self.hit_tokens(capacity_blocks) / self.prompt_tokens if self.prompt_tokens else 0.0


class _Fenwick:
    """Counts of live time stamps, a binary indexed tree (Fenwick 1994) updated and queried in numpy batches.

    Index ``size + 1`` is a sink for updates that run past the end (never read), so every batch takes the same
    ``levels`` steps without masks."""

    __slots__ = ("tree", "size", "levels", "live")

    def __init__(self, size: int) -> None:
        self.size = size
        self.levels = max(size, 1).bit_length() + 1
        self.tree = np.zeros(size + 2, dtype=np.int64)
        self.live = 0

    def add(self, stamps: np.ndarray, delta: int) -> None:
        """Add ``delta`` at each stamp (0-based, below ``size``).  O(k log n)."""
        index = stamps.astype(np.int64) + 1
        tree, sink = self.tree, self.size + 1
        for _ in range(self.levels):
            np.add.at(tree, index, delta)
            index = np.minimum(index + (index & -index), sink)
        self.live += delta * len(stamps)

    def at_or_above(self, stamps: np.ndarray) -> np.ndarray:
        """For each stamp, how many live stamps are at or above it.  O(k log n)."""
        index = stamps.astype(np.int64)  # live stamps strictly below: the prefix sum of 1-based [1, stamp]
        below = np.zeros(len(index), dtype=np.int64)
        tree = self.tree
        for _ in range(self.levels):
            below += tree[index]  # tree[0] is 0
            index = index - (index & -index)
        return self.live - below


def _lcp_tokens(a: bytes, b: bytes) -> int:
    """Longest common prefix, in 4-byte tokens, of two token byte strings."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n // 4
    lo, hi = 0, n
    while lo < hi:  # bisection on C-speed slice compares
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo // 4


def sweep_lru(requests: Iterable[tuple[TokenIds, TokenIds]], block_size: int) -> SweepResult:
    """The hits of an LRU prefix cache at every capacity, in one pass over ``(prompt, answer)`` pairs in order
    (see the module docstring for the model and the source of the idea).

    Blocks are named exactly (a child is found by its parent and token bytes, so no hash collisions); a request
    reuses the names of the earlier sequence it shares the most tokens with (found in O(log n) among the sequences in
    token order, as :class:`~prefixcache.replay.ideal.IdealCache` does), so only its new blocks cost a lookup.
    O(total tokens) C-speed work plus
    O(blocks touched x log(blocks touched)) for the distances, and O(siblings) per branching position a prompt
    passes for the partial-block hits.  Memory: a few ints per block touched.

    Raises:
        InvalidArgumentError: ``block_size < 1``.  InvalidTokensError: bad token ids (as ``as_token_array``).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be a positive int, got {block_size!r}")
    pairs = [(as_token_array(p), as_token_array(a, allow_empty=True)) for p, a in requests]
    bs = block_size
    total_slots = sum(-(-(len(p) + len(a)) // bs) for p, a in pairs)
    fenwick = _Fenwick(total_slots + 1)
    content: list[bytes] = []  # block id -> its token bytes; a block is found from its parent (-1: the root)
    # Per block id: its stamp (-1: not in the stack: never touched, or merged into a longer block), and whether
    # its parent has two children or more (index -1, the last, stands for the root).
    stamp = np.full(total_slots + 1, -1, dtype=np.int64)
    branch = np.zeros(total_slots + 2, dtype=bool)
    # parent id -> first token (4 bytes) -> child ids, only where a parent has more than one child: only children
    # that agree on the first token can share a prefix
    kids: dict[int, dict[bytes, list[int]]] = {}
    first_kid: dict[int, int] = {}
    full_events: list[np.ndarray] = []
    step_at: list[int] = []
    step_by: list[int] = []
    clock = 0
    prompt_tokens = min_blocks = max_live = 0
    ordered = SortedList()  # (big-endian token bytes, request index): neighbours share the longest prefixes
    paths: list[list[int]] = []
    step = 4 * bs

    def find(parent: int, data: bytes) -> int | None:
        child = first_kid.get(parent)
        if child is None or content[child] == data:
            return child
        by_first = kids.get(parent)
        if by_first is not None:
            for other in by_first.get(data[:4], ()):
                if content[other] == data:
                    return other
        return None

    def block_of(parent: int, data: bytes) -> int:
        block = find(parent, data)
        if block is None:
            block = len(content)
            content.append(data)
            other = first_kid.setdefault(parent, block)
            if other != block:
                by_first = kids.get(parent)
                if by_first is None:
                    by_first = kids[parent] = {content[other][:4]: [other]}
                by_first.setdefault(data[:4], []).append(block)
                branch[parent] = True
        return block

    for index, (prompt, answer) in enumerate(pairs):
        sequence = prompt + answer
        data = sequence.tobytes() if sequence.itemsize == 4 else np.asarray(sequence, dtype=np.uint32).tobytes()
        num_slots = -(-len(sequence) // bs)
        min_blocks = max(min_blocks, num_slots)
        prompt_tokens += len(prompt)
        limit = len(prompt) - 1  # the last prompt token is always computed
        # Block ids along the path, reusing those of the earlier sequence with the longest common prefix.
        key = np.asarray(sequence, dtype=">u4").tobytes()
        ids: list[int] = []
        at = ordered.bisect_left((key, -1))
        for neighbour in (at - 1, at):
            if 0 <= neighbour < len(ordered):
                other, which = ordered[neighbour]
                shared = common_prefix_tokens(key, other) // bs
                if shared > len(ids):
                    ids = paths[which][:shared]
        parent = ids[-1] if ids else -1
        j = len(ids)
        while j < num_slots:
            block = find(parent, data[j * step : (j + 1) * step])
            if block is None:
                break
            ids.append(block)
            parent = block
            j += 1
        if j < num_slots:
            parent = block_of(parent, data[j * step : (j + 1) * step])
            ids.append(parent)
            # Below a new block everything is new: one chain, no siblings to look up.
            chunks = [data[k * step : (k + 1) * step] for k in range(j + 1, num_slots)]
            fresh = range(len(content), len(content) + len(chunks))
            parents = [parent, *fresh[:-1]] if chunks else []
            content.extend(chunks)
            first_kid.update(zip(parents, fresh, strict=True))
            ids.extend(fresh)
        path = np.asarray(ids, dtype=np.int64)
        # Distances, before this request touches anything.
        hittable = limit // bs  # whole blocks inside the first `limit` tokens
        stamps = stamp[path[:hittable]]
        gaps = np.flatnonzero(stamps < 0)
        live = int(gaps[0]) if len(gaps) else hittable
        # Partial-block hits: at capacities where the first `m` blocks hit and block m does not, the longest common
        # prefix with a cached block at position m.  Only below a parent with two children can a block other than
        # the prompt's own be cached there, and at m == live.
        branching = np.flatnonzero(branch[np.concatenate(([-1], path[: live - 1]))]) if live else np.zeros(0, int)
        slots = [*branching.tolist(), live] if not len(branching) or branching[-1] != live else branching.tolist()
        queries: list[int] = []
        spans: list[tuple[int, int, list[int]]] = []
        for m in slots:
            if m > hittable:
                continue
            want = data[m * step : min((m + 1) * bs, limit) * 4]
            if not want:
                continue
            parent = ids[m - 1] if m else -1
            by_first = kids.get(parent)
            if by_first is None:
                only = first_kid.get(parent)
                siblings = [] if only is None else [only]
            else:
                siblings = by_first.get(want[:4], ())
            own = ids[m] if m < live else -2
            gains = []
            for c in siblings:
                if c != own and stamp[c] >= 0:
                    n = _lcp_tokens(content[c], want)
                    if n:
                        gains.append(n)
                        queries.append(int(stamp[c]))
            if gains:
                spans.append((m, len(queries) - len(gains), gains))
        need = np.concatenate((stamps[:live], np.asarray(queries, dtype=np.int64)))
        dist = fenwick.at_or_above(need) if len(need) else need
        if live:
            full_events.append(dist[:live])
        for m, first, gains in spans:
            lo = int(dist[m - 1]) if m else 1
            hi = int(dist[m]) if m < live else None
            cdist = dist[live + first : live + first + len(gains)]
            best = 0
            for i in np.argsort(cdist, kind="stable").tolist():
                gain = gains[i]
                if gain <= best:
                    continue
                at = max(lo, int(cdist[i]))
                if hi is not None and at >= hi:
                    break
                step_at.append(at)
                step_by.append(gain - best)
                best = gain
            if best and hi is not None:
                step_at.append(hi)
                step_by.append(-best)
        # Touch the path: the shallowest block gets the newest stamp.
        if len(sequence) % bs:
            holder = _holder(ids[-1], ids[-2] if len(ids) > 1 else -1, content, stamp, kids)
            if holder != ids[-1]:
                path = path.copy()
                path[-1] = holder
        old = stamp[path]
        old = old[old >= 0]
        if len(old):
            fenwick.add(old, -1)
        n = len(path)
        stamp[path] = np.arange(clock + n - 1, clock - 1, -1, dtype=np.int64)
        fenwick.add(np.arange(clock, clock + n, dtype=np.int64), 1)
        clock += n
        on_branch = np.flatnonzero(branch[np.concatenate(([-1], path[:-1]))])
        if len(on_branch):
            _absorb(path, on_branch, content, stamp, kids, fenwick)
        max_live = max(max_live, fenwick.live)
        ordered.add((key, index))
        paths.append(ids)
    size = max_live + 1
    hits = np.zeros(size + 1, dtype=np.int64)
    if full_events:
        every = np.minimum(np.concatenate(full_events), size)
        hits += np.bincount(every, minlength=size + 1)[: size + 1] * bs
    whole = np.cumsum(hits)
    whole[0] = 0
    if step_at:
        at = np.minimum(np.asarray(step_at, dtype=np.int64), size)
        weights = np.asarray(step_by, dtype=np.float64)
        hits += np.rint(np.bincount(at, weights=weights, minlength=size + 1)[: size + 1]).astype(np.int64)
    hits = np.cumsum(hits)
    hits[0] = 0
    return SweepResult(bs, len(pairs), prompt_tokens, min_blocks, hits[:size], whole[:size])


def _holder(block: int, parent: int, content: list[bytes], stamp: np.ndarray, kids: dict) -> int:
    """The block that holds a sequence's partial last block: the most recent cached block at the same position that
    extends it (the tree stores those tokens once), else the block itself."""
    by_first = kids.get(parent)
    data = content[block]
    if by_first is None:
        return block
    siblings = by_first.get(data[:4], ())
    best, best_stamp = block, -1
    for other in siblings:
        if other != block and stamp[other] > best_stamp and len(content[other]) > len(data):
            if content[other].startswith(data):
                best, best_stamp = other, int(stamp[other])
    return best


def _absorb(
    path: np.ndarray,
    on_branch: np.ndarray,
    content: list[bytes],
    stamp: np.ndarray,
    kids: dict,
    fenwick: _Fenwick,
) -> None:
    """Drop from the stack the partial blocks that a touched block at the same position extends: once the seam
    heals they share its pool block, and it serves their tokens.  ``on_branch``: the positions along ``path`` whose
    parent has two children or more."""
    gone: list[int] = []
    for m in on_branch.tolist():
        block = int(path[m])
        data = content[block]
        for other in kids[int(path[m - 1]) if m else -1].get(data[:4], ()):
            if other != block and stamp[other] >= 0 and len(content[other]) < len(data):
                if data.startswith(content[other]):
                    gone.append(int(stamp[other]))
                    stamp[other] = -1
    if gone:
        fenwick.add(np.asarray(gone, dtype=np.int64), -1)
