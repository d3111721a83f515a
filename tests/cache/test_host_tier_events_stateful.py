"""KV events of a cache with a host tier, under any mix of operations: a strict BlockIndex fed every event mirrors the
device tree's full blocks and the announced host blocks after every step.

Requests are admitted and left open, so that locks and running leases shape what eviction and promotion may take;
each is later committed (with tokens generated after its prompt) or released.  Eviction, promotion of host runs
(a prompt that matches them), a late subscriber and a save and restore of the whole cache are mixed in.  The host tier
is small enough to drop runs, or large enough never to.
"""

from __future__ import annotations

import tempfile

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_host_tier_events import Mirror

from prefixcache import KVBlockPool, OutOfBlocksError, RadixCache
from prefixcache.cache.host import make_host_pool

VOCAB = 3
DEVICE_BLOCKS = 8
tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=14)


class HostEventsMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), host_blocks=st.sampled_from([3, 64]))
    def make(self, block_size: int, host_blocks: int) -> None:
        pool = KVBlockPool(DEVICE_BLOCKS, block_size, device="cpu", num_layers=0)
        self.mirror = Mirror()
        self.cache = RadixCache(pool, host_pool=make_host_pool(pool, host_blocks), event_listener=self.mirror)
        self.leases: list = []

    @rule(tokens=tokens_st, extra=st.integers(0, 3))
    def start(self, tokens: list[int], extra: int) -> None:
        if len(self.leases) >= 2:
            return
        try:
            lease = self.cache.acquire(tokens, num_tokens=len(tokens) + extra)
        except OutOfBlocksError:
            return
        self.leases.append((lease, tokens + [0] * extra))

    @precondition(lambda self: getattr(self, "leases", None))
    @rule(which=st.integers(0, 1), commit=st.booleans(), keep=st.integers(0, 3))
    def finish(self, which: int, commit: bool, keep: int) -> None:
        lease, full = self.leases.pop(which % len(self.leases))
        if commit:
            self.cache.commit(lease, full[: max(lease.num_cached_tokens, 1, len(full) - keep)])
        else:
            self.cache.release(lease)

    @rule(tokens=tokens_st)
    def request(self, tokens: list[int]) -> None:
        try:
            lease = self.cache.acquire(tokens, num_tokens=len(tokens) + 1)
        except OutOfBlocksError:
            return
        self.cache.commit(lease, tokens + [VOCAB])

    @rule(num_blocks=st.integers(1, DEVICE_BLOCKS))
    def evict(self, num_blocks: int) -> None:
        self.cache.evict(num_blocks)

    @rule()
    def resubscribe(self) -> None:
        self.cache.unsubscribe(self.mirror)
        self.mirror = Mirror()
        self.cache.subscribe(self.mirror)

    @precondition(lambda self: not getattr(self, "leases", True))
    @rule()
    def save_and_restore(self) -> None:
        pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")
        with tempfile.TemporaryDirectory() as folder:
            self.cache.save(folder)
            self.cache.restore(folder, replace=True)

    @invariant()
    def mirrored(self) -> None:
        if hasattr(self, "cache"):
            self.mirror.check(self.cache)


TestHostEventsMachine = HostEventsMachine.TestCase
TestHostEventsMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
