"""The runner's retention: ``prefill(ids, priority=..., retain_s=...)`` and ``generate(..., priority=...)`` keep a
shared prefix through memory pressure."""

from __future__ import annotations

import pytest

from prefixcache import InvalidArgumentError, PrefixCachingRunner, SamplingParams


def ids(first: int, n: int) -> list[int]:
    return [first] + [(7 * i) % 200 + 20 for i in range(n - 1)]


def test_a_prefilled_prefix_with_priority_survives_a_flood_of_other_prompts(tiny) -> None:
    runner = PrefixCachingRunner(tiny, num_blocks=16, block_size=16)
    system = ids(1, 64)
    runner.prefill(system, priority=1)
    assert runner.cache.stats().retained_tokens == 64
    for k in range(2, 8):
        runner.generate(ids(k, 100), SamplingParams(max_new_tokens=2))
    usage = runner.generate(system + [5, 6], SamplingParams(max_new_tokens=1)).usage
    assert usage.cached_tokens == 64


def test_without_priority_the_same_flood_evicts_the_prefix(tiny) -> None:
    runner = PrefixCachingRunner(tiny, num_blocks=16, block_size=16)
    system = ids(1, 64)
    runner.prefill(system)
    for k in range(2, 8):
        runner.generate(ids(k, 100), SamplingParams(max_new_tokens=2))
    assert runner.generate(system + [5, 6], SamplingParams(max_new_tokens=1)).usage.cached_tokens < 64


def test_generate_with_priority_retains_the_prompt(tiny) -> None:
    runner = PrefixCachingRunner(tiny, num_blocks=16, block_size=16)
    runner.generate(ids(1, 40), SamplingParams(max_new_tokens=3), priority=2)
    assert runner.cache.stats().retained_tokens == 40


def test_retain_s_without_priority_is_refused(tiny) -> None:
    runner = PrefixCachingRunner(tiny, num_blocks=16, block_size=16)
    with pytest.raises(InvalidArgumentError):
        runner.prefill(ids(1, 10), retain_s=5.0)
    assert runner.cache.stats().query_tokens == 0


@pytest.mark.parametrize("retain_s", [float("nan"), -1.0, 0, "5", True])
def test_a_bad_retain_s_is_refused_before_any_work(tiny, retain_s) -> None:
    runner = PrefixCachingRunner(tiny, num_blocks=16, block_size=16)
    with pytest.raises(InvalidArgumentError, match="retain_s"):
        runner.prefill(ids(1, 10), priority=1, retain_s=retain_s)
    stats = runner.cache.stats()
    assert (stats.query_tokens, stats.cached_tokens, stats.retained_tokens) == (0, 0, 0)
    runner.cache.check_invariants()
