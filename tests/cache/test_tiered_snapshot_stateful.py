"""The host-tier machine (tests/cache/test_host_tier_stateful.py) with save and load in its operation mix.

Demotion (requests and ``evict`` under pressure on an 8-block device pool), promotion (requests matching demoted
runs), ``save`` and ``load`` run in one mix.  The reference is the list of committed sequences: nothing found may go
beyond it, and while the host tier never drops a block every shared full block must be found.  ``save`` records what
the cache holds (device sequences, host runs in LRU order with their K/V); ``load`` continues on a fresh cache with a
host pool, of the same sizes (then it holds exactly what was saved) or smaller (the most recently used part that fits:
whole device prefixes, the newest host runs, the oldest one cut).  Every cached K/V row is checked against the
function of token and position the machine wrote, after promotion and after load; ``check_invariants()`` runs after
every step, and the cache is quiescent at teardown.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule
from test_host_tier_stateful import DEVICE_BLOCKS, SHAPE, VOCAB, HostTierMachine, rows

from prefixcache import KVBlockPool, RadixCache
from prefixcache.cache.host import make_host_pool

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")


def host_runs(cache: RadixCache) -> list[tuple[int, str | None, int, list[int], torch.Tensor]]:
    """The host tier's runs, least recently used first: key, namespace, first block, tokens and K/V."""
    host = cache._host
    return [
        (run.key, run.namespace, run.first, run.tokens.tolist(), host.pool.kv[:, :, torch.from_numpy(run.block_ids)])
        for run in host.runs.values()
    ]


class TieredSnapshotMachine(HostTierMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), host_blocks=st.sampled_from([3, 512]))
    def make(self, block_size: int, host_blocks: int) -> None:
        super().make(block_size, host_blocks)
        self.host_blocks = host_blocks
        self.folder = Path(tempfile.mkdtemp(prefix="prefixcache-tiered-snapshot-test-"))
        self.saved: dict | None = None
        self.loads = 0

    @precondition(lambda self: self.committed)
    @rule(pick=st.integers(0, 1 << 16), keep=st.integers(1, 16), tail=st.lists(st.integers(0, VOCAB - 1), max_size=3))
    def revisit(self, pick: int, keep: int, tail: list[int]) -> None:
        """A request for (a prefix of) a committed sequence, then new tokens: what promotes demoted runs."""
        before = self.cache.stats().promoted_blocks
        keep = min(keep, self.cache.pool.num_blocks * self.bs - 2 - len(tail))  # admitted with its copy-on-write block
        self.request(self.committed[pick % len(self.committed)][:keep] + tail, 0)
        if self.cache.stats().promoted_blocks > before:
            event("promotion" + (" after a load" if self.loads else ""))

    @rule()
    def demote_all(self) -> None:
        """Eviction pressure: every unlocked device block goes to host (or is dropped when the host is full)."""
        before = self.cache.stats()
        self.cache.evict_all()
        after = self.cache.stats()
        assert after.cached_tokens == 0 and after.free_blocks == self.cache.pool.num_blocks
        assert after.demoted_blocks >= before.demoted_blocks

    @rule()
    def save(self) -> None:
        cache = self.cache
        before = cache.stats()
        device = sorted(cache.cached_sequences())
        runs = host_runs(cache)

        summary = cache.save(self.folder)
        event(f"save with host runs: {bool(runs)}")

        assert cache.stats() == before, "saving changed the cache"
        after = host_runs(cache)
        assert [run[:4] for run in after] == [run[:4] for run in runs], "saving moved host runs"
        assert (summary.num_tokens, summary.host_runs) == (before.cached_tokens, len(runs))
        assert summary.host_tokens == sum(len(run[3]) for run in runs) == before.host_used_blocks * self.bs
        self.saved = {"device": device, "host": runs, "committed": list(self.committed), "lossless": self.lossless}

    @precondition(lambda self: self.saved is not None)
    @rule(smaller=st.booleans())
    def load(self, smaller: bool) -> None:
        saved, bs = self.saved, self.bs
        device_blocks = DEVICE_BLOCKS // 2 if smaller else DEVICE_BLOCKS
        host_blocks = max(1, self.host_blocks // 2) if smaller else self.host_blocks
        pool = KVBlockPool(device_blocks, bs, device="cpu", **SHAPE)

        self.cache = cache = RadixCache.load(self.folder, pool, host_pool=make_host_pool(pool, host_blocks))

        device = sorted(cache.cached_sequences())
        if smaller:
            for seq in device:
                assert any(s[: len(seq)] == seq for s in saved["device"]), f"{seq} was never saved"
        else:
            assert device == saved["device"]
        # The host tier: the newest saved runs that fit, the oldest of them cut to what is left.
        expected, budget = [], host_blocks
        for key, namespace, first, tokens, kv in reversed(saved["host"]):
            take = min(len(tokens) // bs, budget)
            if take:
                expected.append((key, namespace, first, tokens[: take * bs], kv[:, :, :take]))
            budget -= take
        expected.reverse()
        now = host_runs(cache)
        assert [run[:4] for run in now] == [run[:4] for run in expected]
        for (_, _, first, tokens, kv), (*_, saved_kv) in zip(now, expected, strict=True):
            assert torch.equal(kv, saved_kv), "a restored host run has other K/V than was saved"
            written = rows([0] * (first * bs) + tokens)[:, :, first * bs :]
            assert torch.equal(kv.flatten(2, 3), written), "a restored host run has K/V the machine never wrote"
        for seq in device:
            match = cache.match(seq)
            assert match.num_tokens == len(seq)
            expect = rows(seq)
            for p in range(len(seq)):
                row = cache.pool.kv[:, :, int(match.block_table[p // bs]), p % bs]
                assert torch.equal(row, expect[:, :, p]), f"restored row {p} of {seq} has the wrong K/V"
        self.committed = list(saved["committed"])
        self.loads += 1
        event(f"load (smaller: {smaller}) with host runs: {bool(now)}")
        self.lossless = saved["lossless"] and not smaller

    @rule(smaller=st.booleans())
    def restart(self, smaller: bool) -> None:
        """Save and load at once, so that what is on host at the save is what the load must bring back."""
        self.save()
        self.load(smaller)

    def teardown(self) -> None:
        try:
            if hasattr(self, "cache"):
                cache = self.cache
                assert cache.stats().locked_tokens == 0, "a lock outlived its request"
                assert cache._blocks.num_owned == 0, "a block is still owned by a request"
                assert not cache._host.pinned, "a promotion left host runs pinned"
                cache.check_invariants()
        finally:
            if hasattr(self, "folder"):
                shutil.rmtree(self.folder, ignore_errors=True)


TestTieredSnapshotMachine = TieredSnapshotMachine.TestCase
TestTieredSnapshotMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
