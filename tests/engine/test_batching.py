"""Specification of continuous batching: every request's tokens equal its serial uncached greedy output whatever the
arrival order, prompt lengths, shared prefixes, token budget and cancellations; the packed forward equals row-by-row
forwards; nothing is left locked or owned; submit() is thread-safe."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import CancelledError

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.errors import InvalidTokensError
from prefixcache.models.base import BatchRow, LiveKV, kv_pool_shape
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent, greedy_reference

TOL = 1e-4


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_packed_forward_equals_row_by_row_forwards(tiny: LlamaModel) -> None:
    kv = torch.zeros(kv_pool_shape(tiny, 24, 4))
    tables = [torch.arange(0, 8), torch.arange(8, 16), torch.arange(16, 24)]
    prompts = [_ids(13, 1), _ids(5, 2), _ids(22, 3)]
    lives = [LiveKV() for _ in prompts]
    tiny.forward_cached(torch.tensor(prompts[0][:9]), 0, kv, tables[0], live=lives[0])  # a row with a live prefix
    rows = [
        BatchRow(torch.tensor(prompts[0][9:]), 9, tables[0], lives[0]),
        BatchRow(torch.tensor(prompts[1]), 0, tables[1], lives[1]),
        BatchRow(torch.tensor(prompts[2][:1]), 0, tables[2], lives[2]),
    ]
    logits = tiny.forward_batch(rows, kv)
    expected = [prompts[0], prompts[1], prompts[2][:1]]
    for row_logits, live, sequence in zip(logits, lives, expected, strict=True):
        reference = tiny.forward_reference(torch.tensor(sequence))
        assert row_logits.shape == (1, tiny.vocab_size)
        assert float((row_logits - reference).abs().max()) < TOL
        assert live.num_tokens == len(sequence)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    num_requests=st.integers(1, 6),
    block_size=st.integers(1, 16),
    max_batch_tokens=st.integers(1, 64),
)
def test_batched_tokens_equal_serial_uncached_greedy(
    tiny: LlamaModel, data, num_requests: int, block_size: int, max_batch_tokens: int
) -> None:
    shared = _ids(data.draw(st.integers(0, 30), label="shared prefix"), seed=99)
    prompts, budgets = [], []
    for index in range(num_requests):
        own = _ids(data.draw(st.integers(1, 25), label="own tokens"), seed=index)
        prompts.append((shared if data.draw(st.booleans(), label="shares") else []) + own)
        budgets.append(data.draw(st.integers(0, 12), label="max_new_tokens"))
    order = data.draw(st.permutations(range(num_requests)), label="arrival order")
    cancelled = set(data.draw(st.lists(st.sampled_from(range(num_requests)), max_size=2), label="cancelled"))
    late = data.draw(st.integers(0, num_requests), label="submitted after the first step")
    runner = PrefixCachingRunner(tiny, block_size=block_size, cache_tokens=2048)
    engine = BatchEngine(runner, max_batch_tokens=max_batch_tokens)
    handles = {}
    for position, index in enumerate(order):
        if position == num_requests - late:
            engine.step()  # the rest join a running batch
        handles[index] = engine.submit(prompts[index], SamplingParams(max_new_tokens=budgets[index]))
        if index in cancelled:
            handles[index].cancel()
    engine.run_until_idle()
    for index, handle in handles.items():
        if index in cancelled:
            with pytest.raises(CancelledError):
                handle.result()
            continue
        result = handle.result()
        expected, _ = greedy_reference(tiny, prompts[index], budgets[index])
        assert list(result.token_ids) == expected, f"request {index}"
        assert result.usage.cached_tokens + result.usage.prefilled_tokens == len(prompts[index])
    assert_quiescent(runner.cache)


def test_generate_many_equals_generate_one_at_a_time(tiny: LlamaModel) -> None:
    system = _ids(40, seed=7)
    prompts = [system + _ids(6 + i, seed=20 + i) for i in range(5)]
    sampling = SamplingParams(max_new_tokens=10)
    serial = PrefixCachingRunner(tiny, block_size=16)
    expected = [serial.generate(p, sampling).token_ids for p in prompts]
    batched = PrefixCachingRunner(tiny, block_size=16).generate_many(prompts, sampling, max_batch_tokens=32)
    assert [r.token_ids for r in batched] == expected
    assert all(r.finish_reason == "length" for r in batched)


def test_later_request_hits_what_an_earlier_one_cached(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = _ids(30, seed=3)
    (first,) = runner.generate_many([prompt], SamplingParams(max_new_tokens=2))
    follow_up = prompt + list(first.token_ids) + [5, 6]
    (again,) = runner.generate_many([follow_up], SamplingParams(max_new_tokens=2))
    assert again.usage.cached_tokens == 31  # the prompt and the first generated token (the second has no K/V)
    assert list(again.token_ids) == greedy_reference(tiny, follow_up, 2)[0]


def test_stop_token_ends_a_request_and_streaming_yields_its_tokens(tiny: LlamaModel) -> None:
    prompt = _ids(12, seed=5)
    expected, _ = greedy_reference(tiny, prompt, 6)
    stop = expected[3]
    runner = PrefixCachingRunner(tiny, block_size=4)
    engine = BatchEngine(runner)
    handle = engine.submit(prompt, SamplingParams(max_new_tokens=6, stop_token_ids=frozenset({stop})))
    engine.run_until_idle()
    streamed = list(handle)
    assert streamed == expected[: expected.index(stop) + 1]
    assert handle.result().finish_reason == "stop"


def test_submit_rejects_bad_input_at_once_and_leaves_nothing(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    engine = BatchEngine(runner)
    with pytest.raises(InvalidTokensError):
        engine.submit([1, tiny.vocab_size], SamplingParams(max_new_tokens=1))
    assert not engine.step()
    assert_quiescent(runner.cache)


def test_model_error_fails_its_requests_and_releases_them(tiny: LlamaModel) -> None:
    from prefixcache.testing import FaultyModel

    faulty = FaultyModel(tiny, fail_at=None)
    runner = PrefixCachingRunner(faulty, block_size=4)
    engine = BatchEngine(runner)
    handle = engine.submit(_ids(9, seed=1), SamplingParams(max_new_tokens=3))
    faulty.arm(2)  # FaultyModel has no forward_batch: rows run through forward_cached, the second call fails
    engine.run_until_idle()
    with pytest.raises(RuntimeError, match="injected fault"):
        handle.result()
    assert_quiescent(runner.cache)


def test_background_thread_serves_requests_submitted_from_many_threads(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=8)
    engine = BatchEngine(runner, max_batch_tokens=48)
    engine.start()
    prompts = [_ids(20 + i, seed=40 + i) for i in range(6)]
    handles: dict[int, object] = {}

    def client(index: int) -> None:
        handles[index] = engine.submit(prompts[index], SamplingParams(max_new_tokens=5))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    async def wait_all():
        return await asyncio.gather(*(handles[i] for i in range(6)))

    results = asyncio.run(wait_all())
    engine.close()
    for prompt, result in zip(prompts, results, strict=True):
        assert list(result.token_ids) == greedy_reference(tiny, prompt, 5)[0]
    assert_quiescent(runner.cache)
