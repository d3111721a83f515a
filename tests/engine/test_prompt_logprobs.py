"""Specification of ``SamplingParams.prompt_logprobs``: the engine reduces each computed chunk of prompt rows to one
record per prompt token (its logprob and the k most probable ids at the position before it), equal to what
:meth:`LogitsPipeline.logprobs` gives on the model's own uncached forward; the rows themselves are never kept or
returned, whether the prompt is prefilled in one forward or in chunks, preempted or partly cached."""

from __future__ import annotations

import pytest
import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine import logits as logits_module
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.logits import LogitsPipeline
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent

BLOCK = 4
TOLERANCE = 1e-4


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _expected(model: LlamaModel, prompt: list[int], k: int, vocab_limit: int | None, start: int = 0) -> list:
    """The records of prompt tokens ``start + 1 ..`` from the model's uncached forward, one row at a time."""
    logits = model.forward_reference(torch.tensor(prompt), return_logits=True)
    pipeline = LogitsPipeline(SamplingParams(logprobs=k, vocab_limit=vocab_limit), logits.device, logits.shape[1])
    return [pipeline.logprobs(logits[i - 1], prompt[i]) for i in range(start + 1, len(prompt))]


def _assert_same_records(got: tuple, expected: list) -> None:
    assert [record.token_id for record in got] == [record.token_id for record in expected]
    for record, reference in zip(got, expected, strict=True):
        assert record.logprob == pytest.approx(reference.logprob, abs=TOLERANCE)
        assert [token for token, _ in record.top] == [token for token, _ in reference.top]
        assert [value for _, value in record.top] == pytest.approx([value for _, value in reference.top], abs=TOLERANCE)


@pytest.mark.parametrize("budget", [7, 64])
@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_equal_the_uncached_forward_row_by_row_and_no_logits_are_returned(
    tiny: LlamaModel, budget: int, k: int
) -> None:
    prompt = _ids(40, seed=1)
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    engine = BatchEngine(runner, max_batch_tokens=budget)
    sampling = SamplingParams(max_new_tokens=2, prompt_logprobs=k, logprobs=1, vocab_limit=259)
    result = engine.submit(prompt, sampling, recompute_prompt=True).future
    engine.run_until_idle()
    result = result.result()
    assert result.prompt_logits is None
    assert len(result.prompt_logprobs) == len(prompt) - 1
    assert all(len(record.top) == k for record in result.prompt_logprobs)
    _assert_same_records(result.prompt_logprobs, _expected(tiny, prompt, k, 259))
    assert len(result.logprobs) == 2  # the generated tokens' own records, apart
    assert_quiescent(runner.cache)


def test_a_cached_prefix_has_no_rows_so_its_records_start_after_it(tiny: LlamaModel) -> None:
    prompt = _ids(33, seed=2)
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    runner.generate(prompt[:20], SamplingParams(max_new_tokens=1))
    result = runner.generate(prompt, SamplingParams(max_new_tokens=0, prompt_logprobs=2))
    cached = result.usage.cached_tokens
    assert cached == 20
    assert len(result.prompt_logprobs) == len(prompt) - 1 - cached
    _assert_same_records(result.prompt_logprobs, _expected(tiny, prompt, 2, None, start=cached))


def test_a_preempted_request_keeps_one_record_per_prompt_token(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=6 * BLOCK, block_size=BLOCK)
    engine = BatchEngine(runner, max_batch_tokens=64)
    prompts = [_ids(7, seed=10 + i) for i in range(3)]
    answers = [_ids(10, seed=20 + i) for i in range(3)]
    sampling = SamplingParams(prompt_logprobs=1)
    handles = [engine.submit(p, sampling, forced_tokens=a) for p, a in zip(prompts, answers, strict=True)]
    engine.run_until_idle()
    assert engine.preempted_requests >= 1
    for prompt, handle in zip(prompts, handles, strict=True):
        result = handle.result()
        _assert_same_records(result.prompt_logprobs, _expected(tiny, prompt, 1, None, start=result.usage.cached_tokens))
    assert_quiescent(runner.cache)


def test_the_log_softmax_runs_on_chunks_of_rows_with_the_same_records(
    tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    logits = torch.randn(50, tiny.vocab_size, generator=torch.Generator().manual_seed(3))
    ids = _ids(50, seed=4)
    pipeline = LogitsPipeline(SamplingParams(prompt_logprobs=4, vocab_limit=259), logits.device, logits.shape[1])
    whole = pipeline.prompt_logprobs(logits, ids)
    calls = []
    real = torch.log_softmax
    monkeypatch.setattr(logits_module, "PROMPT_LOGPROB_VALUES", 3 * 259)  # three rows at a time
    monkeypatch.setattr(torch, "log_softmax", lambda rows, dim: calls.append(rows.shape) or real(rows, dim=dim))
    chunked = pipeline.prompt_logprobs(logits, ids)
    assert calls and all(shape[0] <= 3 and shape[1] == 259 for shape in calls)
    assert sum(shape[0] for shape in calls) == 50
    assert chunked == whole


def test_a_prompt_token_outside_the_vocabulary_limit_reads_minus_infinity(tiny: LlamaModel) -> None:
    logits = torch.randn(2, tiny.vocab_size)
    pipeline = LogitsPipeline(SamplingParams(prompt_logprobs=1, vocab_limit=100), logits.device, logits.shape[1])
    inside, outside = pipeline.prompt_logprobs(logits, [5, 300])
    assert inside.logprob <= 0 and outside.logprob == float("-inf")
    assert all(token < 100 for record in (inside, outside) for token, _ in record.top)


@pytest.mark.parametrize("value", [-1, 21, 1.0, True, "2"])
def test_prompt_logprobs_must_be_none_or_an_int_up_to_twenty(value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
