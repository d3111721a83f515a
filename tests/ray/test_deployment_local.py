"""The Serve deployment's class and the router's pieces without starting Ray: a replica's generate, its routing
stats, and a subscriber mirroring its cache from those stats.  Fast; needs the [ray] extra only to import."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="needs the [ray] extra")
pytest.importorskip("zmq", reason="needs the [ray] extra")

from prefixcache.cache.events import BlockIndex, block_hashes  # noqa: E402
from prefixcache.distributed.router import ExactPrefixRouter  # noqa: E402
from prefixcache.distributed.subscriber import ZmqEventSubscriber  # noqa: E402
from prefixcache.ray.deployment import PrefixCacheServer  # noqa: E402
from prefixcache.ray.router import memory_of, request_of, routed_namespace  # noqa: E402


@pytest.fixture
def server():
    replica = PrefixCacheServer.func_or_class(num_blocks=64, block_size=4)
    yield replica
    replica.publisher.close()


def test_a_replica_serves_generate_and_its_stats_let_a_router_mirror_it(server) -> None:
    prompt = list(range(1, 14))
    first = server.generate({"prompt_ids": prompt, "max_new_tokens": 3, "namespace": "t"})
    assert first["prompt_tokens"] == 13 and first["cached_tokens"] == 0 and len(first["token_ids"]) == 3
    second = server.generate({"prompt_ids": prompt + first["token_ids"] + [7], "max_new_tokens": 2, "namespace": "t"})
    assert second["cached_tokens"] >= 13

    stats = server.record_routing_stats()
    assert stats["block_size"] == 4 and stats["hash_seed"] == 0
    # What the router's memory cost reads: the replica's free blocks and pool size.
    assert stats["num_blocks"] == 64 and stats["free_blocks"] == server.runner.pool.num_free_blocks < 64
    index = BlockIndex(strict=False)
    with ZmqEventSubscriber(stats["kv_events_endpoint"], stats["kv_events_replay_endpoint"], index) as subscriber:
        assert server.publisher.flush()
        assert subscriber.wait_for(server.publisher.last_seq, timeout_s=10)
    namespace = routed_namespace(stats["fingerprint"], "t")
    expected = {
        (None, h) for seq in server.runner.cache.cached_sequences(namespace) for h in block_hashes(seq, 4, namespace)
    }
    assert index.hashes == expected and expected
    router = ExactPrefixRouter(4, index_namespace=None)
    cached = router.cached_tokens(prompt + first["token_ids"], [index, BlockIndex()], namespace)
    assert cached == [16, 0]
    # Another tenant's identical prompt is not cached for it.
    assert router.cached_tokens(prompt, [index], routed_namespace(stats["fingerprint"], "u")) == [0]


def test_request_of_reads_only_generate_requests() -> None:
    class Pending:
        def __init__(self, args, kwargs):
            self.args, self.kwargs = args, kwargs

    assert request_of(Pending([{"prompt_ids": [1, 2]}], {})) == {"prompt_ids": [1, 2]}
    assert request_of(Pending([], {"request": {"prompt_ids": (3,)}})) == {"prompt_ids": (3,)}
    assert request_of(Pending(["text"], {})) is None
    assert request_of(None) is None


def test_memory_of_reads_free_blocks_only_when_every_replica_reports_them() -> None:
    full = SimpleNamespace(routing_stats={"free_blocks": 3, "num_blocks": 64})
    empty = SimpleNamespace(routing_stats={"free_blocks": 64, "num_blocks": 64})
    assert memory_of([full, empty]) == ([3, 64], [64, 64])
    # A replica that has not reported yet would look full (or empty): no memory cost for this decision.
    assert memory_of([full, SimpleNamespace(routing_stats=None)]) == (None, None)
    assert memory_of([full, SimpleNamespace(routing_stats={"free_blocks": 1, "num_blocks": 0})]) == (None, None)
