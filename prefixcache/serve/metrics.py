"""Prometheus metrics of a server: requests, prompt tokens cached and prefilled, TTFT, and the engine's own figures.

Counters and the TTFT histogram are the server's, updated per request.  The engine's figures (the cache's hit rate,
pool occupancy and evictions, the engine's preemptions and cancellations) are read at scrape time
(:meth:`BatchEngine.figures`; an engine process's in one round trip), so they are never stale: a scrape either has
them, read for it, or leaves them out.

A scrape never waits on the engine for long: the engine's figures are awaited for at most
:data:`FIGURES_TIMEOUT_S` seconds.  When they do not come in time (an engine process that is stopped, stuck or
slow), or cannot come (the engine process is gone, or not answering), the scrape answers at once with the server's
own metrics and ``prefixcache_engine_up 0``, the engine's figures left out: Prometheus' convention for an exporter
whose target does not answer but which still has metrics worth keeping (here the requests answered 503 meanwhile).
``prefixcache_engine_up 1`` marks a scrape that has them.  One read of the figures runs at a time, on one worker
thread: a scrape that comes while one is under way waits for that one, so scrapes of a silent engine never hold
more than that thread.

Each server has its own registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prefixcache.engine.batching import EngineFigures
from prefixcache.engine.results import Usage
from prefixcache.errors import EngineDeadError, InvalidArgumentError

__all__ = ["CONTENT_TYPE", "FIGURES_TIMEOUT_S", "ServerMetrics"]

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

FIGURES_TIMEOUT_S = 2.0
"""How long a scrape waits for the engine's figures: milliseconds when it answers, and well within Prometheus'
default scrape timeout (10 s), so that the scrape itself never fails for a silent engine."""

_TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _engine_families(figures: EngineFigures | None) -> list[Any]:
    """The engine's metric families for one scrape: ``prefixcache_engine_up``, then its figures when there are any."""
    families: list[Any] = [
        GaugeMetricFamily(
            "prefixcache_engine_up",
            "1 if this scrape read the engine's figures, 0 if the engine did not answer in time (they are left out)",
            float(figures is not None),
        )
    ]
    if figures is None:
        return families
    stats = figures.cache
    families += [
        GaugeMetricFamily("prefixcache_hit_rate", "Cache hit rate (hit tokens / query tokens)", stats.hit_rate),
        GaugeMetricFamily("prefixcache_pool_blocks", "KV blocks in the pool", stats.num_blocks),
        GaugeMetricFamily("prefixcache_pool_used_blocks", "KV blocks in use", stats.used_blocks),
        GaugeMetricFamily(
            "prefixcache_pool_occupancy", "Used blocks / pool blocks", stats.used_blocks / max(stats.num_blocks, 1)
        ),
        GaugeMetricFamily("prefixcache_cached_tokens", "Tokens held by the radix tree", stats.cached_tokens),
        CounterMetricFamily("prefixcache_evictions", "Eviction passes", stats.evictions),
        CounterMetricFamily("prefixcache_evicted_tokens", "Tokens evicted", stats.evicted_tokens),
        CounterMetricFamily(
            "prefixcache_preempted_requests",
            "Preemptions: a running request freed its blocks to resume later (recompute)",
            figures.preempted_requests,
        ),
        CounterMetricFamily(
            "prefixcache_cancelled_requests", "Requests cancelled before they finished", figures.cancelled_requests
        ),
        CounterMetricFamily(
            "prefixcache_spec_draft_tokens",
            "Speculative draft tokens verified (serve --speculate tree; greedy requests)",
            figures.drafted_tokens,
        ),
        CounterMetricFamily(
            "prefixcache_spec_accepted_tokens",
            "Speculative draft tokens accepted: generated tokens that took no forward of their own",
            figures.accepted_tokens,
        ),
    ]
    return families


class _Scrape:
    """What one scrape renders: the server's registry, then the engine's families (``generate_latest`` reads any
    object with ``collect``)."""

    def __init__(self, registry: CollectorRegistry, figures: EngineFigures | None) -> None:
        self.registry = registry
        self.figures = figures

    def collect(self):
        yield from self.registry.collect()
        yield from _engine_families(self.figures)


class ServerMetrics:
    """The metrics of one server over ``engine`` (a :class:`~prefixcache.engine.batching.BatchEngine` or an
    :class:`~prefixcache.engine.process.EngineProcess`): :meth:`observe` after each request, :meth:`scrape` on the
    event loop to answer ``GET /metrics``.  ``figures_timeout_s`` bounds a scrape's wait for the engine's figures
    (see the module docstring)."""

    def __init__(self, engine: Any, *, figures_timeout_s: float = FIGURES_TIMEOUT_S) -> None:
        self.engine = engine
        self.figures_timeout_s = figures_timeout_s
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
        self._served: dict[str, Any] = {}  # endpoint -> its "ok" child, since labels() takes a lock and a lookup
        self._reading: asyncio.Future[EngineFigures] | None = None  # the read of the figures under way, if any

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

    async def scrape(self) -> bytes:
        """The text of a scrape, within about ``figures_timeout_s`` seconds whatever the engine does.  On the event
        loop only."""
        return self.render(await self.read_figures())

    async def read_figures(self) -> EngineFigures | None:
        """The engine's figures, read on a worker thread (one read at a time, shared by the scrapes that wait for
        it), or None when they did not come within ``figures_timeout_s`` or the engine cannot answer."""
        reading = self._reading
        if reading is None or reading.done():
            reading = self._reading = asyncio.ensure_future(asyncio.to_thread(self.engine.figures))
            reading.add_done_callback(_retrieve)
        try:
            return await asyncio.wait_for(asyncio.shield(reading), self.figures_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("/metrics: the engine's figures did not come within %s s; left out", self.figures_timeout_s)
        except (EngineDeadError, InvalidArgumentError) as error:  # gone, not answering, or closed: said elsewhere
            logger.debug("/metrics: no engine figures: %s", error)
        return None

    def render(self, figures: EngineFigures | None = None) -> bytes:
        """The text of a scrape with ``figures`` (None: ``prefixcache_engine_up 0``, no engine figures).  O(metrics)."""
        return generate_latest(_Scrape(self.registry, figures))  # type: ignore[arg-type]


def _retrieve(reading: asyncio.Future[Any]) -> None:
    # A read that ends after every scrape waiting for it gave up: its error is taken here, not logged as unretrieved.
    if not reading.cancelled():
        reading.exception()
