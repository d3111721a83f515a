"""The host-memory tier: demotion of evicted blocks, promotion on a match, counters, events, bad configuration and
faults during promotion (:mod:`prefixcache.cache.host.tier`)."""

from __future__ import annotations

import pytest
import torch

from prefixcache import InvalidArgumentError, KVBlockPool, PoolBusyError, RadixCache
from prefixcache.cache.events import BlockIndex, BlockRemoved, BlockStored
from prefixcache.cache.host import HostTier, host_pool_for, make_host_pool

BS = 4
SHAPE = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 3}


def make_cache(device_blocks: int = 4, host_blocks: int = 8, **kwargs) -> RadixCache:
    pool = KVBlockPool(device_blocks, BS, device="cpu", **SHAPE)
    return RadixCache(pool, host_pool=make_host_pool(pool, host_blocks), **kwargs)


def kv_rows(tokens: list[int]) -> torch.Tensor:
    """The K/V a fake model writes for ``tokens``: a function of token id and position, shape
    ``[num_layers, 2, len(tokens), heads, head_dim]``."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t * 1000 + pos)[None, None, :, None, None]
    layer = torch.arange(2, dtype=torch.float32)[:, None, None, None, None]
    kind = torch.arange(2, dtype=torch.float32)[None, :, None, None, None]
    dim = torch.arange(3, dtype=torch.float32)[None, None, None, None, :]
    return base + 0.1 * layer + 0.01 * kind + 0.001 * dim


def run(cache: RadixCache, tokens: list[int]) -> int:
    """Admit, check the cached rows' K/V, write the rest, commit; returns the lease's host tokens."""
    lease = cache.acquire(tokens, num_tokens=len(tokens))
    kv = cache.pool.kv
    rows = kv_rows(tokens)
    for p in range(len(tokens)):
        block = int(lease.block_table[p // BS])
        if p < lease.num_cached_tokens:
            assert torch.equal(kv[:, :, block, p % BS], rows[:, :, p]), f"cached row {p} has the wrong K/V"
        else:
            kv[:, :, block, p % BS] = rows[:, :, p]
    cache.commit(lease, tokens)
    cache.check_invariants()
    return lease


DOC = list(range(1, 13))  # 12 tokens: 3 full blocks
OTHER = list(range(100, 116))  # 16 tokens: the whole device pool


def test_an_evicted_document_moves_to_host_and_comes_back_whole() -> None:
    cache = make_cache()
    run(cache, DOC)
    run(cache, OTHER)  # evicts the document's 3 blocks: they go to host
    stats = cache.stats()
    assert (stats.demoted_blocks, stats.host_used_blocks, stats.host_num_blocks) == (3, 3, 8)
    assert cache.cached_sequences() == [OTHER]
    lease = run(cache, DOC + [999])
    assert (lease.num_cached_tokens, lease.num_host_tokens) == (12, 12)
    stats = cache.stats()
    # Promotion took 3 device blocks (demoting 3 of OTHER's), the 13th token one more (OTHER's last block).
    assert (stats.promoted_blocks, stats.demoted_blocks, stats.host_used_blocks) == (3, 7, 4)
    assert (stats.hit_tokens, stats.host_hit_tokens, stats.device_hit_tokens) == (12, 12, 0)
    assert stats.host_hit_rate == pytest.approx(12 / (12 + 16 + 13))


def test_device_hits_and_host_hits_are_counted_apart() -> None:
    cache = make_cache(device_blocks=6, host_blocks=8)
    run(cache, DOC)  # blocks 0..2
    run(cache, DOC[:8] + [50, 51, 52, 53, 54])  # shares 8 tokens on the device
    stats = cache.stats()
    assert (stats.hit_tokens, stats.host_hit_tokens) == (8, 0)
    cache.evict(1)  # the LRU leaf is DOC's last block: demoted
    assert cache.stats().demoted_blocks == 1
    lease = run(cache, DOC + [7])
    assert (lease.num_cached_tokens, lease.num_host_tokens) == (12, 4)


def test_a_full_host_drops_its_least_recently_used_blocks_first() -> None:
    cache = make_cache(device_blocks=4, host_blocks=3)
    run(cache, DOC)
    run(cache, OTHER)  # DOC's 3 blocks fill the host
    run(cache, [200, 201, 202, 203, 204, 205, 206, 207])  # 2 of OTHER's blocks demoted: 2 of DOC's dropped
    stats = cache.stats()
    assert (stats.demoted_blocks, stats.host_dropped_blocks, stats.host_used_blocks) == (5, 2, 3)
    # The run was filed tail first, so DOC keeps its first block on host, the one a promotion reaches.
    lease = run(cache, DOC + [999])
    assert lease.num_host_tokens == 4


def test_the_partial_last_block_of_a_leaf_is_not_demoted() -> None:
    cache = make_cache()
    run(cache, DOC[:10])  # 2 full blocks and 2 tokens
    cache.evict(3)
    assert cache.stats().demoted_blocks == 2
    lease = run(cache, DOC[:10] + [1, 2])
    assert (lease.num_cached_tokens, lease.num_host_tokens) == (8, 8)


def test_namespaces_never_share_host_blocks() -> None:
    cache = make_cache()
    lease = cache.acquire(DOC, "a", num_tokens=12)
    cache.commit(lease, DOC)
    cache.evict_all()
    assert cache.stats().host_used_blocks == 3
    assert cache.acquire(DOC, "b", num_tokens=12).num_cached_tokens == 0


def test_promotion_that_cannot_fit_evicts_nothing() -> None:
    cache = make_cache(device_blocks=4, host_blocks=8)
    run(cache, DOC)
    run(cache, OTHER)
    held = cache.acquire(OTHER + [1])  # locks OTHER's 4 blocks: nothing is evictable
    before = cache.stats()
    with pytest.raises(PoolBusyError):
        cache.acquire(DOC + [5], num_tokens=13)
    after = cache.stats()
    assert (after.promoted_blocks, after.evicted_blocks, after.host_used_blocks) == (0, before.evicted_blocks, 3)
    cache.release(held)
    cache.check_invariants()


def test_without_a_size_the_tier_promotes_what_fits() -> None:
    cache = make_cache(device_blocks=4, host_blocks=8)
    run(cache, DOC)
    cache.evict_all()
    lease = cache.acquire(DOC + [5])
    assert (lease.num_cached_tokens, lease.num_host_tokens) == (12, 12)
    cache.release(lease)
    cache.check_invariants()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_size": 8}, "block_size"),
        ({"head_dim": 4}, "head_dim"),
        ({"num_layers": 1}, "num_layers"),
        ({"dtype": torch.float16}, "dtype"),
    ],
)
def test_a_host_pool_of_another_shape_is_refused(change: dict, message: str) -> None:
    pool = KVBlockPool(4, BS, device="cpu", **SHAPE)
    args = {"block_size": BS, **SHAPE, "dtype": torch.float32, **change}
    host = KVBlockPool(8, args.pop("block_size"), device="cpu", **args)
    with pytest.raises(InvalidArgumentError, match=message):
        RadixCache(pool, host_pool=host)


def test_a_host_pool_that_is_the_device_pool_or_not_a_pool_is_refused() -> None:
    pool = KVBlockPool(4, BS, device="cpu", **SHAPE)
    with pytest.raises(InvalidArgumentError, match="second pool"):
        RadixCache(pool, host_pool=pool)
    with pytest.raises(InvalidArgumentError, match="KVBlockPool"):
        RadixCache(pool, host_pool="cpu")


def test_host_pool_sizes() -> None:
    pool = KVBlockPool(4, BS, device="cpu", **SHAPE)
    assert host_pool_for(pool) is None
    assert host_pool_for(pool, host_tokens=10).num_blocks == 3
    per_block = pool.bytes_per_token * BS
    assert host_pool_for(pool, host_bytes=5 * per_block + 1).num_blocks == 5
    with pytest.raises(InvalidArgumentError, match="at most one"):
        host_pool_for(pool, 8, 1 << 20)
    with pytest.raises(InvalidArgumentError, match="positive"):
        host_pool_for(pool, host_tokens=0)
    with pytest.raises(InvalidArgumentError, match="needs a model"):
        host_pool_for(KVBlockPool(4, BS), host_bytes=1 << 20)
    host = host_pool_for(pool, host_tokens=16)
    assert host.device.type == "cpu" and host.kv.shape == (2, 2, 4, BS, 1, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs a CUDA device pool")
def test_the_host_pool_of_a_cuda_pool_is_pinned() -> None:
    pool = KVBlockPool(4, BS, device="cuda", **SHAPE)
    assert make_host_pool(pool, 8).kv.is_pinned()


@pytest.mark.parametrize("where", ["copy_in", "insert"])
def test_a_fault_during_promotion_leaves_the_cache_quiescent(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    cache = make_cache()
    run(cache, DOC)
    run(cache, OTHER)
    before = cache.stats()

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    if where == "copy_in":
        monkeypatch.setattr(HostTier, "copy_in", boom)
    else:
        monkeypatch.setattr(type(cache._blocks), "insert", boom)
    with pytest.raises(RuntimeError, match="injected"):
        cache.acquire(DOC + [5], num_tokens=13)
    cache.check_invariants()  # no block owned, no lock held, the host index consistent
    after = cache.stats()
    assert after.locked_tokens == 0 and cache._blocks.num_owned == 0 and not cache._locks.handles
    # The device blocks it had evicted for the promotion stay demoted; the document's host blocks stay too.
    assert after.host_used_blocks == before.host_used_blocks + after.demoted_blocks - before.demoted_blocks
    assert after.promoted_blocks == 0
    monkeypatch.undo()
    lease = run(cache, DOC + [5])
    assert lease.num_host_tokens == 12  # the host blocks stayed host-resident


def test_events_say_where_each_block_lives() -> None:
    events: list = []
    index = BlockIndex()
    cache = make_cache(event_listener=lambda e: (events.append(e), index(e)))
    run(cache, DOC)
    events.clear()
    run(cache, OTHER)
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.medium for e in removed] == ["GPU"]
    assert [e.medium for e in stored] == ["CPU", "CPU", "CPU", "GPU"]
    # Demotion: removed from the device, then stored on host under the same chained hashes.
    assert events.index(removed[0]) < events.index(stored[0])
    assert sorted(h for e in stored[:3] for h in e.block_hashes) == sorted(removed[0].block_hashes)
    assert {m for media in index.media.values() for m in media} == {"CPU", "GPU"}
    events.clear()
    run(cache, DOC + [999])
    promoted = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert sorted(promoted[0].block_hashes) == sorted(h for e in stored[:3] for h in e.block_hashes)
    late = BlockIndex()
    cache.subscribe(late)  # a new subscriber gets both tiers
    assert late.media == index.media


def test_host_blocks_past_a_recomputed_head_are_found_again() -> None:
    # The stateful test's case: [2, 1, 1, 1] is demoted as one run of 2 blocks keyed by its first, [2, 1]; a request
    # sharing only [2, 1] cannot take its promotion (the pool is too small for it), recomputes [2, 1] on the device and
    # commits it.  [2, 1, 1, 1] then matches [2, 1] on the device, and the host's [1, 1] must still be found from
    # there: inserting the recomputed block drops its host copy and files the rest of the run under block 1.
    pool = KVBlockPool(8, 2, device="cpu", num_layers=2, num_kv_heads=1, head_dim=3)
    cache = RadixCache(pool, host_pool=make_host_pool(pool, 512))

    def request(tokens: list[int], extra: int = 0):
        full = tokens + [0] * extra
        lease = cache.acquire(tokens, num_tokens=len(full))
        rows = kv_rows(full)
        for p in range(len(full)):
            block = int(lease.block_table[p // 2])
            if p < lease.num_cached_tokens:
                assert torch.equal(pool.kv[:, :, block, p % 2], rows[:, :, p]), f"cached row {p} has the wrong K/V"
            else:
                pool.kv[:, :, block, p % 2] = rows[:, :, p]
        cache.commit(lease, full)
        cache.check_invariants()
        return lease

    request([2, 0])
    for _ in range(13):
        cache.match([0])
    request([0, 0, 0])
    request([2, 1, 1, 1])
    request([0] * 11)  # evicts [2, 1, 1, 1]: its 2 full blocks go to host
    assert request([2, 1] + [0] * 10, 3).num_host_tokens == 0  # 8 blocks: no room to promote [2, 1] first
    lease = request([2, 1, 1, 1])
    assert (lease.num_cached_tokens, lease.num_host_tokens) == (3, 1)
