"""The Serve deployment's class and the router's pieces without starting Ray: a replica's generate, its routing
stats, and a subscriber mirroring its cache from those stats.  Fast; needs the [ray] extra only to import."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="needs the [ray] extra")
pytest.importorskip("zmq", reason="needs the [ray] extra")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402

from prefixcache.cache.events import BlockIndex, block_hashes  # noqa: E402
from prefixcache.distributed.router import ExactPrefixRouter  # noqa: E402
from prefixcache.distributed.subscriber import ZmqEventSubscriber  # noqa: E402
from prefixcache.errors import InvalidTokensError, NamespaceError  # noqa: E402
from prefixcache.ray.deployment import PrefixCacheServer  # noqa: E402
from prefixcache.ray.router import (  # noqa: E402
    UNSENT_GRACE_S,
    ExactPrefixRequestRouter,
    memory_of,
    request_of,
    routed_namespace,
)


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


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        ({"prompt_ids": [-1, 2, 3, 4, 5]}, InvalidTokensError),
        ({"prompt_ids": [1.5, 2]}, InvalidTokensError),
        ({"prompt_ids": [1, 2, 3, 4, 5], "namespace": 5}, NamespaceError),
    ],
)
def test_a_request_the_router_cannot_hash_goes_to_any_replica_which_reports_its_error(server, request_, error) -> None:
    # An exception out of choose_replicas ends Ray Serve's routing task and the caller waits forever; offered every
    # replica instead, the request reaches one, whose generate raises the package's error back to the caller.
    router = ExactPrefixRequestRouter(DeploymentID(name="d", app_name="a"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    stats = {"fingerprint": "fp", "block_size": 4, "hash_seed": 0, "free_blocks": 8, "num_blocks": 8}
    replicas = [SimpleNamespace(replica_id=f"r{i}", routing_stats=stats) for i in range(2)]
    ranks = asyncio.run(router.choose_replicas(replicas, SimpleNamespace(args=[request_], kwargs={})))
    assert ranks == [replicas]
    with pytest.raises(error):
        server.generate(request_)


def test_replicas_reporting_impossible_memory_are_routed_without_the_memory_cost() -> None:
    bad = SimpleNamespace(routing_stats={"free_blocks": -3, "num_blocks": 64})
    full = SimpleNamespace(routing_stats={"free_blocks": 3, "num_blocks": 64})
    assert memory_of([full, bad]) == (None, None)
    assert memory_of([full, SimpleNamespace(routing_stats={"free_blocks": 65, "num_blocks": 64})]) == (None, None)
    assert memory_of([full, SimpleNamespace(routing_stats={"free_blocks": True, "num_blocks": 64})]) == (None, None)


def test_an_absurd_max_new_tokens_does_not_break_routing() -> None:
    router = ExactPrefixRequestRouter(DeploymentID(name="d", app_name="a"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state(evict_weight=1.0)
    stats = {"fingerprint": "fp", "block_size": 4, "hash_seed": 0, "free_blocks": 8, "num_blocks": 8}
    replicas = [SimpleNamespace(replica_id=f"r{i}", routing_stats=stats) for i in range(2)]
    request = {"prompt_ids": [1, 2, 3, 4, 5], "max_new_tokens": 10**400}
    ranks = asyncio.run(router.choose_replicas(replicas, SimpleNamespace(args=[request], kwargs={})))
    assert [len(rank) for rank in ranks] == [1, 1]


def _pending(request: dict, request_id: str = "q") -> SimpleNamespace:
    return SimpleNamespace(
        args=[request], kwargs={}, metadata=SimpleNamespace(internal_request_id=request_id), future=Future()
    )


def _fresh_router(**settings) -> tuple[ExactPrefixRequestRouter, list[SimpleNamespace]]:
    deployment = DeploymentID(name="d", app_name="a")
    router = ExactPrefixRequestRouter(deployment, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
    router.initialize_state(**settings)
    stats = {"fingerprint": "fp", "block_size": 4, "hash_seed": 0, "free_blocks": 8, "num_blocks": 8}
    replicas = [SimpleNamespace(replica_id=ReplicaID(f"r{i}", deployment), routing_stats=dict(stats)) for i in range(2)]
    return router, replicas


def _route(router, replicas, pending) -> SimpleNamespace:
    return asyncio.run(router.choose_replicas(replicas, pending))[0][0]


def test_a_burst_of_new_prompts_is_spread_even_when_the_queue_lengths_are_stale() -> None:
    # Ray Serve decides a burst of requests before it sends any, so every decision sees the same queue lengths; here
    # they still count one finished request on r1.  The router adds the requests it routed and Ray Serve has not sent,
    # so new prompts (no cached prefix anywhere) alternate instead of all going to r0.
    router, replicas = _fresh_router(load_penalty_tokens=1.0, imbalance_abs=8)
    r0, r1 = (r.replica_id for r in replicas)
    router.on_new_queue_len_info(r1, 1)
    assert router.replica_queue_len_cache.get(r1) == 1
    burst = [_pending({"prompt_ids": [c + 1] * 12, "max_new_tokens": 4}, f"q{c}") for c in range(8)]
    chosen = [_route(router, replicas, p) for p in burst]
    assert [c.replica_id for c in chosen].count(r0) == 4, chosen
    assert router.num_unsent == {r0: 4, r1: 4}
    # Resolved but not sent: still counted here.  Once sent, Ray Serve's queue length counts them instead.
    for p, c in zip(burst, chosen, strict=True):
        p.future.set_result(c)
    assert router.num_unsent == {r0: 4, r1: 4}
    for c in chosen:
        router.on_send_request(c.replica_id)
    assert router.num_unsent == {}
    assert router.replica_queue_len_cache.get(r0) == 4 and router.replica_queue_len_cache.get(r1) == 5


def test_a_request_cancelled_failed_or_sent_elsewhere_is_counted_where_it_is() -> None:
    router, replicas = _fresh_router()
    r0, r1 = (r.replica_id for r in replicas)
    pending = [_pending({"prompt_ids": [c + 1] * 12}, f"q{c}") for c in range(3)]
    chosen = [_route(router, replicas, p).replica_id for p in pending]
    assert sorted(router.num_unsent.values()) == [1, 2]
    pending[0].future.cancel()  # the caller gave up while it waited for a replica: it will never be sent
    pending[1].future.set_exception(RuntimeError("routing failed"))
    other = r1 if chosen[2] == r0 else r0
    pending[2].future.set_result(SimpleNamespace(replica_id=other))  # its replica was full: the next rank took it
    assert router.num_unsent == {other: 1}
    # Sending to the chosen replica something else (a broadcast) does not free it; sending it where it went does.
    router.on_send_request(chosen[2])
    assert router.num_unsent == {other: 1}
    router.on_send_request(other)
    assert router.num_unsent == {}


def test_calls_sharing_an_internal_request_id_each_count_and_a_request_routed_again_counts_once() -> None:
    # Calls a replica makes while serving one request inherit its internal request id (Ray Serve's request context):
    # a fan-out from an ingress deployment is a burst of requests with one id.
    router, replicas = _fresh_router(load_penalty_tokens=1.0, imbalance_abs=8)
    r0, r1 = (r.replica_id for r in replicas)
    fan_out = [_pending({"prompt_ids": [c + 1] * 12}, "parent") for c in range(8)]
    for p in fan_out:
        _route(router, replicas, p)
    assert router.num_unsent == {r0: 4, r1: 4}
    _route(router, replicas, fan_out[0])
    assert sum(router.num_unsent.values()) == 8


def test_a_routed_request_never_sent_stops_counting_after_the_grace_period() -> None:
    # A caller that gives up just after its request resolved, or handle.choose_replica(..., _reserve=False), never
    # sends it nor reserves a slot for it: no hook says it is over.
    router, replicas = _fresh_router()
    now = [100.0]
    router._clock = lambda: now[0]
    p = _pending({"prompt_ids": [5] * 12})
    p.future.set_result(_route(router, replicas, p))
    assert sum(router.num_unsent.values()) == 1
    now[0] += UNSENT_GRACE_S - 1
    _route(router, replicas, _pending({"prompt_ids": [6] * 12}))
    assert sum(router.num_unsent.values()) == 2
    now[0] += 2
    _route(router, replicas, _pending({"prompt_ids": [7] * 12}))
    assert sum(router.num_unsent.values()) == 2


def test_unsent_requests_of_a_dead_replica_are_forgotten() -> None:
    router, replicas = _fresh_router()
    r0, r1 = (r.replica_id for r in replicas)
    for c in range(4):
        _route(router, replicas, _pending({"prompt_ids": [c + 1] * 12}, f"q{c}"))
    assert router.num_unsent == {r0: 2, r1: 2}
    router.on_replica_actor_died(r0)
    assert router.num_unsent == {r1: 2}


def test_a_request_reserved_through_choose_replica_stops_counting_once_its_replica_reports_it() -> None:
    # handle.choose_replica(...) (Ray 2.60): the routing future resolves, the replica reserves a slot and reports its
    # queue length with the reservation in it (on_new_queue_len_info); dispatch sends with no on_send_request.  The
    # reported length counts the request from then on, so the router must stop counting it too.
    router, replicas = _fresh_router()
    p = _pending({"prompt_ids": [5] * 12})
    chosen = _route(router, replicas, p)
    p.future.set_result(chosen)
    assert router.num_unsent == {chosen.replica_id: 1}
    router.on_new_queue_len_info(chosen.replica_id, 1)  # reserve_slot accepted: 1 ongoing, this one
    assert router.num_unsent == {}
    assert router.replica_queue_len_cache.get(chosen.replica_id) == 1
    # Requests still being routed, or resolved to the other replica, keep counting.
    q = _pending({"prompt_ids": [6] * 12}, "q2")
    q_chosen = _route(router, replicas, q)
    router.on_new_queue_len_info(q_chosen.replica_id, 1)
    assert router.num_unsent == {q_chosen.replica_id: 1}
    other = next(r for r in replicas if r.replica_id != q_chosen.replica_id)
    q.future.set_result(q_chosen)
    router.on_new_queue_len_info(other.replica_id, 0)
    assert router.num_unsent == {q_chosen.replica_id: 1}
