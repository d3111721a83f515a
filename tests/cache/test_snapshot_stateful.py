"""The radix cache's stateful test (tests/cache/test_radix_stateful.py) with save and load in its operation mix.

``save`` writes a snapshot at any point (leases and locks open) and must change nothing; ``load`` finishes the
running requests on the old cache and continues on a new cache loaded from the latest snapshot, into a pool of the
starting size (then it holds exactly what was committed at the save) or half that (then a prefix-closed part of it).
Every K/V row of every cached sequence is checked against the prefix id the machine wrote there, and
``check_invariants()`` runs after every step.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_radix_stateful import NAMESPACES, RadixCacheMachine, maximal

from prefixcache import KVBlockPool, RadixCache

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")


class SnapshotMachine(RadixCacheMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="prefixcache-snapshot-test-"))
        self.saved: dict[str, set] | None = None
        self.full_blocks = 0  # the pool size the machine started with: loads use it or half of it

    @rule()
    def save(self) -> None:
        before = self.cache.stats()
        order = [node.node_id for node in self.cache._tree.evictor.members()]

        self.full_blocks = self.full_blocks or self.cache.pool.num_blocks
        summary = self.cache.save(self.folder)

        assert self.cache.stats() == before
        assert [node.node_id for node in self.cache._tree.evictor.members()] == order
        assert summary.num_tokens == before.cached_tokens
        self.saved = {ns: set(self.ref[ns]) for ns in NAMESPACES}

    @precondition(lambda self: self.saved is not None)
    @rule(smaller=st.booleans())
    def load(self, smaller: bool) -> None:
        for _, lease, _ in self.leases:
            self.cache.release(lease)
        for _, _, handle in self.locks:
            self.cache.unlock(handle)
        self.leases, self.locks, self.released_handles = [], [], []
        # Every snapshot comes from a pool of at most full_blocks: a pool that size holds all of it.
        num_blocks = self.full_blocks // 2 if smaller else self.full_blocks
        pool = KVBlockPool(num_blocks, self.block_size, num_layers=1, num_kv_heads=1, head_dim=1, device="cpu")

        self.cache = RadixCache.load(self.folder, pool, policy=self.cache.policy.name)

        for ns in NAMESPACES:
            now = {tuple(s) for s in self.cache.cached_sequences(ns)}
            if smaller:
                for seq in now:
                    assert any(saved[: len(seq)] == seq for saved in self.saved[ns]), f"{seq} was never saved"
            else:
                assert sorted(now) == maximal(self.saved[ns])
            self.ref[ns] = now
            for seq in now:
                match = self.cache.match(seq, ns)
                assert match.num_tokens == len(seq)
                self.assert_kv(match.block_table, seq, len(seq))

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


SNAPSHOT_SETTINGS = settings(max_examples=40, stateful_step_count=40, deadline=None)


class SnapshotBlockSize1(SnapshotMachine):
    block_size = 1


class SnapshotBlockSize4(SnapshotMachine):
    block_size = 4


TestSnapshotBlockSize1 = SnapshotBlockSize1.TestCase
TestSnapshotBlockSize1.settings = SNAPSHOT_SETTINGS
TestSnapshotBlockSize4 = SnapshotBlockSize4.TestCase
TestSnapshotBlockSize4.settings = SNAPSHOT_SETTINGS
