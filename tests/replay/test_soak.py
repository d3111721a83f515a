"""Soak: every built-in scenario replayed with the tiny model through a cache small enough to keep evicting.

Memory stays bounded (pool blocks, tree nodes, traced Python allocations), the cache is quiescent after every
request, and the hits equal the cache-only (``--no-model``) accounting at the same size, since no cache decision
depends on the model.  The longer run over the shared data files is done by hand with the command line."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from prefixcache import RadixCache
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.models.llama import build_model
from prefixcache.replay.replayer import Replayer, ReplayRequest, ScenarioReport, load_requests
from prefixcache.testing import assert_quiescent

SCENARIOS = sorted((Path(__file__).parents[2] / "scenarios").glob("*.jsonl"))
# The smallest round size that holds the longest request of every scenario (long_document_qa: 9,541 tokens);
# the other scenarios send 26k-112k tokens each, so most of them evict throughout.
CACHE_TOKENS = 10240
BLOCK_SIZE = 16
# A generous ceiling, far above what a run takes (about 2 MiB traced, a few dozen nodes) and far below what a leak
# of one node or lease per request over the run would reach.
MAX_TRACED_BYTES = 64 * 2**20


@dataclass
class Watch:
    """What the soak observes after every request of one scenario."""

    cache: RadixCache | None = None
    requests: int = 0
    peak_nodes: int = 0
    peak_used_blocks: int = 0
    evictions: list[int] = field(default_factory=list)


@pytest.fixture(scope="module")
def scenario_requests() -> dict[str, list[ReplayRequest]]:
    tokenizer = ByteTokenizer()
    return {path.stem: load_requests(path, tokenizer)[0] for path in SCENARIOS}


def watched_replay(replayer: Replayer, name: str, requests: list[ReplayRequest]) -> tuple[ScenarioReport, Watch]:
    watch = Watch()
    make_cache = replayer._make_cache

    def capture(*args, **kwargs):
        runner, cache = make_cache(*args, **kwargs)
        watch.cache = cache
        return runner, cache

    def after_each(items: Iterable[ReplayRequest]) -> Iterator[ReplayRequest]:
        for item in items:
            yield item
            # The replay loop asks for the next request only once this one is finished.
            assert_quiescent(watch.cache)
            stats = watch.cache.stats()
            watch.requests += 1
            watch.peak_nodes = max(watch.peak_nodes, stats.num_nodes)
            watch.peak_used_blocks = max(watch.peak_used_blocks, stats.used_blocks)
            assert stats.cached_tokens <= watch.cache.pool.capacity_tokens
            assert stats.num_nodes <= stats.cached_tokens

    replayer._make_cache = capture
    report = replayer.replay(name, requests, progress=after_each)
    assert watch.requests == len(requests)
    assert_quiescent(watch.cache)
    watch.cache.evict_all()
    assert watch.cache.pool.num_free_blocks == watch.cache.pool.num_blocks
    return report, watch


def test_replaying_every_scenario_under_constant_eviction_stays_bounded_and_matches_the_cache_only_count(
    scenario_requests,
) -> None:
    model = build_model("tiny", device="cpu")
    tokenizer = ByteTokenizer()
    # Whole-prompt forwards, as the cache-only replay allocates: a chunked prefill evicts the same tokens, but may
    # take a leaf in two parts, which `evictions` counts twice.
    with_model = Replayer(
        model,
        tokenizer,
        block_size=BLOCK_SIZE,
        cache_tokens=CACHE_TOKENS,
        measure_uncached=False,
        prefill_chunk_tokens=None,
    )
    cache_only = Replayer(None, tokenizer, block_size=BLOCK_SIZE, cache_tokens=CACHE_TOKENS)
    rows = []
    began = time.perf_counter()
    tracemalloc.start()
    try:
        for name, requests in scenario_requests.items():
            counted, _ = watched_replay(cache_only, name, requests)
            served, watch = watched_replay(with_model, name, requests)
            rows.append((name, served, watch))
            assert (served.cached_tokens, served.copied_tokens) == (counted.cached_tokens, counted.copied_tokens)
            assert (served.evictions, served.evicted_tokens) == (counted.evictions, counted.evicted_tokens)
            assert served.requests == len(requests)
            assert served.prompt_tokens == sum(len(r.prompt) for r in requests)
            assert served.cached_tokens + served.prefilled_tokens == served.prompt_tokens
            assert served.cached_tokens <= served.ideal_cached_tokens
        _, traced_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    elapsed = time.perf_counter() - began

    assert traced_peak < MAX_TRACED_BYTES
    assert sum(report.evictions > 0 for _, report, _ in rows) >= 5
    assert sum(report.cached_tokens for _, report, _ in rows) > 0
    print(f"\nsoak: {elapsed:.1f} s, tracemalloc peak {traced_peak / 2**20:.1f} MiB, pool of {CACHE_TOKENS} tokens")
    for name, report, watch in rows:
        print(
            f"  {name}: {report.requests} requests, {report.prompt_tokens} prompt tokens, {report.cached_tokens} "
            f"cached, {report.evictions} evictions, peak {watch.peak_nodes} nodes / {watch.peak_used_blocks} blocks"
        )


def test_a_pool_half_again_as_large_as_the_longest_request_replays_without_running_out(scenario_requests) -> None:
    requests = scenario_requests["timestamp_system_prompt"]
    longest = max(len(r.prompt) + len(r.answer) for r in requests)  # 4,547 tokens

    report = Replayer(None, cache_tokens=longest * 3 // 2).replay("timestamp_system_prompt", requests)

    prompt_tokens = sum(len(r.prompt) for r in requests)
    assert (report.requests, report.prompt_tokens) == (len(requests), prompt_tokens)
    assert report.cached_tokens + report.prefilled_tokens == prompt_tokens
    assert 0 < report.cached_tokens < report.ideal_cached_tokens  # it had to evict what an unbounded cache keeps
    assert report.evictions > 0
    assert report.peak_blocks_used <= report.num_blocks == -(-(longest * 3 // 2) // 16)
