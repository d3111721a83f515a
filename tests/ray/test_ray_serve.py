"""prefixcache on a real local Ray Serve: two replicas of the tiny model behind ExactPrefixRequestRouter.

Ray starts inside the test (about 30 s on two idle cores): marked ``ray``, deselect with ``-m "not ray"``; skipped
without the [ray] extra.  Every wait has a timeout.
"""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason="needs the [ray] extra")
serve = pytest.importorskip("ray.serve", reason="needs the [ray] extra")
pytest.importorskip("zmq", reason="needs the [ray] extra")

from ray.serve.config import RequestRouterConfig  # noqa: E402

from prefixcache.engine.runner import PrefixCachingRunner  # noqa: E402
from prefixcache.engine.sampling import SamplingParams  # noqa: E402
from prefixcache.models.llama import build_model  # noqa: E402
from prefixcache.ray.deployment import PrefixCacheServer  # noqa: E402
from prefixcache.ray.router import ExactPrefixRequestRouter, routed_namespace  # noqa: E402

pytestmark = pytest.mark.ray

NUM_CONVERSATIONS = 8
TURNS = 5
NEW_TOKENS = 4
BLOCK_SIZE = 8
RESULT_TIMEOUT_S = 60


TURN_TOKENS = 48


def _user_turn(conversation: int, turn: int) -> list[int]:
    return [(7 * conversation + 3 * turn + k) % 200 + 1 for k in range(TURN_TOKENS)]


def _mirrored() -> int:
    return max((router.num_mirrored for router in ExactPrefixRequestRouter.live), default=0)


@pytest.fixture(scope="module")
def handle():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(proxy_location="Disabled")
        # All 8 conversations are in flight at once: allow queue lengths to differ by 8 before balancing by load.
        router = RequestRouterConfig(
            request_router_class="prefixcache.ray.router:ExactPrefixRequestRouter",
            request_router_kwargs={"load_penalty_tokens": 1.0, "imbalance_abs": 8},
            request_routing_stats_period_s=1.0,
        )
        options = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}, "request_router_config": router}
        app = PrefixCacheServer.options(**options).bind(num_blocks=512, block_size=BLOCK_SIZE)
        h = serve.run(app, name="prefixcache-test", route_prefix=None)
        # The router learns the replicas' endpoints from routing stats (every second): wait until both are mirrored.
        deadline = time.monotonic() + 60
        while _mirrored() < 2 and time.monotonic() < deadline:
            h.generate.remote({"prompt_ids": [1, 2, 3], "max_new_tokens": 1, "namespace": "warm-up"}).result(
                timeout_s=RESULT_TIMEOUT_S
            )
            time.sleep(0.2)
        assert _mirrored() == 2, "the router never saw both replicas' KV event endpoints"
        yield h
    finally:
        serve.shutdown()
        ray.shutdown()


def _call(h, prompt: list[int], retries: int = 1) -> dict:
    for attempt in range(retries + 1):
        try:
            return h.generate.remote({"prompt_ids": prompt, "max_new_tokens": NEW_TOKENS}).result(
                timeout_s=RESULT_TIMEOUT_S
            )
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            if attempt == retries:
                raise
    raise AssertionError("unreachable")


def test_router_namespace_matches_the_runner_rule() -> None:
    runner = PrefixCachingRunner(build_model("tiny", device="cpu"), num_blocks=4)
    for namespace in (None, "tenant"):
        assert routed_namespace(runner.fingerprint, namespace) == runner.namespace_key(namespace)


def test_conversations_stay_where_their_prefix_is_and_survive_a_killed_replica(handle) -> None:
    prompts: list[list[int]] = [[] for _ in range(NUM_CONVERSATIONS)]
    replies: list[list[dict]] = [[] for _ in range(NUM_CONVERSATIONS)]
    for turn in range(TURNS):
        pending = []
        for c in range(NUM_CONVERSATIONS):
            prompts[c] = prompts[c] + _user_turn(c, turn)
            pending.append(handle.generate.remote({"prompt_ids": prompts[c], "max_new_tokens": NEW_TOKENS}))
        for c, response in enumerate(pending):
            reply = response.result(timeout_s=RESULT_TIMEOUT_S)
            replies[c].append({**reply, "prompt": list(prompts[c])})
            prompts[c] = prompts[c] + reply["token_ids"]

    # Every conversation stayed on one replica, and both replicas got work.
    homes = [{r["replica"] for r in conversation} for conversation in replies]
    assert all(len(h) == 1 for h in homes), homes
    assert len(set.union(*homes)) == 2

    # Aggregate hit rate within 2 points of one replica holding everything, on the very same prompts.
    cached = sum(r["cached_tokens"] for c in replies for r in c)
    total = sum(r["prompt_tokens"] for c in replies for r in c)
    single = PrefixCachingRunner(build_model("tiny", device="cpu"), num_blocks=1024, block_size=BLOCK_SIZE)
    single_cached = 0
    for turn in range(TURNS):
        for c in range(NUM_CONVERSATIONS):
            result = single.generate(replies[c][turn]["prompt"], SamplingParams(max_new_tokens=NEW_TOKENS))
            assert list(result.token_ids) == replies[c][turn]["token_ids"], "replicas must be exact"
            single_cached += result.usage.cached_tokens
    assert total > 0 and abs(cached - single_cached) / total <= 0.02, (cached, single_cached, total)

    # Kill the replica serving conversation 0: its conversations go to the survivor, and nothing hangs.
    victim = next(iter(homes[0]))
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    survivors = set()
    for c in range(NUM_CONVERSATIONS):
        reply = _call(handle, prompts[c] + _user_turn(c, TURNS), retries=2)
        survivors.add(reply["replica"])
    assert victim not in survivors
