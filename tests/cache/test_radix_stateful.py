"""The radix cache against a naive model: a set of cached token sequences per namespace plus the locked prefixes.

Hypothesis drives random interleavings of insert, match, lock/unlock, acquire/reserve/commit/release and evict
over a tiny vocabulary (so prefixes collide) and a small pool (so allocation evicts), in two namespaces whose
sequences come from one shared history (so a namespace that saw the other's tokens would match too much).  The
pool holds a real KV tensor in which every written row carries an id of the exact prefix it belongs to, so every
block table the cache hands out is checked row by row: a wrong block, a missed copy-on-write or a block reused
while still cached shows up as a wrong row.
"""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache import InsertResult, KVBlockPool, RadixCache
from prefixcache.errors import LockError, OutOfBlocksError

VOCAB = 4
MAX_LEN = 20
NAMESPACES = ("a", "b")
MAX_LOCKS = 3
MAX_LEASES = 3

STEPS_RUN: Counter[int] = Counter()
"""Checked states per block size (after initialization and after every step), for reporting how much ran."""

Seq = tuple[int, ...]

namespaces = st.sampled_from(NAMESPACES)
tails = st.lists(st.integers(0, VOCAB - 1), max_size=8)
# A sequence is a cut of an earlier sequence (any namespace) plus a random tail, so deep shared prefixes occur.
sequence_specs = st.tuples(st.integers(0, 1000), st.integers(0, MAX_LEN), tails)
picks = st.integers(0, 1000)


def common_prefix_length(a: Seq, b: Seq) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def maximal(sequences: set[Seq]) -> list[Seq]:
    """The sequences that are not a proper prefix of another one, sorted: what the tree's leaves spell."""
    ordered = sorted(sequences)
    return [s for i, s in enumerate(ordered) if i + 1 == len(ordered) or ordered[i + 1][: len(s)] != s]


def distinct_prefixes(sequences: set[Seq]) -> set[Seq]:
    return {s[:i] for s in sequences for i in range(1, len(s) + 1)}


