"""Cache statistics (hits, self-hits, the recent window) and per-request usage (cached tokens, TTFT)."""

from __future__ import annotations

import json
from array import array

import pytest

from prefixcache import CacheStats, KVBlockPool, PrefixCachingRunner, RadixCache, SamplingParams
from prefixcache.errors import InvalidArgumentError
from prefixcache.replay.replayer import Replayer, ReplayRequest

TEN = list(range(1, 11))


def _request(cache: RadixCache, tokens: list[int], request_id: str | None, *, commit: bool = True) -> int:
    lease = cache.acquire(tokens, request_id=request_id)
    if commit:
        cache.reserve(lease, len(tokens))
        cache.commit(lease, tokens)
    else:
        cache.release(lease)
    return lease.num_cached_tokens


def test_stats_split_cross_request_hits_from_a_request_reusing_its_own_tokens() -> None:
    cache = RadixCache(KVBlockPool(16, 4), hit_rate_window=2)
    assert _request(cache, TEN, "a") == 0  # cold: 10 queried
    assert _request(cache, TEN, "a", commit=False) == 9  # a retry of "a": 9 self-hits, not hits
    assert _request(cache, [1, 2, 3, 4, 5, 6, 20, 21], "b") == 6  # 6 hits on what "a" cached
    # "b" again, longer: 6 tokens on the node split off "a"'s sequence, 2 on "b"'s own leaf.
    assert _request(cache, [1, 2, 3, 4, 5, 6, 20, 21, 22], "b", commit=False) == 8

    assert cache.stats() == CacheStats(
        num_blocks=16,
        block_size=4,
        free_blocks=12,
        used_blocks=4,  # "a"'s 3 blocks and "b"'s copy of block 1 (tokens 5, 6, 20, 21)
        cached_tokens=12,
        evictable_tokens=12,
        locked_tokens=0,
        # [0,4) [4,6) [6,8) [8,10) and b's [6,8): admission splits at block boundaries inside an edge that runs
        # past the match (the retry at 8, "b" at 4), insert splits where "b" diverges (6).
        num_nodes=5,
        query_tokens=10 + 10 + 8 + 9,
        hit_tokens=6 + 6,
        evictions=0,
        evicted_tokens=0,
        evicted_blocks=0,
        self_hit_tokens=9 + 2,
        window_requests=2,
        window_query_tokens=8 + 9,
        window_hit_tokens=6 + 6,
        evictable_blocks=4,
    )
    assert cache.stats().hit_rate == pytest.approx(12 / 37)
    assert cache.stats().window_hit_rate == pytest.approx(12 / 17)


def test_without_request_ids_every_reused_token_is_a_hit() -> None:
    cache = RadixCache(KVBlockPool(16, 4))
    _request(cache, TEN, "a")
    _request(cache, TEN, None, commit=False)
    cache.match(TEN)
    stats = cache.stats()
    assert (stats.query_tokens, stats.hit_tokens, stats.self_hit_tokens) == (30, 9 + 10, 0)


def test_match_with_a_request_id_counts_that_requests_tokens_as_self_hits() -> None:
    cache = RadixCache(KVBlockPool(16, 4))
    _request(cache, TEN, "a")
    cache.match(TEN + [99], request_id="a")
    cache.match(TEN + [99], request_id="z")
    stats = cache.stats()
    assert (stats.hit_tokens, stats.self_hit_tokens) == (10, 10)
    assert stats.window_requests == 1  # match() is a lookup, not a request


def test_the_window_keeps_only_the_last_n_requests() -> None:
    cache = RadixCache(KVBlockPool(32, 4), hit_rate_window=3)
    for i in range(5):
        _request(cache, [7, 7, 7, 7, i + 10], f"r{i}")  # the first request misses, later ones hit 4 of 5
    stats = cache.stats()
    assert (stats.window_requests, stats.window_query_tokens, stats.window_hit_tokens) == (3, 15, 12)
    assert (stats.query_tokens, stats.hit_tokens) == (25, 16)


