"""Specification of the engine core's request options, the same through every front end: teacher forcing
(``forced_tokens``) and prompt logits (``return_logits``) batched, chunked and preempted give what a serial call gives;
the serial calls and the batching engine are one core (one request in a serial call's core)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.core import EngineCore
from prefixcache.errors import InvalidTokensError
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent

BLOCK = 4


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference_logits(model: LlamaModel, sequence: list[int], start: int) -> torch.Tensor:
    return model.forward_reference(torch.tensor(sequence), return_logits=True, logits_from=start)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(2, 40), min_size=1, max_size=4),
    forced_lengths=st.lists(st.integers(0, 9), min_size=4, max_size=4),
    budget=st.integers(1, 48),
    shared=st.integers(0, 20),
)
def test_batched_teacher_forcing_with_prompt_logits_equals_the_serial_call(
    tiny: LlamaModel, lengths: list[int], forced_lengths: list[int], budget: int, shared: int
) -> None:
    prefix = _ids(shared, seed=99)
    prompts = [prefix + _ids(n, seed=i) for i, n in enumerate(lengths)]
    answers = [_ids(forced_lengths[i], seed=50 + i) for i in range(len(prompts))]
    serial_runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    expected = [
        serial_runner.generate(p, forced_tokens=a, return_logits=True) for p, a in zip(prompts, answers, strict=True)
    ]
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    engine = BatchEngine(runner, max_batch_tokens=budget)
    handles = [engine.submit(p, forced_tokens=a, return_logits=True) for p, a in zip(prompts, answers, strict=True)]
    engine.run_until_idle()
    for prompt, answer, handle, serial in zip(prompts, answers, handles, expected, strict=True):
        result = handle.result()
        assert result.finish_reason == "forced" and list(result.token_ids) == answer
        assert result.prompt_logits.shape == (result.usage.prefilled_tokens, tiny.vocab_size)
        reference = _reference_logits(tiny, prompt, result.usage.cached_tokens)
        torch.testing.assert_close(result.prompt_logits, reference, atol=1e-4, rtol=1e-4)
        if result.usage.cached_tokens == serial.usage.cached_tokens:
            torch.testing.assert_close(result.prompt_logits, serial.prompt_logits, atol=1e-4, rtol=1e-4)
        # the forced answer was cached with its prompt: the next turn hits all of it
        assert runner.cache.cached_length(prompt + answer + [1], runner.namespace_key(None)) == len(prompt + answer)
    assert_quiescent(runner.cache)


def test_a_preempted_forced_request_with_prompt_logits_keeps_each_row_once(tiny: LlamaModel) -> None:
    """Three forced requests on a pool too small for all: preemption between the prompt and its answer recomputes,
    and the prompt logits still hold one row per prefilled position, equal to the model's own forward."""
    runner = PrefixCachingRunner(tiny, cache_tokens=6 * BLOCK, block_size=BLOCK)
    engine = BatchEngine(runner, max_batch_tokens=64)
    prompts = [_ids(7, seed=10 + i) for i in range(3)]
    answers = [_ids(10, seed=20 + i) for i in range(3)]
    handles = [engine.submit(p, forced_tokens=a, return_logits=True) for p, a in zip(prompts, answers, strict=True)]
    engine.run_until_idle()
    assert engine.preempted_requests >= 1
    for prompt, answer, handle in zip(prompts, answers, handles, strict=True):
        result = handle.result()
        assert list(result.token_ids) == answer and result.finish_reason == "forced"
        reference = _reference_logits(tiny, prompt, result.usage.cached_tokens)
        torch.testing.assert_close(result.prompt_logits, reference, atol=1e-4, rtol=1e-4)
    assert_quiescent(runner.cache)


