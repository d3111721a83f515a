"""Specification of the runner's prefill/decode path with last-position logits and live K/V: greedy tokens equal the
uncached reference, prompt logits come only when asked, and what the request cached serves the next one exactly.
Drawn over block sizes 1..16, prompt lengths and cached prefixes, for the embedded model and a tiny HF Qwen2."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.models.llama import build_model
from prefixcache.testing import assert_quiescent, greedy_reference

TOL = 1e-4


def _hf_qwen2():
    pytest.importorskip("transformers")
    from prefixcache.models.hf_tiny import tiny_random_model

    return tiny_random_model("qwen2", max_positions=1024, seed=1)


@pytest.fixture(scope="module", params=["embedded", "hf-qwen2"])
def model(request):
    return build_model("tiny", device="cpu") if request.param == "embedded" else _hf_qwen2()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    block_size=st.integers(1, 16),
    prompt_len=st.integers(1, 40),
    cached_len=st.integers(0, 40),
    new_tokens=st.integers(1, 24),
    seed=st.integers(0, 10_000),
)
def test_greedy_decode_with_live_kv_equals_uncached_greedy(
    model, block_size: int, prompt_len: int, cached_len: int, new_tokens: int, seed: int
) -> None:
    runner = PrefixCachingRunner(model, block_size=block_size, cache_tokens=512)
    prompt = _ids(prompt_len, seed)
    cached_len = min(cached_len, prompt_len)
    if cached_len:
        runner.prefill(prompt[:cached_len])
    result = runner.generate(prompt, SamplingParams(max_new_tokens=new_tokens))
    expected, _ = greedy_reference(model, prompt, new_tokens)
    assert list(result.token_ids) == expected
    assert result.prompt_logits is None
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_prompt_logits_of_every_prefilled_position_only_when_asked(model, block_size: int) -> None:
    runner = PrefixCachingRunner(model, block_size=block_size, cache_tokens=512)
    prompt = _ids(45, seed=block_size)
    runner.prefill(prompt[:30])
    result = runner.generate(prompt, SamplingParams(max_new_tokens=3), return_logits=True)
    reference = model.forward_reference(torch.tensor(prompt), return_logits=True)
    assert result.usage.cached_tokens == 30
    assert result.prompt_logits.shape == (15, model.vocab_size)
    assert float((result.prompt_logits - reference[30:]).abs().max()) < TOL


@pytest.mark.parametrize("block_size", [3, 16])
def test_tokens_decoded_against_live_kv_are_cached_exactly_for_the_next_turn(model, block_size: int) -> None:
    runner = PrefixCachingRunner(model, block_size=block_size, cache_tokens=1024)
    prompt = _ids(20, seed=11)
    first = runner.generate(prompt, SamplingParams(max_new_tokens=70))  # crosses the live buffer's first doubling
    follow_up = prompt + list(first.token_ids) + _ids(6, seed=12)
    second = runner.generate(follow_up, SamplingParams(max_new_tokens=4), return_logits=True)
    assert second.usage.cached_tokens == len(prompt) + 70 - 1  # the last generated token was never prefilled
    reference = model.forward_reference(torch.tensor(follow_up), return_logits=True)
    assert float((second.prompt_logits - reference[second.usage.cached_tokens :]).abs().max()) < TOL
    assert list(second.token_ids) == greedy_reference(model, follow_up, 4)[0]


def test_forced_tokens_then_decode_are_exact(model) -> None:
    runner = PrefixCachingRunner(model, block_size=4, cache_tokens=512)
    prompt, answer = _ids(17, seed=21), _ids(9, seed=22)
    runner.generate(prompt, forced_tokens=answer)
    follow_up = prompt + answer + _ids(5, seed=23)
    result = runner.generate(follow_up, SamplingParams(max_new_tokens=6))
    assert result.usage.cached_tokens == len(prompt) + len(answer)
    assert list(result.token_ids) == greedy_reference(model, follow_up, 6)[0]
