"""Sampling inputs that once made a NaN distribution, and what a pick that raises does to a batch: the request fails
alone, its blocks and locks released, and the others finish as they would have."""

from __future__ import annotations

import math

import pytest
import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.logits import LogitsPipeline
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent

PROMPT = [1, 2, 3, 4, 5, 6, 7]


def _runner(tiny: LlamaModel) -> PrefixCachingRunner:
    return PrefixCachingRunner(tiny, cache_tokens=24, block_size=4)


def _both(tiny: LlamaModel, sampling: SamplingParams) -> list[tuple[int, ...]]:
    runner = _runner(tiny)
    serial = runner.generate(PROMPT, sampling).token_ids
    engine = BatchEngine(runner)
    handle = engine.submit(PROMPT, sampling)
    engine.run_until_idle()
    assert_quiescent(runner.cache)
    runner.cache.check_invariants()
    return [serial, handle.result().token_ids]


def test_infinite_temperature_is_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        SamplingParams(temperature=math.inf)


def test_a_tiny_top_p_keeps_the_most_probable_token(tiny: LlamaModel) -> None:
    serial, batched = _both(tiny, SamplingParams(max_new_tokens=3, temperature=1.0, top_p=5e-324, seed=1))
    greedy = _runner(tiny).generate(PROMPT, SamplingParams(max_new_tokens=3)).token_ids
    assert serial == batched == greedy


def test_a_penalty_that_overflows_a_logit_samples_among_the_overflowed(tiny: LlamaModel) -> None:
    serial, batched = _both(tiny, SamplingParams(max_new_tokens=3, temperature=1.0, repetition_penalty=1e-300, seed=2))
    assert serial == batched
    assert all(t in PROMPT or t in serial for t in serial)  # only seen tokens' logits overflowed to +inf


def test_a_pick_that_raises_fails_its_request_alone_in_a_batch(
    tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(tiny)
    expected = runner.generate([9, 8, 7], SamplingParams(max_new_tokens=2)).token_ids
    original = LogitsPipeline.pick

    def pick(self: LogitsPipeline, logits: torch.Tensor) -> int:
        if self.params.seed == 99:
            raise RuntimeError("pick failed")
        return original(self, logits)

    monkeypatch.setattr(LogitsPipeline, "pick", pick)
    engine = BatchEngine(runner)
    bad = engine.submit(PROMPT, SamplingParams(max_new_tokens=2, temperature=1.0, seed=99))
    good = engine.submit([9, 8, 7], SamplingParams(max_new_tokens=2))
    engine.run_until_idle()
    with pytest.raises(RuntimeError, match="pick failed"):
        bad.result()
    assert good.result().token_ids == expected
    assert_quiescent(runner.cache)
    runner.cache.check_invariants()
