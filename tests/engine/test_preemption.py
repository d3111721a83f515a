"""Specification of recompute preemption in the batching engine: when running requests hold the pool and one of
them needs a block, the latest admitted give theirs back and resume later; every request that fits the pool alone
finishes with its serial output (greedy and seeded sampling alike), nothing is emitted twice, and the cache is
quiescent afterwards, through cancellation and close() of a preempted request too."""

from __future__ import annotations

from concurrent.futures import CancelledError

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.preemption import can_preempt_for, choose_victim
from prefixcache.errors import CapacityError, OutOfBlocksError, PoolBusyError
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent

BLOCK = 4


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serial(tiny: LlamaModel, prompt: list[int], sampling: SamplingParams) -> tuple[int, ...]:
    """The request's output run alone on a pool with room to spare: the reference."""
    return PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK).generate(prompt, sampling).token_ids


def crowded(tiny: LlamaModel, policy: str = "lpm") -> tuple[PrefixCachingRunner, BatchEngine, list[list[int]]]:
    """Three requests of 7 prompt + 10 new tokens (5 blocks each) on a pool of 6 blocks: admission takes all three
    (2 prompt blocks each), so the first decode block to be needed cannot be had without preempting."""
    runner = PrefixCachingRunner(tiny, cache_tokens=6 * BLOCK, block_size=BLOCK)
    prompts = [_ids(7, seed=10 + i) for i in range(3)]
    return runner, BatchEngine(runner, policy=policy), prompts


def step_until_preempted(engine: BatchEngine) -> None:
    """Step ``engine`` until its first preemption (failing if it runs out of work first)."""
    while engine.preempted_requests == 0:
        assert engine.step()


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_requests_too_many_for_the_pool_together_all_finish_with_their_serial_output(
    tiny: LlamaModel, policy: str
) -> None:
    runner, engine, prompts = crowded(tiny, policy)
    sampling = SamplingParams(max_new_tokens=10)
    streamed: list[list[int]] = [[] for _ in prompts]
    handles = [
        engine.submit(prompt, sampling, on_token=lambda t, seen=seen: seen.append(t) and False)
        for prompt, seen in zip(prompts, streamed, strict=True)
    ]
    engine.run_until_idle()
    results = [handle.result() for handle in handles]  # without preemption one raises PoolBusyError here
    for prompt, result, seen, handle in zip(prompts, results, streamed, handles, strict=True):
        assert result.token_ids == serial(tiny, prompt, sampling)
        assert result.finish_reason == "length"
        assert list(handle) == seen == list(result.token_ids)  # nothing emitted twice
        assert result.usage.cached_tokens + result.usage.prefilled_tokens == len(prompt)
    assert engine.preempted_requests > 0
    assert_quiescent(runner.cache)


