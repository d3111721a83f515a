"""Prometheus metrics of a server: requests, prompt tokens cached and prefilled, TTFT, and the cache's own state.

Counters and the TTFT histogram are updated per request; the cache gauges (hit rate, pool occupancy, evictions) are
read from :meth:`RadixCache.stats` at scrape time, so they are never stale, and so are the engine's counters
(preemptions, cancellations) when the server passes its engine.  Each server has its own registry, so
several apps in one process (tests) do not collide.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prefixcache.cache.radix_cache import RadixCache
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.results import Usage

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _CacheCollector:
    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache

    def collect(self):
        stats = self.cache.stats()
        yield GaugeMetricFamily("prefixcache_hit_rate", "Cache hit rate (hit tokens / query tokens)", stats.hit_rate)
        yield GaugeMetricFamily("prefixcache_pool_blocks", "KV blocks in the pool", stats.num_blocks)
        yield GaugeMetricFamily("prefixcache_pool_used_blocks", "KV blocks in use", stats.used_blocks)
        yield GaugeMetricFamily(
            "prefixcache_pool_occupancy", "Used blocks / pool blocks", stats.used_blocks / max(stats.num_blocks, 1)
        )
        yield GaugeMetricFamily("prefixcache_cached_tokens", "Tokens held by the radix tree", stats.cached_tokens)
        yield CounterMetricFamily("prefixcache_evictions", "Eviction passes", stats.evictions)
        yield CounterMetricFamily("prefixcache_evicted_tokens", "Tokens evicted", stats.evicted_tokens)


class _EngineCollector:
    def __init__(self, engine: BatchEngine) -> None:
        self.engine = engine

    def collect(self):
        engine = self.engine
        yield CounterMetricFamily(
            "prefixcache_preempted_requests",
            "Preemptions: a running request freed its blocks to resume later (recompute)",
            engine.preempted_requests,
        )
        yield CounterMetricFamily(
            "prefixcache_cancelled_requests", "Requests cancelled before they finished", engine.cancelled_requests
        )


class ServerMetrics:
    """The metrics of one server over ``cache`` (and ``engine``'s counters, if given); :meth:`observe` after each
    request, :meth:`render` to scrape."""

    def __init__(self, cache: RadixCache, engine: BatchEngine | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "prefixcache_requests", "Requests served", ["endpoint", "status"], registry=self.registry
        )
        self.prompt_tokens = Counter("prefixcache_prompt_tokens", "Prompt tokens", registry=self.registry)
        self.prompt_cached_tokens = Counter(
            "prefixcache_prompt_cached_tokens", "Prompt tokens whose KV came from the cache", registry=self.registry
        )
        self.prefilled_tokens = Counter(
            "prefixcache_prefilled_tokens", "Prompt tokens computed (not cached)", registry=self.registry
        )
        self.generated_tokens = Counter("prefixcache_generated_tokens", "Tokens generated", registry=self.registry)
        self.ttft = Histogram(
            "prefixcache_ttft_seconds", "Time to first token (prefill)", buckets=_TTFT_BUCKETS, registry=self.registry
        )
        self.registry.register(_CacheCollector(cache))
        if engine is not None:
            self.registry.register(_EngineCollector(engine))
        self._served: dict[str, Any] = {}  # endpoint -> its "ok" child, since labels() takes a lock and a lookup

    def observe(self, endpoint: str, usage: Usage) -> None:
        served = self._served.get(endpoint)
        if served is None:
            served = self._served[endpoint] = self.requests.labels(endpoint, "ok")
        served.inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.prompt_cached_tokens.inc(usage.cached_tokens)
        self.prefilled_tokens.inc(usage.prefilled_tokens)
        self.generated_tokens.inc(usage.generated_tokens)
        self.ttft.observe(usage.ttft_s)

    def failed(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
