"""Block-granular eviction, retention priorities and expiry against a naive block-level reference.

The reference keeps the set of cached token prefixes, each retained prefix's priority and deadline, and a clock.  From
it follow the pool's fewest physical blocks (per block index, one block per maximal extension of the cached sequences
within that block: a chain through a block can share one copy, a branch inside a block needs its own), what eviction
may take
(exactly the blocks asked for, as far as unlocked blocks go; never a retained prefix while one of lower priority is a
candidate), and the retained tokens.  ``check_invariants()`` runs after every step.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from prefixcache import KVBlockPool, OutOfBlocksError, RadixCache

Seq = tuple[int, ...]
VOCAB = 3
NUM_BLOCKS = 12


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prefixes(seqs) -> set[Seq]:
    return {s[:i] for s in seqs for i in range(1, len(s) + 1)}


def maximal(items: set[Seq]) -> set[Seq]:
    ordered = sorted(items)
    return {s for i, s in enumerate(ordered) if i + 1 == len(ordered) or ordered[i + 1][: len(s)] != s}


class EvictionMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["lru", "lfu"]))
    def make(self, block_size: int, policy: str) -> None:
        self.bs = block_size
        self.clock = Clock()
        self.cache = RadixCache(
            KVBlockPool(NUM_BLOCKS, block_size), policy, max_retained_fraction=1.0, clock=self.clock
        )
        self.cached: set[Seq] = set()
        self.retained: dict[Seq, tuple[int, float | None]] = {}

    def priority(self, prefix: Seq) -> int:
        entry = self.retained.get(prefix)
        if entry is None or (entry[1] is not None and entry[1] <= self.clock.now):
            return 0
        return entry[0]

    def physical_blocks(self) -> int:
        leaves = maximal(self.cached)
        total = 0
        for j in range(max((len(s) for s in leaves), default=0) // self.bs + 1):
            within = {s[: (j + 1) * self.bs] for s in leaves if len(s) > j * self.bs}
            total += len(maximal(within))
        return total

    def sync(self, before: set[Seq], locked: Seq = ()) -> None:
        """Take the tree's content as the reference after an eviction, checking what it was allowed to take
        (``locked``: the sequence whose path a request held locked meanwhile)."""
        after = prefixes(tuple(s) for s in self.cache.cached_sequences())
        assert after <= before | after and not (after - before - self.last_inserted), "eviction added tokens"
        removed = before - after
        if removed:
            leaves = {p for p in maximal(after) if locked[: len(p)] != p}
            worst_removed = max(self.priority(p) for p in removed)
            assert all(self.priority(p) >= worst_removed for p in leaves), "a higher priority went first"
        self.cached = after
        self.retained = {p: v for p, v in self.retained.items() if p in after}

    @rule(head=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20), cut=st.integers(0, 20))
    def request(self, head: list[int], cut: int) -> None:
        known = sorted(maximal(self.cached))
        seq = tuple((known[cut % len(known)][:cut] if known else ()) + tuple(head))[:24]
        before = set(self.cached)
        stats = self.cache.stats()
        self.last_inserted = prefixes([seq])
        try:
            lease = self.cache.acquire(seq, num_tokens=len(seq))
        except OutOfBlocksError:
            assert self.cache.stats().evicted_blocks == stats.evicted_blocks, "a refused request evicted"
            self.last_inserted = set()
            return
        # What admission evicted loses its retention even if the commit caches it again.
        kept = prefixes(tuple(s) for s in self.cache.cached_sequences())
        self.retained = {p: v for p, v in self.retained.items() if p in kept}
        self.cache.commit(lease, seq)
        self.sync(before | prefixes([seq]), locked=seq)
        assert self.cached >= prefixes([seq])

    @rule(num_blocks=st.integers(0, 6))
    def evict(self, num_blocks: int) -> None:
        before = set(self.cached)
        stats = self.cache.stats()
        evictable = stats.evictable_blocks
        assert evictable == stats.used_blocks  # nothing is locked between steps
        self.last_inserted = set()
        result = self.cache.evict(num_blocks)
        assert result.num_blocks == min(num_blocks, evictable)
        self.sync(before)
        assert result.num_tokens == len(before) - len(self.cached)

    @rule(pick=st.integers(0, 100), priority=st.integers(1, 3), retain_s=st.sampled_from([None, 1.0, 5.0]))
    def retain(self, pick: int, priority: int, retain_s: float | None) -> None:
        leaves = sorted(maximal(self.cached))
        if not leaves:
            return
        seq = leaves[pick % len(leaves)]
        seq = seq[: max(1, len(seq) - pick % 3)]
        until = None if retain_s is None else self.clock.now + retain_s
        assert self.cache.retain(seq, priority=priority, retain_s=retain_s) == len(seq)
        for i in range(1, len(seq) + 1):
            prefix = seq[:i]
            old = self.retained.get(prefix)
            if self.priority(prefix) == 0 or old is None:
                self.retained[prefix] = (priority, until)
            else:
                keep = None if old[1] is None or until is None else max(old[1], until)
                self.retained[prefix] = (max(old[0], priority), keep)

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @invariant()
    def matches_the_reference(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        assert {tuple(s) for s in self.cache.cached_sequences()} == maximal(self.cached)
        stats = self.cache.stats()
        # A seam can outlive the sibling that shared its parent's block until a request passes by, so the pool may
        # hold a copy more than the ideal, never fewer.
        assert stats.used_blocks >= self.physical_blocks()
        assert stats.retained_tokens == sum(1 for p in self.cached if self.priority(p))


EvictionMachine.last_inserted = set()
TestEviction = EvictionMachine.TestCase
TestEviction.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