def test_the_latest_admitted_request_gives_way_and_its_resumption_is_not_counted_again(tiny: LlamaModel) -> None:
    runner, engine, prompts = crowded(tiny)
    handles = [engine.submit(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    step_until_preempted(engine)
    (victim,) = [r for r in engine._waiting]
    assert victim.handle is handles[2]  # the latest admitted gives way
    assert victim.lease is None and victim.waited_steps >= engine.max_wait_steps
    before = runner.cache.stats()
    while victim.lease is None:
        assert engine.step()
    after = runner.cache.stats()
    # The resumption is the same request: hit statistics counted it once, at its first admission.
    assert (after.query_tokens, after.hit_tokens, after.rejected_requests) == (
        before.query_tokens,
        before.hit_tokens,
        before.rejected_requests,
    )
    engine.run_until_idle()
    assert all(len(h.result().token_ids) == 10 for h in handles)
    assert_quiescent(runner.cache)


def test_seeded_sampling_through_a_preemption_equals_the_request_run_alone(tiny: LlamaModel) -> None:
    runner, engine, prompts = crowded(tiny)
    samplings = [SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=7 + i) for i in range(3)]
    handles = [engine.submit(p, s) for p, s in zip(prompts, samplings, strict=True)]
    engine.run_until_idle()
    assert engine.preempted_requests > 0
    for prompt, sampling, handle in zip(prompts, samplings, handles, strict=True):
        assert handle.result().token_ids == serial(tiny, prompt, sampling)
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("end", ["cancel", "close"])
def test_a_preempted_request_cancelled_or_closed_while_waiting_frees_everything(tiny: LlamaModel, end: str) -> None:
    runner, engine, prompts = crowded(tiny)
    sampling = SamplingParams(max_new_tokens=10)
    handles = [engine.submit(p, sampling) for p in prompts]
    step_until_preempted(engine)
    (victim,) = [r.handle for r in engine._waiting]
    if end == "cancel":
        victim.cancel()
        engine.run_until_idle()
        assert engine.cancelled_requests == 1
        for prompt, handle in zip(prompts, handles, strict=True):
            if handle is not victim:
                assert handle.result().token_ids == serial(tiny, prompt, sampling)
    else:
        engine.close()
        assert engine.cancelled_requests == 3
    with pytest.raises(CancelledError):
        victim.result()
    assert_quiescent(runner.cache)


def test_on_token_stop_after_a_preemption_ends_the_request_as_it_ends_alone(tiny: LlamaModel) -> None:
    runner, engine, prompts = crowded(tiny)
    sampling = SamplingParams(max_new_tokens=10)
    seen: list[int] = []

    def stop_at_six(token: int) -> bool:
        seen.append(token)
        return len(seen) == 6

    handles = [engine.submit(p, sampling) for p in prompts[:2]]
    handles.append(engine.submit(prompts[2], sampling, on_token=stop_at_six))
    step_until_preempted(engine)
    assert [r.handle for r in engine._waiting] == [handles[2]] and len(seen) < 6
    engine.run_until_idle()
    result = handles[2].result()
    assert result.finish_reason == "stop" and list(result.token_ids) == seen
    assert result.token_ids == serial(tiny, prompts[2], sampling)[:6]
    assert_quiescent(runner.cache)


def test_a_preempted_request_is_admitted_before_later_arrivals_with_longer_cached_prefixes(tiny: LlamaModel) -> None:
    runner, engine, prompts = crowded(tiny)
    handles = [engine.submit(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    step_until_preempted(engine)
    newcomer = engine.submit(prompts[0] + [1], SamplingParams(max_new_tokens=1))  # hits request 0's prompt
    order = [request.handle for request, _ in engine._admission_order(list(engine._waiting))]
    assert order == [handles[2], newcomer]
    engine.run_until_idle()
    assert all(h.result().finish_reason == "length" for h in [*handles, newcomer])
    assert_quiescent(runner.cache)


def test_a_request_the_pool_cannot_hold_alone_still_fails_with_a_capacity_error(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=2 * BLOCK, block_size=BLOCK)
    engine = BatchEngine(runner)
    with pytest.raises(CapacityError):
        engine.submit(_ids(7, seed=1), SamplingParams(max_new_tokens=4))
    assert engine.preempted_requests == 0
    assert_quiescent(runner.cache)


def test_the_victim_is_the_latest_admitted_request_outside_the_batch() -> None:
    running = ["a", "b", "c", "d"]
    assert choose_victim(running, [], "a") == "d"
    assert choose_victim(running, ["d", "c"], "a") == "b"
    assert choose_victim(running, ["b", "c", "d"], "a") == "a"  # the needing request preempts itself
    assert choose_victim(["a"], [], "a") is None  # alone: nothing to preempt, it fails
    busy = PoolBusyError(1, free_blocks=0, evictable_blocks=0, locked_blocks=2, owned_blocks=2, pool_blocks=4)
    assert can_preempt_for(busy) and can_preempt_for(OutOfBlocksError("short"))
    assert not can_preempt_for(CapacityError("too big")) and not can_preempt_for(ValueError("other"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), num_blocks=st.integers(3, 10), num_requests=st.integers(1, 6))
def test_every_request_that_fits_the_pool_alone_finishes_with_its_serial_output(
    tiny: LlamaModel, data, num_blocks: int, num_requests: int
) -> None:
    capacity = num_blocks * BLOCK
    policy = data.draw(st.sampled_from(["lpm", "fcfs"]), label="policy")
    shared = _ids(data.draw(st.integers(0, capacity - 2), label="shared prefix"), seed=99)
    requests = []
    for index in range(num_requests):
        prompt = shared[: data.draw(st.integers(0, len(shared)), label="shared part")]
        prompt = prompt + _ids(data.draw(st.integers(1, capacity - len(prompt) - 1), label="own"), seed=index)
        max_new = data.draw(st.integers(0, capacity - len(prompt)), label="max_new_tokens")
        arrival = data.draw(st.integers(0, 3), label="arrival step")
        cancel_at = data.draw(st.none() | st.integers(0, 12), label="cancelled at step")
        requests.append((prompt, SamplingParams(max_new_tokens=max_new), arrival, cancel_at))
    max_batch_tokens = data.draw(st.integers(1, 32), label="max_batch_tokens")
    runner = PrefixCachingRunner(tiny, cache_tokens=capacity, block_size=BLOCK)
    engine = BatchEngine(runner, max_batch_tokens=max_batch_tokens, policy=policy, max_wait_steps=3)
    handles: dict[int, object] = {}
    step = 0
    while len(handles) < num_requests or engine.num_pending:
        for index, (prompt, sampling, arrival, cancel_at) in enumerate(requests):
            if arrival == step:
                handles[index] = engine.submit(prompt, sampling)
            if cancel_at == step and index in handles:
                handles[index].cancel()
        engine.step()
        step += 1
        assert step < 2000, "the engine made no progress"
    for index, (prompt, sampling, _, cancel_at) in enumerate(requests):
        handle = handles[index]
        if cancel_at is not None and handle.cancelled:
            try:
                result = handle.result()
            except CancelledError:
                continue
        else:
            result = handle.result()
        assert result.token_ids == serial(tiny, prompt, sampling), f"request {index}"
        assert result.usage.cached_tokens + result.usage.prefilled_tokens == len(prompt)
    assert_quiescent(runner.cache)
