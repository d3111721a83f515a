"""Specification of ``SamplingParams.logprobs``: every sampled token's record holds the log-softmax of the model's own
logits at its position (a full recompute with ``forward_reference``, before penalties and temperature) and the k most
probable ids of that distribution; a request's records are the same alone and batched beside others, and through a
preemption, which records no token twice; forced and prefill-only requests have none; nothing is computed for a
request that does not ask; a bad value is refused at submit and leaves the cache as it was."""

from __future__ import annotations

import pytest
import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.logits import LogitsPipeline
from prefixcache.engine.results import GenerationResult, TokenLogprob
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent

BLOCK = 4
TOLERANCE = 1e-5


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logprobs(model: LlamaModel, prompt: list[int], generated: tuple[int, ...], width: int | None = None):
    """``[len(generated), width]`` float64: log_softmax of the logits a full causal recompute of prompt + generated
    gives at the position before each generated token, over ids below ``width`` (all when None)."""
    ids = torch.tensor(prompt + list(generated), dtype=torch.long)
    logits = model.forward_reference(ids, return_logits=True, logits_from=len(prompt) - 1)[: len(generated)]
    return torch.log_softmax(logits[:, :width].double(), dim=-1)


def assert_matches_reference(
    model: LlamaModel, prompt: list[int], result: GenerationResult, k: int, width: int | None = None
) -> None:
    reference = reference_logprobs(model, prompt, result.token_ids, width)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for row, token, record in zip(reference, result.token_ids, result.logprobs, strict=True):
        assert record.token_id == token
        assert abs(record.logprob - float(row[token])) <= TOLERANCE
        top = torch.topk(row, k)
        assert [i for i, _ in record.top] == top.indices.tolist()
        for (_, value), expected in zip(record.top, top.values.tolist(), strict=True):
            assert abs(value - expected) <= TOLERANCE


def assert_same_records(a: tuple[TokenLogprob, ...], b: tuple[TokenLogprob, ...]) -> None:
    assert [r.token_id for r in a] == [r.token_id for r in b]
    for x, y in zip(a, b, strict=True):
        assert abs(x.logprob - y.logprob) <= TOLERANCE
        assert [i for i, _ in x.top] == [i for i, _ in y.top]
        assert all(abs(u - v) <= TOLERANCE for (_, u), (_, v) in zip(x.top, y.top, strict=True))


def crowded(model: LlamaModel) -> tuple[PrefixCachingRunner, BatchEngine, list[list[int]]]:
    """Three requests of 7 prompt + 10 new tokens (5 blocks each) on a pool of 6 blocks, as in test_preemption.py:
    all three are admitted, and the first decode block one of them needs is had only by preempting another."""
    runner = PrefixCachingRunner(model, cache_tokens=6 * BLOCK, block_size=BLOCK)
    return runner, BatchEngine(runner), [_ids(7, seed=10 + i) for i in range(3)]


def alone(model: LlamaModel, prompt: list[int], sampling: SamplingParams) -> GenerationResult:
    return PrefixCachingRunner(model, cache_tokens=4096, block_size=BLOCK).generate(prompt, sampling)


def test_a_greedy_requests_records_are_the_reference_log_softmax_and_its_top_k(tiny: LlamaModel) -> None:
    prompt = _ids(21, seed=1)
    result = alone(tiny, prompt, SamplingParams(max_new_tokens=9, logprobs=5))
    assert_matches_reference(tiny, prompt, result, 5)
    assert all(record.top[0][0] == record.token_id for record in result.logprobs)  # greedy picks the top id


def test_the_records_are_of_the_raw_logits_not_of_the_penalized_and_tempered_distribution(tiny: LlamaModel) -> None:
    prompt = _ids(16, seed=2) * 2
    sampling = SamplingParams(
        max_new_tokens=8,
        temperature=0.7,
        seed=5,
        top_k=20,
        repetition_penalty=1.4,
        frequency_penalty=0.8,
        logit_bias={65: 5.0},
        logprobs=4,
    )
    result = alone(tiny, prompt, sampling)
    assert_matches_reference(tiny, prompt, result, 4)
    assert result.token_ids == alone(tiny, prompt, SamplingParams(**{**_fields(sampling), "logprobs": None})).token_ids


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_zero_alternatives_records_the_sampled_token_alone(tiny: LlamaModel) -> None:
    prompt = _ids(9, seed=3)
    result = alone(tiny, prompt, SamplingParams(max_new_tokens=5, logprobs=0))
    assert_matches_reference(tiny, prompt, result, 0)
    assert all(record.top == () for record in result.logprobs)


def test_the_vocab_limit_bounds_the_distribution_and_the_alternatives(tiny: LlamaModel) -> None:
    prompt = _ids(12, seed=4)
    result = alone(tiny, prompt, SamplingParams(max_new_tokens=6, vocab_limit=259, logprobs=20))
    assert tiny.vocab_size > 259
    assert_matches_reference(tiny, prompt, result, 20, width=259)
    assert all(i < 259 for record in result.logprobs for i, _ in record.top)


