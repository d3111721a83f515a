"""Specification of prefix-aware scheduling in the batching engine (issue 13, item 4): longest cached prefix first
under a fairness bound, prompts cached as soon as their prefill ends, a shared uncached prefix prefilled once; every
request's tokens still equal its serial uncached output and the cache ends quiescent."""

from __future__ import annotations

from concurrent.futures import CancelledError

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine, RequestHandle
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent, greedy_reference


def _ids(n: int, seed: int, first: int | None = None) -> list[int]:
    """``n`` random ids below 259; with ``first`` the sequence starts with that id (branches kept apart)."""
    ids = torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ids if first is None or not ids else [first] + ids[1:]


def _finish_order(handles: dict[str, RequestHandle]) -> list[str]:
    order: list[str] = []
    for name, handle in handles.items():
        handle.future.add_done_callback(lambda _, name=name: order.append(name))
    return order


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_longest_cached_prefix_is_admitted_first(tiny: LlamaModel, policy: str) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    bases = {"b8": _ids(8, 1, first=1), "b16": _ids(16, 2, first=2), "b24": _ids(24, 3, first=3)}
    for base in bases.values():
        runner.prefill(base)
    prompts = {
        "cold": _ids(12, 4, first=4),
        "b8": bases["b8"] + _ids(4, 5),
        "b24": bases["b24"] + _ids(4, 6),
        "b16": bases["b16"] + _ids(4, 7),
    }
    engine = BatchEngine(runner, max_running=1, policy=policy)  # one request at a time: the order is visible
    params = SamplingParams(max_new_tokens=1)
    handles = {name: engine.submit(prompt, params) for name, prompt in prompts.items()}
    order = _finish_order(handles)
    engine.run_until_idle()
    assert engine.steps == 4  # one request per step: admitted, prefilled, one token, finished
    expected = ["b24", "b16", "b8", "cold"] if policy == "lpm" else ["cold", "b8", "b24", "b16"]
    assert order == expected
    cached = {name: handle.result().usage.cached_tokens for name, handle in handles.items()}
    assert cached == {"cold": 0, "b8": 8, "b24": 24, "b16": 16}
    for name, prompt in prompts.items():
        assert list(handles[name].result().token_ids) == greedy_reference(tiny, prompt, 1)[0]
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("max_wait_steps", [1, 2, 3, 5])
def test_fairness_bound_admits_a_waiting_request_after_max_wait_steps(tiny: LlamaModel, max_wait_steps: int) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    base = _ids(16, 8, first=8)
    runner.prefill(base)
    engine = BatchEngine(runner, max_running=1, max_wait_steps=max_wait_steps)
    params = SamplingParams(max_new_tokens=1)
    order: list[str] = []
    handles: dict[str, RequestHandle] = {}

    def submit(name: str, prompt: list[int]) -> None:
        handles[name] = engine.submit(prompt, params)
        handles[name].future.add_done_callback(lambda _: order.append(name))

    submit("cold", _ids(10, 9, first=9))
    hot = 7
    for index in range(hot):  # a hot request (16 tokens cached) arrives at every step: the cold one would starve
        submit(f"hot{index}", base + _ids(3, 20 + index, first=100 + index))
        if index < hot - 1:
            engine.step()
    engine.run_until_idle()
    # Each step admits and finishes one request.  The cold one waits from the first step on: it is due after
    # max_wait_steps steps, so it comes after exactly max_wait_steps hot requests and before every later one.
    hot_names = [f"hot{i}" for i in range(hot)]
    assert order == hot_names[:max_wait_steps] + ["cold"] + hot_names[max_wait_steps:]
    assert handles["cold"].result().usage.cached_tokens == 0
    assert all(handles[name].result().usage.cached_tokens == 16 for name in hot_names)
    assert_quiescent(runner.cache)


