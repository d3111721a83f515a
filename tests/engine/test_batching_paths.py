"""Continuous batching through the models' batched paths: the HF adapter's padded batches and the embedded model's
shared-prefix decode attention serve requests whose tokens equal their serial uncached greedy output."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.models.llama import LlamaModel
from prefixcache.models.shared_prefix import plan_shared_prefix_groups
from prefixcache.testing import assert_quiescent, greedy_reference


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def qwen2():
    pytest.importorskip("transformers")
    from prefixcache.models.hf_tiny import tiny_random_model

    return tiny_random_model("qwen2")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    num_requests=st.integers(2, 5),
    block_size=st.sampled_from([1, 4, 16]),
    max_batch_tokens=st.integers(4, 48),
)
def test_hf_padded_batches_give_each_request_its_serial_tokens(
    qwen2, data, num_requests: int, block_size: int, max_batch_tokens: int
) -> None:
    system = _ids(data.draw(st.integers(0, 24), label="system tokens"), seed=9)
    prompts = [system + _ids(data.draw(st.integers(1, 12), label="own"), seed=30 + i) for i in range(num_requests)]
    budgets = [data.draw(st.integers(1, 6), label="max_new_tokens") for _ in prompts]
    runner = PrefixCachingRunner(qwen2, block_size=block_size, cache_tokens=1024)
    if system and data.draw(st.booleans(), label="system cached first"):
        runner.prefill(system)
    engine = BatchEngine(runner, max_batch_tokens=max_batch_tokens)
    handles = [engine.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, budgets, strict=True)]
    engine.run_until_idle()
    for prompt, budget, handle in zip(prompts, budgets, handles, strict=True):
        assert list(handle.result().token_ids) == greedy_reference(qwen2, prompt, budget)[0]
    assert_quiescent(runner.cache)


def test_sessions_behind_a_cached_system_prompt_decode_through_shared_blocks(tiny: LlamaModel, monkeypatch) -> None:
    import prefixcache.models.llama as llama

    planned = []

    def spy(*args, **kwargs):
        groups = plan_shared_prefix_groups(*args, **kwargs)
        planned.extend((len(g.rows), g.shared_tokens) for g in groups)
        return groups

    monkeypatch.setattr(llama, "plan_shared_prefix_groups", spy)
    system = _ids(48, seed=3)
    prompts = [system + _ids(3 + 2 * i, seed=40 + i) for i in range(4)]
    runner = PrefixCachingRunner(tiny, block_size=8, cache_tokens=1024)
    runner.prefill(system)
    results = runner.generate_many(prompts, SamplingParams(max_new_tokens=12), max_batch_tokens=64)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.usage.cached_tokens == len(system)
        assert list(result.token_ids) == greedy_reference(tiny, prompt, 12)[0]
    assert_quiescent(runner.cache)
    assert (4, 48) in planned  # all four decoded in one step, reading the system prompt's blocks once
