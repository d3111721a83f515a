"""A Ray Serve deployment of prefixcache: one :class:`~prefixcache.engine.runner.PrefixCachingRunner` per replica,
routed by :class:`~prefixcache.ray.router.ExactPrefixRequestRouter`.

Run it with ``serve run prefixcache.ray.deployment:app`` (two replicas of the embedded ``tiny`` model), or build
your own with ``PrefixCacheServer.options(num_replicas=...).bind(preset=..., num_blocks=...)``.  Call it through a
deployment handle::

    handle = serve.run(app)
    reply = handle.generate.remote({"prompt_ids": [...], "max_new_tokens": 16, "namespace": None}).result()

``reply`` holds ``token_ids``, ``prompt_tokens``, ``cached_tokens`` (prompt tokens whose KV was reused on that
replica) and ``replica`` (the serving replica's actor name, in Ray namespace ``serve``).  Each replica publishes its
KV events on 127.0.0.1, so the router must run on the same host (local Ray, or one node); a multi-node setup needs
endpoints on a reachable address.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from prefixcache.distributed.publisher import ZmqEventPublisher
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.models.llama import build_model

__all__ = ["PrefixCacheServer", "app"]

ROUTER_CONFIG = RequestRouterConfig(
    # By import path, so the router is this very module in the process that routes (not a pickled copy).
    request_router_class="prefixcache.ray.router:ExactPrefixRequestRouter",
    request_routing_stats_period_s=1.0,
    request_routing_stats_timeout_s=5.0,
)


@serve.deployment(
    num_replicas=2,
    max_ongoing_requests=8,
    ray_actor_options={"num_cpus": 0.5},
    request_router_config=ROUTER_CONFIG,
)
class PrefixCacheServer:
    """One replica: a model, its prefix cache, and the publisher of that cache's KV events.

    Args:
        preset: the embedded model preset (seeded weights; see :func:`prefixcache.models.llama.build_model`).
        num_blocks: KV blocks in the replica's pool.
        block_size: tokens per block.
    """

    def __init__(self, preset: str = "tiny", num_blocks: int = 256, block_size: int = 16) -> None:
        self.runner = PrefixCachingRunner(
            build_model(preset, device="cpu"), num_blocks=num_blocks, block_size=block_size
        )
        self.publisher = ZmqEventPublisher()
        self.runner.cache.subscribe(self.publisher)
        try:
            self.name = serve.get_replica_context().replica_id.to_full_id_str()
        except Exception:  # outside a Serve replica (a plain instance in a test)
            self.name = f"pid-{os.getpid()}"
        # One request at a time: the runner's model calls are not meant to interleave on one CPU replica.
        self._lock = threading.Lock()

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """Serve one request: ``{"prompt_ids": [int], "max_new_tokens": int = 16, "namespace": str | None}``.

        Raises what :meth:`~prefixcache.engine.runner.PrefixCachingRunner.generate` raises for bad input.
        """
        sampling = SamplingParams(max_new_tokens=int(request.get("max_new_tokens", 16)))
        with self._lock:
            result = self.runner.generate(request["prompt_ids"], sampling, namespace=request.get("namespace"))
        self.publisher.flush(timeout_s=1.0)
        return {
            "token_ids": list(result.token_ids),
            "prompt_tokens": result.usage.prompt_tokens,
            "cached_tokens": result.usage.cached_tokens,
            "replica": self.name,
        }

    def record_routing_stats(self) -> dict[str, Any]:
        """What :class:`~prefixcache.ray.router.ExactPrefixRequestRouter` needs to find and read this replica."""
        return {
            "kv_events_endpoint": self.publisher.endpoint,
            "kv_events_replay_endpoint": self.publisher.replay_endpoint,
            "fingerprint": self.runner.fingerprint,
            "block_size": self.runner.pool.block_size,
            "hash_seed": self.runner.cache.hash_seed,
            "free_blocks": self.runner.cache.stats().free_blocks,
            "num_blocks": self.runner.pool.num_blocks,
        }

    def __del__(self) -> None:
        publisher = getattr(self, "publisher", None)
        if publisher is not None:
            publisher.close(timeout_s=1.0)


app = PrefixCacheServer.bind()