def test_forced_tokens_are_streamed_to_on_token_and_never_stop_early(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    engine = BatchEngine(runner)
    seen: list[int] = []
    answer = _ids(6, seed=3)
    handle = engine.submit(_ids(12, seed=4), forced_tokens=answer, on_token=lambda t: seen.append(t) or True)
    engine.run_until_idle()
    assert seen == answer and list(handle.result().token_ids) == answer
    assert handle.result().finish_reason == "forced"


def test_bad_forced_tokens_are_refused_at_submit_and_leave_nothing_queued(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    engine = BatchEngine(runner)
    with pytest.raises(InvalidTokensError, match="forced_tokens"):
        engine.submit([1, 2, 3], forced_tokens=[tiny.vocab_size])
    assert engine.num_pending == 0
    assert_quiescent(runner.cache)


def test_a_serial_call_runs_on_an_engine_core_of_its_own(tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The serial path is the core: a call's core holds its one request, prefills it in one forward and is empty
    after it."""
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    cores: list[EngineCore] = []
    new_core = runner.new_core

    def watched(**options):
        core = new_core(**options)
        cores.append(core)
        return core

    monkeypatch.setattr(runner, "new_core", watched)
    result = runner.generate(_ids(30, seed=5), SamplingParams(max_new_tokens=3))
    (core,) = cores
    assert core.max_batch_tokens is None and core.steps == 3 and not core.has_work()
    assert result.usage.generated_tokens == 3
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("budget", [6, 8, 12])
def test_a_preempted_request_whose_prompt_got_cached_meanwhile_still_returns_every_prompt_logits_row(
    tiny: LlamaModel, budget: int
) -> None:
    """Preempted part way through its prompt, a request with prompt logits resumes while another request has cached
    the whole prompt: it must recompute the rows it has not returned yet, not skip to the cached length (it returned
    a few rows for 16 prefilled positions)."""
    runner = PrefixCachingRunner(tiny, num_blocks=8, block_size=BLOCK)
    engine = BatchEngine(runner, max_batch_tokens=budget, policy="fcfs")
    prompt = _ids(16, seed=1)
    other = engine.submit(prompt, SamplingParams(max_new_tokens=3))
    handle = engine.submit(prompt, SamplingParams(max_new_tokens=1), return_logits=True)
    engine.run_until_idle()
    assert engine.preempted_requests == 1
    result = handle.result()
    assert result.usage.prefilled_tokens == 16
    torch.testing.assert_close(result.prompt_logits, _reference_logits(tiny, prompt, 0), atol=1e-4, rtol=1e-4)
    assert result.token_ids == runner.generate(prompt, SamplingParams(max_new_tokens=1)).token_ids
    assert len(other.result().token_ids) == 3
    assert_quiescent(runner.cache)


def test_a_preempted_request_whose_cached_prefix_was_evicted_meanwhile_returns_only_its_prefilled_rows(
    tiny: LlamaModel,
) -> None:
    """Admitted with 8 prompt tokens cached, preempted before computing, the prefix evicted while it waits: it
    recomputes from the start, but its prompt logits still cover its 8 prefilled positions only (it returned 12)."""
    runner = PrefixCachingRunner(tiny, num_blocks=8, block_size=BLOCK)
    system = _ids(8, seed=1)
    runner.prefill(system)
    engine = BatchEngine(runner, max_batch_tokens=16, policy="fcfs")
    engine.submit(_ids(16, seed=3), SamplingParams(max_new_tokens=12))
    prompt = system + _ids(8, seed=2)
    handle = engine.submit(prompt, SamplingParams(max_new_tokens=1), return_logits=True)
    engine.run_until_idle()
    assert engine.preempted_requests == 1
    result = handle.result()
    assert result.usage.cached_tokens == 8 and result.prompt_logits.shape == (8, tiny.vocab_size)
    torch.testing.assert_close(result.prompt_logits, _reference_logits(tiny, prompt, 8), atol=1e-4, rtol=1e-4)
    assert_quiescent(runner.cache)


def test_a_long_forced_answer_is_chunked_after_the_decode_rows_and_stalls_no_other_request(tiny: LlamaModel) -> None:
    """A forced answer is computed like a prompt, so it takes what the decode rows leave of the step's budget:
    a request decoding beside a 1,200-token forced answer gets its next token at every step (it got none for 19
    steps while the answer, admitted first, filled each step's budget)."""
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    engine = BatchEngine(runner, max_batch_tokens=64)
    answer = _ids(1200, seed=2)
    forced = engine.submit(_ids(8, seed=1), forced_tokens=answer)
    token_steps: list[int] = []
    decoding = engine.submit(
        _ids(8, seed=3), SamplingParams(max_new_tokens=10), on_token=lambda _t: token_steps.append(engine.steps)
    )
    engine.run_until_idle()
    assert token_steps == list(range(1, 11))
    assert list(forced.result().token_ids) == answer and len(decoding.result().token_ids) == 10
    assert_quiescent(runner.cache)


def test_prompt_logits_computed_in_one_forward_are_returned_without_a_copy(
    tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt logits of a prefill in one forward are the forward's own tensor: a copy of ``[n, vocab]`` doubled
    the peak memory of a request with ``return_logits`` (``replay --verify``: gigabytes per request on a
    150k-token vocabulary)."""
    outputs: list[torch.Tensor] = []
    forward_cached = tiny.forward_cached

    def kept(*args, **options):
        logits = forward_cached(*args, **options)
        outputs.append(logits)
        return logits

    monkeypatch.setattr(tiny, "forward_cached", kept)
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK)
    result = runner.generate(_ids(40, seed=6), SamplingParams(max_new_tokens=2), return_logits=True)
    assert result.prompt_logits.shape == (40, tiny.vocab_size)
    assert result.prompt_logits.data_ptr() == outputs[0].data_ptr()
