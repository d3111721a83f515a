"""Exactness with the host-memory tier: a prompt whose prefix was evicted to host memory and promoted back gives the
same logits and greedy tokens as a full recompute, and usage says which tier its cached tokens came from."""

from __future__ import annotations

import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.models import LlamaModel

TOL = 1e-4


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(model: LlamaModel, prompt: list[int]) -> torch.Tensor:
    return model.forward_reference(torch.tensor(prompt, dtype=torch.long), return_logits=True).float().cpu()


def test_promoted_prefix_gives_the_uncached_logits_and_tokens(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=48, block_size=4, host_cache_tokens=192)
    document = ids(30, seed=1)
    other = ids(48, seed=2)
    runner.generate(document, SamplingParams(max_new_tokens=0))
    runner.generate(other, SamplingParams(max_new_tokens=0))  # fills the device pool: the document goes to host
    assert runner.cache.stats().demoted_blocks == 7  # its partial last block is dropped
    prompt = document + ids(6, seed=3)
    result = runner.generate(prompt, SamplingParams(max_new_tokens=5), return_logits=True)
    usage = result.usage
    assert usage.cached_tokens == 28 and usage.host_cached_tokens == 28  # the document's 7 full blocks
    assert usage.to_openai()["host_cached_tokens"] == 28
    reference = reference_logits(tiny, prompt)[28:]
    assert (result.prompt_logits - reference).abs().max().item() < TOL
    plain = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=4)
    assert result.token_ids == plain.generate(prompt, SamplingParams(max_new_tokens=5)).token_ids
    stats = runner.cache.stats()
    assert stats.host_hit_tokens == 28 and stats.promoted_blocks == 7
    runner.cache.check_invariants()


def test_partly_on_device_partly_on_host_is_exact(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=64, block_size=4, host_cache_tokens=256)
    document = ids(40, seed=4)
    runner.generate(document, SamplingParams(max_new_tokens=0))
    runner.cache.evict(4)  # the document's last 4 blocks go to host, its first 6 stay
    prompt = document + ids(3, seed=5)
    result = runner.generate(prompt, SamplingParams(max_new_tokens=0), return_logits=True)
    assert (result.usage.cached_tokens, result.usage.host_cached_tokens) == (40, 16)
    assert (result.prompt_logits - reference_logits(tiny, prompt)[40:]).abs().max().item() < TOL