class RadixCacheMachine(RuleBasedStateMachine):
    block_size = 4

    def __init__(self) -> None:
        super().__init__()
        self.ref: dict[str, set[Seq]] = {ns: set() for ns in NAMESPACES}
        self.known: list[Seq] = []
        self.locks: list[tuple[str, Seq, object]] = []
        self.released_handles: list[object] = []
        self.leases: list[tuple[str, object, Seq]] = []
        self.prefix_ids: dict[Seq, int] = {}

    @initialize(policy=st.sampled_from(["lru", "lfu"]))
    def make_cache(self, policy: str) -> None:
        bs = self.block_size
        num_blocks = 2 * -(-MAX_LEN // bs) + 2
        pool = KVBlockPool(num_blocks, bs, num_layers=1, num_kv_heads=1, head_dim=1, device="cpu")
        self.cache = RadixCache(pool, policy=policy)

    def compose(self, spec: tuple[int, int, list[int]]) -> Seq:
        base, cut, tail = spec
        head = self.known[base % len(self.known)][:cut] if self.known else ()
        return (head + tuple(tail))[:MAX_LEN] or (0,)

    def remember(self, seq: Seq) -> None:
        self.known.append(seq)
        del self.known[:-30]

    def lcp(self, namespace: str, seq: Seq) -> int:
        return max((common_prefix_length(seq, s) for s in self.ref[namespace]), default=0)

    def locked_prefixes(self) -> list[tuple[str, Seq]]:
        held = [(ns, prefix) for ns, prefix, _ in self.locks]
        # A lease locks the whole blocks of its match; the rows of a partial block were copied at admission.
        return held + [
            (ns, tuple(lease.token_ids[: lease.first_owned_block * self.block_size])) for ns, lease, _ in self.leases
        ]

    def evictions(self) -> int:
        return self.cache.stats().evictions

    def sync_after_eviction(self, evictions_before: int) -> None:
        """If anything was evicted, the tree is the new reference; check it only lost unlocked material."""
        if self.evictions() == evictions_before:
            return
        for ns in NAMESPACES:
            now = {tuple(s) for s in self.cache.cached_sequences(ns)}
            for seq in now:
                assert any(old[: len(seq)] == seq for old in self.ref[ns]), f"{seq} appeared by evicting"
            self.ref[ns] = now
        for ns, prefix in self.locked_prefixes():
            assert self.lcp(ns, prefix) == len(prefix), f"locked {prefix} in {ns!r} was evicted"

    def extended(self, lease) -> bool:
        """Whether ``lease`` writes a cached block in place (its first owned block is also its node's)."""
        first = lease.first_owned_block
        return first < len(lease.block_table) and bool(self.cache._blocks.extending[lease.block_table[first]])

    def prefix_id(self, prefix: Seq) -> int:
        return self.prefix_ids.setdefault(prefix, len(self.prefix_ids) + 1)

    def rows(self, table, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.block_size
        positions = torch.arange(start, end)
        blocks = torch.as_tensor(table, dtype=torch.int64)[positions // bs]
        return blocks, positions % bs

    def write_kv(self, table, seq: Seq, start: int) -> None:
        blocks, rows = self.rows(table, start, len(seq))
        ids = torch.tensor([self.prefix_id(seq[: p + 1]) for p in range(start, len(seq))], dtype=torch.float32)
        kv = self.cache.pool.kv
        kv[0, 0, blocks, rows, 0, 0] = ids
        kv[0, 1, blocks, rows, 0, 0] = -ids

    def assert_kv(self, table, seq: Seq, num_tokens: int) -> None:
        assert len(table) == -(-num_tokens // self.block_size)
        blocks, rows = self.rows(table, 0, num_tokens)
        expected = [float(self.prefix_id(seq[: p + 1])) for p in range(num_tokens)]
        kv = self.cache.pool.kv
        assert kv[0, 0, blocks, rows, 0, 0].tolist() == expected
        assert kv[0, 1, blocks, rows, 0, 0].tolist() == [-x for x in expected]

    @rule(ns=namespaces, spec=sequence_specs)
    def insert(self, ns: str, spec) -> None:
        seq = self.compose(spec)
        bs = self.block_size
        need = -(-len(seq) // bs)
        before = self.evictions()
        try:
            blocks = self.cache.allocate(need)
        except OutOfBlocksError:
            assert self.evictions() == before, "an allocation that cannot be met evicts nothing"
            stats = self.cache.stats()
            assert stats.free_blocks + stats.evictable_blocks < need
            return
        self.sync_after_eviction(before)
        self.write_kv(blocks, seq, 0)
        cached = self.lcp(ns, seq)

        result = self.cache.insert(seq, blocks, ns)

        released = need if cached == len(seq) else cached // bs
        assert result == InsertResult(len(seq) - cached, cached, released)
        self.ref[ns].add(seq)
        self.remember(seq)

    @rule(ns=namespaces, spec=sequence_specs)
    def insert_borrowing_a_locked_prefix(self, ns: str, spec) -> None:
        """Low-level insert whose block table starts with the tree's own blocks of a locked match."""
        seq = self.compose(spec)
        bs = self.block_size
        match = self.cache.match(seq, ns)
        assert match.num_tokens == self.lcp(ns, seq)
        handle = self.cache.lock(match)
        # Only whole blocks are borrowed: the rows after a partial match in a shared block are another sequence's.
        borrowed = match.num_tokens // bs
        before = self.evictions()
        try:
            own = self.cache.allocate(-(-len(seq) // bs) - borrowed)
        except OutOfBlocksError:
            self.sync_after_eviction(before)
            self.cache.unlock(handle)
            return
        self.sync_after_eviction(before)
        assert self.lcp(ns, seq) >= match.num_tokens, "a locked match was evicted"
        table = np.concatenate((match.block_table[:borrowed], own))
        self.write_kv(table, seq, borrowed * bs)
        cached = self.lcp(ns, seq)

        result = self.cache.insert(seq, table, ns)
        self.cache.unlock(handle)

        released = len(own) if cached == len(seq) else cached // bs - borrowed
        assert result == InsertResult(len(seq) - cached, cached, released)
        self.ref[ns].add(seq)
        self.remember(seq)

    @rule(ns=namespaces, spec=sequence_specs, for_prefill=st.booleans())
    def match(self, ns: str, spec, for_prefill: bool) -> None:
        seq = self.compose(spec)
        limit = len(seq) - 1 if for_prefill else len(seq)

        result = self.cache.match(seq, ns, for_prefill=for_prefill)

        assert result.num_tokens == min(self.lcp(ns, seq), limit)
        self.assert_kv(result.block_table, seq, result.num_tokens)

    @precondition(lambda self: len(self.locks) < MAX_LOCKS)
    @rule(ns=namespaces, spec=sequence_specs)
    def lock(self, ns: str, spec) -> None:
        seq = self.compose(spec)
        result = self.cache.match(seq, ns)
        assert result.num_tokens == self.lcp(ns, seq)

        handle = self.cache.lock(result)

        self.locks.append((ns, seq[: result.num_tokens], handle))

    @precondition(lambda self: self.locks)
    @rule(pick=picks)
    def unlock(self, pick: int) -> None:
        _, _, handle = self.locks.pop(pick % len(self.locks))

        self.cache.unlock(handle)

        self.released_handles = [*self.released_handles[-4:], handle]

    @precondition(lambda self: self.released_handles)
    @rule(pick=picks)
    def unlock_twice_is_refused(self, pick: int) -> None:
        before = self.cache.stats()
        try:
            self.cache.unlock(self.released_handles[pick % len(self.released_handles)])
        except LockError:
            pass
        else:
            raise AssertionError("a released lock handle was accepted again")
        assert self.cache.stats() == before

    @rule(ns=namespaces, spec=sequence_specs, num_blocks=st.integers(1, 6))
    def stale_match_cannot_be_locked(self, ns: str, spec, num_blocks: int) -> None:
        seq = self.compose(spec)
        result = self.cache.match(seq, ns)
        before = self.evictions()
        self.cache.evict(num_blocks)
        self.sync_after_eviction(before)
        # Leaves go first, so the match's node was evicted exactly when its last matched token is gone.
        survived = self.lcp(ns, seq[: result.num_tokens]) == result.num_tokens

        if result.num_tokens == 0 or survived:
            self.cache.unlock(self.cache.lock(result))
        else:
            try:
                self.cache.lock(result)
            except LockError:
                pass
            else:
                raise AssertionError("a match whose node was evicted was locked")

    @precondition(lambda self: len(self.leases) < MAX_LEASES)
    @rule(ns=namespaces, spec=sequence_specs, generated=tails)
    def acquire(self, ns: str, spec, generated: list[int]) -> None:
        bs = self.block_size
        prompt = self.compose(spec)
        full = (prompt + tuple(generated))[:MAX_LEN]
        cached = min(self.lcp(ns, prompt), len(prompt) - 1)
        before = self.evictions()
        lease = self.cache.acquire(prompt, ns)  # never short: with no block for the copy, the rows are recomputed
        self.sync_after_eviction(before)

        if cached % bs and lease.num_cached_tokens == cached and not lease.num_copied_tokens:
            # The match took all of a node ending inside its last block: the lease writes that block in place.
            assert self.extended(lease)
        elif lease.num_copied_tokens or not cached % bs:
            assert (lease.num_cached_tokens, lease.num_copied_tokens) == (cached, cached % bs)
        else:
            assert lease.num_cached_tokens == cached - cached % bs, "a dry pool falls back to the block boundary"
            assert self.cache.stats().free_blocks == 0
        cached = lease.num_cached_tokens
        assert lease.first_owned_block == cached // bs
        self.assert_kv(lease.block_table, prompt, cached)

        before = self.evictions()
        try:
            self.cache.reserve(lease, len(full))
        except OutOfBlocksError:
            self.sync_after_eviction(before)
            self.cache.release(lease)
            return
        self.sync_after_eviction(before)
        assert len(lease.block_table) == -(-len(full) // bs)
        self.write_kv(lease.block_table, full, cached)
        self.leases.append((ns, lease, full))

    @precondition(lambda self: self.leases)
    @rule(pick=picks)
    def commit(self, pick: int) -> None:
        ns, lease, full = self.leases.pop(pick % len(self.leases))
        bs, first = self.block_size, lease.first_owned_block
        cached = self.lcp(ns, full)
        assert cached >= first * bs, "the locked blocks of the match stay cached"
        owned = len(lease.block_table) - first
        released = owned if cached == len(full) else cached // bs - first
        extended = self.extended(lease)
        # Another lease's branch runs past the extended node's end inside that block: the new leaf gets a copy of it.
        needs_copy = extended and lease.num_cached_tokens < cached < len(full) and cached // bs == first
        before = self.evictions()

        result = self.cache.commit(lease, full)

        self.remember(full)
        if needs_copy:
            # The copy may evict (the tree is the reference then); with no block for it nothing new goes in.
            for other in NAMESPACES:
                self.ref[other] = {tuple(seq) for seq in self.cache.cached_sequences(other)}
            inserted = result.num_cached_tokens + result.num_new_tokens
            if self.lcp(ns, full) == len(full):
                assert inserted == len(full)
            else:
                assert (result.num_new_tokens, inserted) == (0, self.lcp(ns, full))
            return
        assert self.evictions() == before
        # The extended block goes back to its node, not to the pool, when the tree holds its tokens already.
        released -= extended and released > 0
        assert result == InsertResult(len(full) - cached, cached, released)
        self.ref[ns].add(full)

    @precondition(lambda self: self.leases)
    @rule(pick=picks)
    def release(self, pick: int) -> None:
        _, lease, _ = self.leases.pop(pick % len(self.leases))
        before = self.cache.stats()
        extended = self.extended(lease)
        seams, node = 0, lease.lock.node
        while node.parent is not None:
            seams += node.start % self.block_size != 0
            node = node.parent

        self.cache.release(lease)

        # Unlocking may also heal seams on the path (the parent adopts the child's copy of a shared block), which
        # frees one duplicate block per seam and leaves what is cached unchanged.
        owned = len(lease.block_table) - lease.first_owned_block - extended  # an extended block stays its node's
        after = self.cache.stats()
        assert 0 <= after.free_blocks - before.free_blocks - owned <= seams
        assert after.cached_tokens == before.cached_tokens

    @rule(num_blocks=st.one_of(st.integers(0, 4), st.none()))
    def evict(self, num_blocks: int | None) -> None:
        """Evict ``num_blocks`` blocks, or everything unlocked (``evict_all``) for None."""
        prefixes_before = sum(len(distinct_prefixes(self.ref[ns])) for ns in NAMESPACES)
        before = self.evictions()
        evictable_before = self.cache.stats().evictable_blocks

        result = self.cache.evict_all() if num_blocks is None else self.cache.evict(num_blocks)

        stats = self.cache.stats()
        if num_blocks is None:
            assert stats.evictable_tokens == 0 and stats.cached_tokens == stats.locked_tokens
            assert result.num_blocks == evictable_before
        else:
            # Block granularity frees exactly what is asked, as far as unlocked blocks go.
            assert result.num_blocks == min(num_blocks, evictable_before)
        self.sync_after_eviction(before)
        prefixes_after = sum(len(distinct_prefixes(self.ref[ns])) for ns in NAMESPACES)
        assert result.num_tokens == prefixes_before - prefixes_after

    @invariant()
    def tree_matches_the_model(self) -> None:
        STEPS_RUN[self.block_size] += 1
        self.cache.check_invariants()
        stats = self.cache.stats()
        for ns in NAMESPACES:
            assert sorted(tuple(s) for s in self.cache.cached_sequences(ns)) == maximal(self.ref[ns])
        assert stats.cached_tokens == sum(len(distinct_prefixes(self.ref[ns])) for ns in NAMESPACES)
        locked = {(ns, p) for ns, prefix in self.locked_prefixes() for p in distinct_prefixes({prefix})}
        assert stats.locked_tokens >= len(locked)
        if not self.locks and not self.leases:
            assert stats.locked_tokens == 0

    def teardown(self) -> None:
        if not hasattr(self, "cache") or sys.exc_info()[0] is not None:
            return  # no cache yet, or a failing step is being reported already
        for _, lease, _ in self.leases:
            self.cache.release(lease)
        for _, _, handle in self.locks:
            self.cache.unlock(handle)
        self.cache.evict_all()
        stats = self.cache.stats()
        assert stats.free_blocks == stats.num_blocks
        assert (stats.cached_tokens, stats.num_nodes) == (0, 0)
        assert all(self.cache.cached_sequences(ns) == [] for ns in NAMESPACES)
        self.cache.check_invariants()


STATEFUL_SETTINGS = settings(max_examples=60, stateful_step_count=50, deadline=None)


class BlockSize1(RadixCacheMachine):
    block_size = 1


class BlockSize4(RadixCacheMachine):
    block_size = 4


class BlockSize16(RadixCacheMachine):
    block_size = 16


TestRadixCacheBlockSize1 = BlockSize1.TestCase
TestRadixCacheBlockSize1.settings = STATEFUL_SETTINGS
TestRadixCacheBlockSize4 = BlockSize4.TestCase
TestRadixCacheBlockSize4.settings = STATEFUL_SETTINGS
TestRadixCacheBlockSize16 = BlockSize16.TestCase
TestRadixCacheBlockSize16.settings = STATEFUL_SETTINGS
