"""A router's mirror of a replica with a host-memory tier, fed over real ZMQ sockets on 127.0.0.1, predicts exactly
the hits the replica gives: when it attaches after blocks went to host, and after the replica restarts from a
snapshot on the same endpoints."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="needs the [events] extra")
pytest.importorskip("msgspec", reason="needs the [events] extra")

from prefixcache import KVBlockPool, RadixCache  # noqa: E402
from prefixcache.cache.events import BlockIndex, block_hashes  # noqa: E402
from prefixcache.cache.host import make_host_pool  # noqa: E402
from prefixcache.distributed.publisher import ZmqEventPublisher  # noqa: E402
from prefixcache.distributed.router import cached_prefix_blocks  # noqa: E402
from prefixcache.distributed.subscriber import ZmqEventSubscriber  # noqa: E402

BS = 4
DOC = list(range(1, 13))  # 3 blocks
OTHER = list(range(100, 116))  # 4 blocks: the whole device pool
THIRD = list(range(200, 208))  # 2 blocks


def host_cache() -> RadixCache:
    pool = KVBlockPool(4, BS, device="cpu", num_layers=0)
    return RadixCache(pool, host_pool=make_host_pool(pool, 8))


def admit(cache: RadixCache, tokens: list[int]) -> int:
    lease = cache.acquire(tokens, num_tokens=len(tokens))
    cache.commit(lease, tokens)
    return lease.num_cached_tokens


def predicted(index: BlockIndex, tokens: list[int]) -> int:
    return cached_prefix_blocks(index, block_hashes(tokens, BS)) * BS


def predictions(index: BlockIndex) -> dict[str, int]:
    prompts = {"doc": DOC, "other": OTHER, "third": THIRD}
    return {name: predicted(index, tokens + [999]) for name, tokens in prompts.items()}


def eventually(condition, timeout_s: float = 8.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_a_router_attaching_late_counts_the_blocks_demoted_before_it_listened() -> None:
    cache = host_cache()
    admit(cache, DOC)
    admit(cache, OTHER)  # the document goes to host before anyone listens
    with ZmqEventPublisher() as publisher:
        cache.subscribe(publisher)
        index = BlockIndex()
        with ZmqEventSubscriber(publisher.endpoint, publisher.replay_endpoint, index) as subscriber:
            assert publisher.flush() and subscriber.wait_for(publisher.last_seq)
            assert predictions(index) == {"doc": 12, "other": 16, "third": 0}
            assert admit(cache, DOC + [999]) == 12
        cache.unsubscribe(publisher)


def test_a_router_follows_a_replica_restarted_from_a_snapshot_on_the_same_endpoints(tmp_path: Path) -> None:
    pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")
    old_cache = host_cache()
    old = ZmqEventPublisher()
    old_cache.subscribe(old)
    admit(old_cache, DOC)
    admit(old_cache, OTHER)
    old_cache.save(tmp_path)  # the document on host, the other on the device
    admit(old_cache, THIRD)  # after the save: the restarted replica will not hold it
    assert old.flush()
    index = BlockIndex(strict=False)
    with ZmqEventSubscriber(old.endpoint, old.replay_endpoint, index, resync_interval_s=0.2) as subscriber:
        assert subscriber.wait_for(old.last_seq)
        assert predictions(index)["third"] == 8
        old_cache.unsubscribe(old)
        old.close()
        pool = KVBlockPool(4, BS, device="cpu", num_layers=0)
        with ZmqEventPublisher(old.endpoint, old.replay_endpoint) as new:
            cache = RadixCache.load(tmp_path, pool, host_pool=make_host_pool(pool, 8), event_listener=new)
            assert new.flush()
            expected = {"doc": 12, "other": 16, "third": 0}
            assert eventually(lambda: predictions(index) == expected), predictions(index)
            assert subscriber.num_restarts == 1
            assert admit(cache, DOC + [999]) == 12
            cache.unsubscribe(new)
