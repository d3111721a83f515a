"""Host blocks no listener heard of, announced later: demoted before anyone subscribed, or restored from a snapshot
(:mod:`prefixcache.cache.host.events`).  A mirror fed from the subscription on must predict exactly the hits the
cache gives, host blocks included."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_host_tier import BS, DOC, OTHER, make_cache, run
from test_host_tier_events import Mirror

from prefixcache import KVBlockPool, RadixCache
from prefixcache.cache.events import BlockIndex, block_hashes
from prefixcache.cache.host import make_host_pool
from prefixcache.distributed.router import cached_prefix_blocks


def host_hashes(index: BlockIndex) -> set[int]:
    return {h for (_, h), media in index.media.items() if "CPU" in media}


def predicted_tokens(index: BlockIndex, prompt: list[int]) -> int:
    return cached_prefix_blocks(index, block_hashes(prompt, BS)) * BS


def test_blocks_demoted_before_anyone_listened_are_announced_to_a_late_subscriber() -> None:
    cache = make_cache()
    run(cache, DOC)
    run(cache, OTHER)  # demotes the document, with nobody listening
    mirror = Mirror()
    cache.subscribe(mirror)
    mirror.check(cache)
    assert host_hashes(mirror.index) == set(block_hashes(DOC, BS))
    assert predicted_tokens(mirror.index, DOC + [999]) == run(cache, DOC + [999]).num_cached_tokens == 12


def test_a_run_that_continues_a_device_prefix_is_announced_with_its_chain() -> None:
    cache = make_cache()
    run(cache, DOC)
    cache.evict(2)  # the document's last two blocks go to host; its first stays on the device
    mirror = Mirror()
    cache.subscribe(mirror)
    mirror.check(cache)
    assert host_hashes(mirror.index) == set(block_hashes(DOC, BS)[1:])
    assert predicted_tokens(mirror.index, DOC + [999]) == 12


def test_a_run_that_continues_another_run_is_announced_too() -> None:
    cache = make_cache()
    run(cache, DOC)
    cache.evict(1)  # block 2 to host
    cache.evict(2)  # then blocks 0 and 1: a run whose end is where the first one starts
    assert cache.stats().host_used_blocks == 3
    mirror = Mirror()
    cache.subscribe(mirror)
    mirror.check(cache)
    assert host_hashes(mirror.index) == set(block_hashes(DOC, BS))


def test_a_second_subscriber_gets_the_host_blocks_the_first_heard_announced_once() -> None:
    cache = make_cache()
    run(cache, DOC)
    run(cache, OTHER)
    first, second = Mirror(), Mirror()
    cache.subscribe(first)
    cache.subscribe(second)
    first.check(cache)
    second.check(cache)
    assert host_hashes(first.index) == host_hashes(second.index) == set(block_hashes(DOC, BS))


@pytest.mark.parametrize("listening_at_load", [True, False])
def test_runs_restored_from_a_snapshot_are_announced(tmp_path: Path, listening_at_load: bool) -> None:
    pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")
    old = make_cache()
    run(old, DOC)
    run(old, OTHER)
    old.save(tmp_path)
    mirror = Mirror()
    pool = KVBlockPool(4, BS, device="cpu", num_layers=2, num_kv_heads=1, head_dim=3)
    extra = {"event_listener": mirror} if listening_at_load else {}
    cache = RadixCache.load(tmp_path, pool, host_pool=make_host_pool(pool, 8), **extra)
    if not listening_at_load:
        cache.subscribe(mirror)
    mirror.check(cache)
    assert host_hashes(mirror.index) == set(block_hashes(DOC, BS))
    assert predicted_tokens(mirror.index, DOC + [999]) == run(cache, DOC + [999]).num_cached_tokens == 12
    mirror.check(cache)
