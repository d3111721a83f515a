"""Specification of the penalties, filters and stop options through the engine: a penalized greedy request equals a
recompute that applies the definitions by hand, a request's tokens are the same alone (``runner.generate``) and
batched beside others (``BatchEngine``), seeded sampling included, and through preemption, since the pipeline and
its token history outlive it."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent, greedy_reference

BLOCK = 4
PENALIZED = SamplingParams(
    max_new_tokens=12, repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.4, logit_bias={65: 2.5}
)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(tiny: LlamaModel, prompt: list[int], sampling: SamplingParams) -> tuple[int, ...]:
    """The request run by itself on a pool with room to spare: the reference."""
    return PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK).generate(prompt, sampling).token_ids


def penalized_greedy_reference(tiny: LlamaModel, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding with no cache (``forward_reference`` over the whole sequence at each step) and the penalties
    applied by their definitions, a token at a time."""
    generated: list[int] = []
    while len(generated) < p.max_new_tokens:
        sequence = torch.tensor(prompt + generated, dtype=torch.long)
        row = tiny.forward_reference(sequence, return_logits=True)[-1].double().tolist()
        for token, bias in p.logit_bias:
            row[token] += bias
        for token in set(prompt) | set(generated):
            row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
        for token, count in Counter(generated).items():
            row[token] -= p.frequency_penalty * count + p.presence_penalty
        if len(generated) < p.min_tokens:
            for token in p.stop_token_ids:
                row[token] = -math.inf
        token = max(range(len(row)), key=row.__getitem__)
        generated.append(token)
        if token in p.stop_token_ids and len(generated) > p.min_tokens:
            break
    return generated


def test_penalized_greedy_generation_equals_a_recompute_by_the_definitions(tiny: LlamaModel) -> None:
    prompt = _ids(20, seed=3) * 2  # a repeated prompt: the repetition penalty has tokens to act on
    expected = penalized_greedy_reference(tiny, prompt, PENALIZED)
    assert list(alone(tiny, prompt, PENALIZED)) == expected
    assert expected != greedy_reference(tiny, prompt, 12)[0]  # the penalties changed the answer


def test_min_tokens_defers_a_stop_token_and_ignore_eos_runs_to_the_budget(tiny: LlamaModel) -> None:
    prompt = _ids(15, seed=8)
    stop = greedy_reference(tiny, prompt, 1)[0][0]
    stops = frozenset({stop})
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    first = runner.generate(prompt, SamplingParams(max_new_tokens=8, stop_token_ids=stops))
    assert (first.token_ids, first.finish_reason) == ((stop,), "stop")
    deferred_params = SamplingParams(max_new_tokens=8, stop_token_ids=stops, min_tokens=3)
    deferred = runner.generate(prompt, deferred_params)
    assert stop not in deferred.token_ids[:3]
    assert list(deferred.token_ids) == penalized_greedy_reference(tiny, prompt, deferred_params)
    ignoring = runner.generate(prompt, SamplingParams(max_new_tokens=8, stop_token_ids=stops, ignore_eos=True))
    assert ignoring.finish_reason == "length"
    assert list(ignoring.token_ids) == greedy_reference(tiny, prompt, 8)[0]
    assert_quiescent(runner.cache)


MIXED = [
    PENALIZED,
    SamplingParams(max_new_tokens=9, repetition_penalty=0.8, logit_bias={7: -100, 100: 40}),
    SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, min_p=0.05, frequency_penalty=1.0, seed=5),
    SamplingParams(max_new_tokens=8, temperature=1.2, top_p=0.8, top_k=-1, presence_penalty=-1.0, seed=6),
    SamplingParams(max_new_tokens=6),
    SamplingParams(max_new_tokens=11, temperature=0.7, min_p=0.2, repetition_penalty=1.5, seed=2**62),
]