def test_without_the_bound_a_cold_request_waits_behind_every_hot_one(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    base = _ids(16, 8, first=8)
    runner.prefill(base)
    engine = BatchEngine(runner, max_running=1, max_wait_steps=100)
    params = SamplingParams(max_new_tokens=1)
    handles = {"cold": engine.submit(_ids(10, 9, first=9), params)}
    handles |= {f"hot{i}": engine.submit(base + _ids(3, 20 + i, first=100 + i), params) for i in range(6)}
    order = _finish_order(handles)
    engine.run_until_idle()
    assert order == [f"hot{i}" for i in range(6)] + ["cold"]


@pytest.mark.parametrize(("policy", "system_tokens"), [("lpm", 37), ("lpm", 40), ("fcfs", 37)])
def test_shared_uncached_prefix_is_prefilled_once(tiny: LlamaModel, policy: str, system_tokens: int) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    system = _ids(system_tokens, 11)
    num_requests, suffix_tokens = 5, 6
    prompts = [system + _ids(suffix_tokens, 30 + i, first=i) for i in range(num_requests)]
    engine = BatchEngine(runner, max_batch_tokens=16, policy=policy)  # the system prompt takes several steps
    params = SamplingParams(max_new_tokens=4)
    handles = [engine.submit(prompt, params) for prompt in prompts]
    engine.run_until_idle()
    results = [handle.result() for handle in handles]
    prefilled = sum(r.usage.prefilled_tokens for r in results)
    if policy == "lpm":
        assert prefilled == system_tokens + num_requests * suffix_tokens
        assert [r.usage.cached_tokens for r in results] == [0] + [system_tokens] * (num_requests - 1)
    else:
        assert prefilled == num_requests * (system_tokens + suffix_tokens)
    for prompt, result in zip(prompts, results, strict=True):
        assert list(result.token_ids) == greedy_reference(tiny, prompt, 4)[0]
    assert_quiescent(runner.cache)


def test_identical_concurrent_prompts_compute_the_prompt_once(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = _ids(29, 12)
    engine = BatchEngine(runner, max_batch_tokens=8)
    handles = [engine.submit(prompt, SamplingParams(max_new_tokens=3)) for _ in range(4)]
    engine.run_until_idle()
    assert [h.result().usage.prefilled_tokens for h in handles] == [29, 1, 1, 1]  # the last token is always computed
    expected = greedy_reference(tiny, prompt, 3)[0]
    assert all(list(h.result().token_ids) == expected for h in handles)
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_second_request_hits_the_first_prompt_while_the_first_decodes(tiny: LlamaModel, policy: str) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = _ids(22, 13)
    engine = BatchEngine(runner, policy=policy)
    first = engine.submit(prompt, SamplingParams(max_new_tokens=8))
    engine.step()  # the whole prompt prefilled, the first token sampled: the request decodes from now on
    namespace = runner.namespace_key(None)
    follow_up = prompt + [5, 6, 7]
    second = engine.submit(follow_up, SamplingParams(max_new_tokens=3))
    for _ in range(3):  # admitted and prefilled (first token), then two decode steps: done
        engine.step()
    assert not first.future.done()
    assert second.future.done()
    if policy == "lpm":
        assert runner.cache.stats().locked_tokens == 20  # the first's whole prompt blocks, under its lock
        assert second.result().usage.cached_tokens == 22
    else:
        assert second.result().usage.cached_tokens == 0
    engine.run_until_idle()
    assert list(first.result().token_ids) == greedy_reference(tiny, prompt, 8)[0]
    assert list(second.result().token_ids) == greedy_reference(tiny, follow_up, 3)[0]
    assert prompt in [seq[:22] for seq in runner.cache.cached_sequences(namespace)]
    assert_quiescent(runner.cache)


def test_scheduling_options_are_checked(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    with pytest.raises(InvalidArgumentError, match="policy"):
        BatchEngine(runner, policy="sjf")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgumentError, match="max_wait_steps"):
            BatchEngine(runner, max_wait_steps=bad)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    num_requests=st.integers(1, 7),
    block_size=st.integers(1, 8),
    max_batch_tokens=st.integers(1, 48),
    max_running=st.integers(1, 4),
    max_wait_steps=st.integers(1, 4),
    policy=st.sampled_from(["lpm", "fcfs"]),
)
def test_any_schedule_gives_serial_uncached_tokens_and_leaves_the_cache_quiescent(
    tiny: LlamaModel,
    data,
    num_requests: int,
    block_size: int,
    max_batch_tokens: int,
    max_running: int,
    max_wait_steps: int,
    policy: str,
) -> None:
    trunk = _ids(40, seed=77)
    prompts, budgets = [], []
    for index in range(num_requests):
        shared = data.draw(st.sampled_from([0, 3, 9, 17, 40]), label="shared trunk tokens")
        own = _ids(data.draw(st.integers(0 if shared else 1, 12), label="own tokens"), seed=index, first=index)
        prompt = trunk[:shared] + own
        if prompts and data.draw(st.booleans(), label="repeats an earlier prompt"):
            prompt = list(prompts[data.draw(st.integers(0, len(prompts) - 1), label="which")])
        prompts.append(prompt)
        budgets.append(data.draw(st.integers(0, 6), label="max_new_tokens"))
    warm = data.draw(st.sampled_from([0, 5, 20]), label="trunk tokens cached before")
    arrival_steps = sorted(data.draw(st.lists(st.integers(0, 6), min_size=num_requests, max_size=num_requests)))
    order = data.draw(st.permutations(range(num_requests)), label="arrival order")
    cancel_at = data.draw(
        st.dictionaries(st.sampled_from(range(num_requests)), st.integers(0, 8), max_size=2), label="cancel at step"
    )
    runner = PrefixCachingRunner(tiny, block_size=block_size, cache_tokens=2048)
    if warm:
        runner.prefill(trunk[:warm])
    engine = BatchEngine(
        runner, max_batch_tokens=max_batch_tokens, max_running=max_running, max_wait_steps=max_wait_steps, policy=policy
    )
    handles: dict[int, RequestHandle] = {}
    step = 0
    while True:
        for position, index in enumerate(order):
            if arrival_steps[position] == step:
                handles[index] = engine.submit(prompts[index], SamplingParams(max_new_tokens=budgets[index]))
        for index, at in cancel_at.items():
            if at == step and index in handles:
                handles[index].cancel()
        busy = engine.step()
        runner.cache.check_invariants()
        step += 1
        if not busy and len(handles) == num_requests:
            break
    for index, handle in handles.items():
        try:
            result = handle.result()
        except CancelledError:
            assert index in cancel_at
            continue
        assert list(result.token_ids) == greedy_reference(tiny, prompts[index], budgets[index])[0], f"request {index}"
        assert result.usage.cached_tokens + result.usage.prefilled_tokens == len(prompts[index])
    assert_quiescent(runner.cache)