def test_a_request_that_does_not_ask_computes_nothing_and_gets_none(tiny: LlamaModel, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("logprobs computed for a request that did not ask")

    monkeypatch.setattr(LogitsPipeline, "logprobs", refuse)
    result = alone(tiny, _ids(8, seed=5), SamplingParams(max_new_tokens=4))
    assert result.logprobs is None and len(result.token_ids) == 4


def test_forced_and_prefill_only_requests_record_nothing(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    asks = SamplingParams(max_new_tokens=3, logprobs=2)
    forced = runner.generate(_ids(10, seed=6), asks, forced_tokens=[5, 6, 7])
    assert forced.finish_reason == "forced" and forced.logprobs == ()
    prefill = runner.generate(_ids(10, seed=7), SamplingParams(max_new_tokens=0, logprobs=2))
    assert prefill.finish_reason == "prefill" and prefill.logprobs == ()
    assert_quiescent(runner.cache)


def test_batched_requests_record_what_they_record_alone(tiny: LlamaModel) -> None:
    system = _ids(19, seed=8)
    prompts = [system + _ids(3 + i, seed=20 + i) for i in range(4)] + [_ids(30, seed=30)]
    samplings = [
        SamplingParams(max_new_tokens=7, logprobs=3),
        SamplingParams(max_new_tokens=7, temperature=0.9, seed=11, logprobs=5),
        SamplingParams(max_new_tokens=7, presence_penalty=1.0, logprobs=0),
        SamplingParams(max_new_tokens=7),
        SamplingParams(max_new_tokens=7, logprobs=20),
    ]
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    engine = BatchEngine(runner, max_batch_tokens=8)  # prompts prefill in chunks beside decoding rows
    handles = [engine.submit(p, s) for p, s in zip(prompts, samplings, strict=True)]
    engine.run_until_idle()
    assert engine.steps > len(prompts)
    for prompt, sampling, handle in zip(prompts, samplings, handles, strict=True):
        batched, serial = handle.result(), alone(tiny, prompt, sampling)
        assert batched.token_ids == serial.token_ids
        if sampling.logprobs is None:
            assert batched.logprobs is None
        else:
            assert_same_records(batched.logprobs, serial.logprobs)
            assert_matches_reference(tiny, prompt, batched, sampling.logprobs)
    assert_quiescent(runner.cache)


def test_a_preempted_request_records_each_token_once_and_as_alone(tiny: LlamaModel) -> None:
    runner, engine, prompts = crowded(tiny)
    sampling = SamplingParams(max_new_tokens=10, logprobs=2)
    seen: list[list[TokenLogprob]] = [[] for _ in prompts]
    handles = [engine.submit(p, sampling, on_logprob=s.append) for p, s in zip(prompts, seen, strict=True)]
    engine.run_until_idle()
    assert engine.preempted_requests > 0
    for prompt, handle, streamed in zip(prompts, handles, seen, strict=True):
        result = handle.result()
        assert len(result.logprobs) == len(result.token_ids) == 10
        assert tuple(streamed) == result.logprobs  # the callback saw each record once, in order
        assert_same_records(result.logprobs, alone(tiny, prompt, sampling).logprobs)
        assert_matches_reference(tiny, prompt, result, 2)
    assert_quiescent(runner.cache)


def test_on_logprob_gets_each_record_before_on_token_gets_its_token(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    engine = BatchEngine(runner)
    events: list[tuple[str, int]] = []
    handle = engine.submit(
        _ids(6, seed=9),
        SamplingParams(max_new_tokens=4, logprobs=1),
        on_logprob=lambda record: events.append(("logprob", record.token_id)),
        on_token=lambda token: events.append(("token", token)) and False,
    )
    engine.run_until_idle()
    tokens = handle.result().token_ids
    assert events == [event for token in tokens for event in (("logprob", token), ("token", token))]


def test_an_on_logprob_exception_fails_the_request_and_frees_everything(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    engine = BatchEngine(runner)

    def broken(record: TokenLogprob) -> None:
        raise ValueError("broken callback")

    handle = engine.submit(_ids(6, seed=10), SamplingParams(max_new_tokens=4, logprobs=0), on_logprob=broken)
    engine.run_until_idle()
    with pytest.raises(ValueError, match="broken callback"):
        handle.result()
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "3"])
def test_a_bad_logprobs_value_is_refused_naming_it(value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="logprobs"):
        SamplingParams(logprobs=value)


def test_a_bad_request_is_refused_at_submit_and_leaves_the_cache_quiescent(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    runner.generate(_ids(9, seed=12), SamplingParams(max_new_tokens=2))
    before = runner.cache.stats()
    engine = BatchEngine(runner)
    with pytest.raises(InvalidArgumentError, match="on_logprob"):
        engine.submit(_ids(9, seed=12), SamplingParams(logprobs=1), on_logprob="not callable")
    with pytest.raises(InvalidArgumentError, match="logprobs"):
        runner.chat([{"role": "user", "content": "hi"}], logprobs=21)
    assert runner.cache.stats() == before and engine.num_pending == 0
    assert_quiescent(runner.cache)
