"""The host-memory tier against a reference model, with demotion and promotion in the operation mix.

The reference keeps every sequence committed so far.  From it follow, for any prompt: an upper bound on what may be
found cached (its longest common prefix with a committed sequence: the tiers never invent tokens), and, while the host
tier is large enough never to drop a block, a lower bound (every full block of every committed sequence is on the
device or on host, so a prompt finds at least the whole blocks it shares with one, when the pool can take them).  The
pools hold real K/V written as a function of token and position, so every cached row a request reads, whether it
stayed on the device or came back from host, is checked.  ``check_invariants()`` (tree, pools and host index) runs
after every step.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from prefixcache import KVBlockPool, OutOfBlocksError, RadixCache
from prefixcache.cache.host import make_host_pool

VOCAB = 3
DEVICE_BLOCKS = 8
SHAPE = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 2}


def rows(tokens: list[int]) -> torch.Tensor:
    """K/V of ``tokens`` as a fake model writes it: ``[1, 2, len(tokens), 1, 2]``."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t * 100 + pos)[None, None, :, None, None]
    return base + torch.tensor([0.0, 0.5])[None, :, None, None, None] + torch.tensor([0.0, 0.25])


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class HostTierMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), host_blocks=st.sampled_from([3, 512]))
    def make(self, block_size: int, host_blocks: int) -> None:
        self.bs = block_size
        pool = KVBlockPool(DEVICE_BLOCKS, block_size, device="cpu", **SHAPE)
        self.cache = RadixCache(pool, host_pool=make_host_pool(pool, host_blocks))
        self.lossless = host_blocks == 512
        self.committed: list[list[int]] = []

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=14), extra=st.integers(0, 3))
    def request(self, tokens: list[int], extra: int) -> None:
        cache, bs = self.cache, self.bs
        total = len(tokens) + extra
        before = cache.stats()
        device = cache.cached_length(tokens)
        try:
            lease = cache.acquire(tokens, num_tokens=total)
        except OutOfBlocksError:
            # Too long, or a seam pins one block more (a sibling shares the parent's copy; not the tier's doing):
            # refused before anything moved between the tiers.
            after = cache.stats()
            assert (after.evicted_blocks, after.demoted_blocks, after.promoted_blocks, after.free_blocks) == (
                before.evicted_blocks,
                before.demoted_blocks,
                before.promoted_blocks,
                before.free_blocks,
            ), "a refused request moved blocks"
            return
        cached = lease.num_cached_tokens
        best = max((lcp(s, tokens) for s in self.committed), default=0)
        assert cached <= min(best, len(tokens) - 1), "found tokens nobody committed"
        # With nothing else running, the request plus a copy-on-write block fits: every shared full block is found,
        # unless the device match ends inside a block: promoted blocks then go in under a seam whose parent copy stays
        # pinned (tree.heal_seam), one block more than the request alone, which a full pool may not have.
        if self.lossless and -(-total // bs) + 1 <= DEVICE_BLOCKS and device % bs == 0:
            assert cached >= min(best // bs * bs, len(tokens) - 1), f"lost blocks: found {cached} of {best}"
        assert cached >= min(device, len(tokens) - 1), "promotion lost device hits"
        assert 0 <= lease.num_host_tokens <= cached
        kv = cache.pool.kv
        full = tokens + [0] * extra
        expect = rows(full)
        for p in range(total):
            block = int(lease.block_table[p // bs])
            if p < cached:
                assert torch.equal(kv[:, :, block, p % bs], expect[:, :, p]), f"row {p} has the wrong K/V"
            else:
                kv[:, :, block, p % bs] = expect[:, :, p]
        cache.commit(lease, full)
        self.committed.append(full)

    @rule(num_blocks=st.integers(1, DEVICE_BLOCKS))
    def evict(self, num_blocks: int) -> None:
        before = self.cache.stats()
        freed = self.cache.evict(num_blocks).num_blocks
        after = self.cache.stats()
        assert freed <= num_blocks and after.free_blocks == before.free_blocks + freed
        assert after.demoted_blocks >= before.demoted_blocks

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14))
    def lookup(self, tokens: list[int]) -> None:
        found = self.cache.match(tokens).num_tokens
        assert found <= max((lcp(s, tokens) for s in self.committed), default=0)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()
            stats = self.cache.stats()
            assert stats.host_used_blocks <= stats.host_num_blocks
            assert 0 <= stats.host_hit_tokens <= stats.hit_tokens


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
