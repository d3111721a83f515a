"""Small cases with their exact expected values, each one a behaviour that once broke or easily could."""

from __future__ import annotations

import pytest
import torch

from prefixcache import InsertResult, KVBlockPool, PrefixCachingRunner, RadixCache, SamplingParams
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent

ATOL = 1e-4


def reference_logits(model: LlamaModel, prompt: list[int]) -> torch.Tensor:
    return model.forward_reference(torch.tensor(prompt, dtype=torch.long), return_logits=True).float()


def tree_block_count(cache: RadixCache) -> int:
    held: set[int] = set()
    for root in cache._tree.roots.values():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            held.update(node.blocks.tolist())
            stack.extend(node.children.values())
    return len(held)


def test_a_sequence_inserted_twice_adds_nothing_the_second_time_and_frees_its_duplicates() -> None:
    cache = RadixCache(KVBlockPool(16, 4))
    sequence = list(range(1, 11))  # 10 tokens: 3 blocks of 4

    first = cache.insert(sequence, cache.allocate(3))
    second = cache.insert(sequence, cache.allocate(3))

    assert first == InsertResult(num_new_tokens=10, num_cached_tokens=0, num_released_blocks=0)
    assert second == InsertResult(num_new_tokens=0, num_cached_tokens=10, num_released_blocks=3)
    assert cache.pool.num_free_blocks == 13
    assert cache.cached_sequences() == [sequence]
    assert cache.stats().cached_tokens == 10 and cache.stats().num_nodes == 1
    assert_quiescent(cache)


def test_a_prompt_served_twice_caches_nothing_new_and_frees_its_copy_on_write_block(model) -> None:
    runner = PrefixCachingRunner(model, num_blocks=16, block_size=4)
    prompt = list(range(1, 11))
    runner.prefill(prompt)
    free = runner.pool.num_free_blocks

    again = runner.generate(prompt, SamplingParams(max_new_tokens=0))

    assert again.usage.cached_tokens == 9 and again.usage.copied_tokens == 1
    assert again.insert == InsertResult(num_new_tokens=0, num_cached_tokens=10, num_released_blocks=1)
    assert runner.pool.num_free_blocks == free
    assert_quiescent(runner.cache)


def test_a_fully_cached_prompt_still_prefills_its_last_token_with_exact_logits(model) -> None:
    runner = PrefixCachingRunner(model, num_blocks=16, block_size=4)
    prompt = list(range(1, 13))
    runner.prefill(prompt)

    result = runner.generate(prompt, SamplingParams(max_new_tokens=1), return_logits=True)

    assert result.usage.cached_tokens == 11 and result.usage.copied_tokens == 3
    assert result.usage.prefilled_tokens == 1
    assert result.prompt_logits.shape == (1, model.vocab_size)
    expected = reference_logits(model, prompt)[-1:]
    assert torch.allclose(result.prompt_logits, expected, atol=ATOL, rtol=0)
    assert result.token_ids == (int(expected[0].argmax()),)


def test_a_prompt_matching_two_tokens_then_differing_reuses_exactly_two(model) -> None:
    runner = PrefixCachingRunner(model, num_blocks=16, block_size=4)
    runner.prefill([1, 2, 3, 4, 5, 6])
    prompt = [1, 2, 9, 10, 11]

    assert runner.cache.match(prompt, runner.namespace_key(None)).num_tokens == 2
    result = runner.generate(prompt, SamplingParams(max_new_tokens=0), return_logits=True)

    assert result.usage.cached_tokens == 2  # never 3, and never rounded down to 0 blocks
    assert result.usage.copied_tokens == 2
    assert result.usage.prefilled_tokens == 3
    assert torch.allclose(result.prompt_logits, reference_logits(model, prompt)[2:], atol=ATOL, rtol=0)
    assert sorted(runner.cache.cached_sequences(runner.namespace_key(None))) == [[1, 2, 3, 4, 5, 6], prompt]


def test_after_a_hundred_finished_requests_nothing_is_locked_and_evicting_all_frees_all(model) -> None:
    runner = PrefixCachingRunner(model, num_blocks=48, block_size=4)
    for i in range(100):
        prompt = [1, 2, 3, 4, 5] + [10 + i % 7, 100 + i, 200 + i % 3]
        runner.generate(prompt, SamplingParams(max_new_tokens=1 + i % 4), namespace=("a", "b", None)[i % 3])

    stats = runner.cache.stats()
    assert stats.locked_tokens == 0
    assert int(runner.cache._blocks.owned.sum()) == 0
    assert tree_block_count(runner.cache) + stats.free_blocks == runner.pool.num_blocks
    assert stats.evictions > 0
    assert_quiescent(runner.cache)

    freed = runner.cache.evict_all()

    assert freed.num_blocks == stats.used_blocks
    assert runner.pool.num_free_blocks == runner.pool.num_blocks
    assert runner.cache.stats().cached_tokens == 0 and runner.cache.stats().num_nodes == 0
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("way", ["runner", "engine"])
def test_a_request_of_exactly_the_pool_fits_when_nothing_else_runs(way: str) -> None:
    # README, Limits: "A pool sized exactly to its longest request is always enough when nothing else runs."
    # Found by a random history (newcomer stress test): a branch after 205 tokens, another after 513 + a tail, then
    # the 1,000-token prompt that extends the second branch's shared part (its match ends 1 token into block 32).
    # The second branch left a seam at 205 (its own copy of block 12 beside the first branch's, which shares the
    # parent's copy), so the lock pinned both copies until eviction took the first branch and the seam healed.
    from prefixcache.engine.batching import BatchEngine
    from prefixcache.models import build_model

    base = [1 + (i * 37) % 199 for i in range(1000)]
    runner = PrefixCachingRunner(build_model("tiny"), cache_tokens=1024, block_size=16)
    runner.generate(base[:205], SamplingParams(max_new_tokens=8))
    runner.generate(base[:513] + [200 + i % 50 for i in range(25)], SamplingParams(max_new_tokens=7))
    sampling = SamplingParams(max_new_tokens=24)  # 1,000 + 24 = the pool's 1,024 tokens
    if way == "runner":
        runner.generate(base, sampling)
    else:
        engine = BatchEngine(runner)
        handle = engine.submit(base, sampling)
        engine.run_until_idle()
        handle.result()
    assert_quiescent(runner.cache)