@pytest.mark.parametrize(
    ("granularity", "evicted", "after"),
    [
        ("block", (1, 2, 1), (4, 0, 15, 2)),  # one block cut off "a"'s tail: tokens 8 and 9
        ("leaf", (1, 10, 3), (2, 2, 7, 1)),  # "a"'s whole leaf
    ],
)
def test_evictions_count_removed_nodes_tokens_and_blocks(granularity, evicted, after) -> None:
    cache = RadixCache(KVBlockPool(4, 4), eviction_granularity=granularity)
    _request(cache, TEN, "a")  # 3 blocks
    _request(cache, [50, 51, 52, 53, 54, 55, 56], "b")  # needs 2 blocks, 1 is free
    stats = cache.stats()
    assert (stats.evictions, stats.evicted_tokens, stats.evicted_blocks) == evicted
    assert (stats.used_blocks, stats.free_blocks, stats.cached_tokens, stats.num_nodes) == after


@pytest.mark.parametrize("window", [0, -1, 2.5, True])
def test_the_window_must_be_a_positive_int(window) -> None:
    with pytest.raises(InvalidArgumentError):
        RadixCache(KVBlockPool(4, 4), hit_rate_window=window)


def test_usage_reports_cached_tokens_and_a_measured_ttft(tiny) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=256, block_size=4)
    first = runner.generate(list(range(1, 21)), SamplingParams(max_new_tokens=2)).usage
    second = runner.generate(list(range(1, 25)), SamplingParams(max_new_tokens=2)).usage
    assert (first.cached_tokens, second.cached_tokens, second.prefilled_tokens) == (0, 20, 4)
    assert second.ttft_s > 0
    usage = second.to_openai()
    assert usage["prompt_tokens_details"] == {"cached_tokens": 20}
    assert usage["ttft_s"] == second.ttft_s


def test_the_requests_log_carries_openai_usage_and_ttft(tiny) -> None:
    prompt = array("I", range(1, 30))
    requests = [
        ReplayRequest("s", "c", 1, prompt, array("I", [5, 6])),
        ReplayRequest("s", "c", 3, prompt + array("I", [5, 6, 7, 8]), array("I", [9])),
    ]
    log: list[dict] = []
    Replayer(tiny, block_size=4, measure_uncached=False).replay("s", requests, log=log)
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in log] == [0, 31]
    assert all(r["usage"]["ttft_s"] > 0 for r in log)
    json.dumps(log)

    cache_only: list[dict] = []
    Replayer(None, block_size=4).replay("s", requests, log=cache_only)
    assert [r["usage"]["ttft_s"] for r in cache_only] == [None, None]


def test_replay_logs_each_scenario_and_the_cache_logs_evictions_at_debug(caplog) -> None:
    requests = [_replay_request([1, 2, 3, 4, 5, 6, 7, 8]), _replay_request([9, 9, 9, 9, 9, 9, 9, 9])]
    with caplog.at_level("DEBUG", logger="prefixcache"):
        Replayer(None, block_size=4, cache_tokens=12).replay("s.jsonl", requests)
    messages = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert (
        "prefixcache.replay.replayer",
        "INFO",
        "s.jsonl: replaying 2 requests, pool of 3 blocks of 4 tokens",
    ) in messages
    assert ("prefixcache.cache.tree", "DEBUG", "evicted 0 nodes: 4 tokens, 1 blocks freed (1 asked)") in messages
    assert (
        "prefixcache.replay.replayer",
        "INFO",
        "s.jsonl: 2 requests, hit rate 0.0% (ideal 0.0%), 1 evictions",
    ) in messages


def _replay_request(prompt: list[int]) -> ReplayRequest:
    return ReplayRequest("s.jsonl", "c", 1, array("I", prompt), array("I"))