@pytest.mark.parametrize("max_batch_tokens", [512, 16])
def test_every_request_batched_equals_the_request_alone(tiny: LlamaModel, max_batch_tokens: int) -> None:
    system = _ids(30, seed=1)
    prompts = [system + _ids(5 + i, seed=20 + i) for i in range(len(MIXED))]
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    engine = BatchEngine(runner, max_batch_tokens=max_batch_tokens)
    handles = [engine.submit(prompt, params) for prompt, params in zip(prompts, MIXED, strict=True)]
    engine.run_until_idle()
    for prompt, params, handle in zip(prompts, MIXED, handles, strict=True):
        assert handle.result().token_ids == alone(tiny, prompt, params)
    assert_quiescent(runner.cache)


def test_a_seeded_request_repeats_its_tokens_beside_unseeded_ones(tiny: LlamaModel) -> None:
    prompt = _ids(25, seed=4)
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, min_p=0.02, presence_penalty=0.5, seed=9)
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    engine = BatchEngine(runner)
    noise = SamplingParams(max_new_tokens=12, temperature=1.0)  # draws from the global generator
    others = [engine.submit(_ids(10 + i, seed=50 + i), noise) for i in range(3)]
    handle = engine.submit(prompt, seeded)
    engine.run_until_idle()
    assert handle.result().token_ids == alone(tiny, prompt, seeded) == runner.generate(prompt, seeded).token_ids
    assert all(len(h.result().token_ids) == 12 for h in others)


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_preempted_penalized_requests_finish_with_their_serial_output(tiny: LlamaModel, policy: str) -> None:
    # Three requests of 7 prompt + 10 new tokens on 6 blocks of 4: the first decode block needs a preemption.
    runner = PrefixCachingRunner(tiny, cache_tokens=6 * BLOCK, block_size=BLOCK)
    engine = BatchEngine(runner, policy=policy)
    prompts = [_ids(7, seed=10 + i) for i in range(3)]
    samplings = [
        SamplingParams(max_new_tokens=10, repetition_penalty=1.4, frequency_penalty=0.7, logit_bias={3: 1.0}),
        SamplingParams(max_new_tokens=10, presence_penalty=1.5, min_tokens=4, stop_token_ids=frozenset({1})),
        SamplingParams(max_new_tokens=10, temperature=0.9, top_k=30, frequency_penalty=2.0, seed=3),
    ]
    handles = [engine.submit(p, s) for p, s in zip(prompts, samplings, strict=True)]
    engine.run_until_idle()
    for prompt, sampling, handle in zip(prompts, samplings, handles, strict=True):
        result = handle.result()
        assert result.token_ids == alone(tiny, prompt, sampling)
        assert list(handle) == list(result.token_ids)  # nothing emitted twice
    assert engine.preempted_requests > 0
    assert_quiescent(runner.cache)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_requests=st.integers(2, 4),
)
def test_drawn_penalties_batched_equal_serial_greedy(tiny: LlamaModel, data, num_requests: int) -> None:
    shared = _ids(data.draw(st.integers(0, 20), label="shared prefix"), seed=99)
    runner = PrefixCachingRunner(tiny, cache_tokens=2048, block_size=BLOCK)
    engine = BatchEngine(runner, max_batch_tokens=data.draw(st.sampled_from([8, 64, 512])))
    requests = []
    for index in range(num_requests):
        prompt = shared + _ids(data.draw(st.integers(1, 12), label="own"), seed=index)
        params = SamplingParams(
            max_new_tokens=6,
            repetition_penalty=data.draw(st.sampled_from([1.0, 1.2, 2.0, 0.7])),
            frequency_penalty=data.draw(st.sampled_from([0.0, 0.5, -0.5, 2.0])),
            presence_penalty=data.draw(st.sampled_from([0.0, 1.0, -1.0])),
            logit_bias=data.draw(st.dictionaries(st.integers(0, 258), st.sampled_from([-100, -3.0, 4.0]), max_size=3)),
        )
        requests.append((prompt, params, engine.submit(prompt, params)))
    engine.run_until_idle()
    for prompt, params, handle in requests:
        assert handle.result().token_ids == alone(tiny, prompt, params)
    assert_quiescent(runner.cache)
