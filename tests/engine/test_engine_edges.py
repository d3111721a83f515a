"""Edges of the batching engine found by trying to break it: waits that could never end, callbacks that raise
BaseException, a callback that is not callable, weight changes while requests are preempted, and the runner's weight
check raced by two threads.  Each: a prefixcache error (or the request's own error), no hang, a quiescent cache."""

from __future__ import annotations

import threading

import pytest
import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import LlamaModel, build_model
from prefixcache.testing import FaultyModel, assert_quiescent

BLOCK = 4


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("timeout", [float("nan"), "1", True])
def test_wait_idle_refuses_a_timeout_that_is_not_a_number_of_seconds(tiny: LlamaModel, timeout: object) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=16 * BLOCK, block_size=BLOCK)
    engine = BatchEngine(runner)
    engine.submit(_ids(5, 1), SamplingParams(max_new_tokens=2))
    with pytest.raises(InvalidArgumentError):
        engine.wait_idle(timeout)  # type: ignore[arg-type]  # NaN used to wait forever
    assert engine.wait_idle(0) is False  # nothing steps: still busy
    engine.close()
    assert_quiescent(runner.cache)


def test_wait_idle_on_the_thread_that_steps_is_refused_instead_of_waiting_on_itself(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=16 * BLOCK, block_size=BLOCK)
    engine = BatchEngine(runner)
    seen: list[BaseException] = []

    def wait_inside(token: int) -> bool:
        try:
            engine.wait_idle()  # without a timeout this waited forever for the step it is called from
        except InvalidArgumentError as error:
            seen.append(error)
        return False

    handle = engine.submit(_ids(5, 1), SamplingParams(max_new_tokens=2), on_token=wait_inside)
    engine.run_until_idle()
    assert len(seen) == 2
    assert len(handle.result(timeout=0).token_ids) == 2
    assert_quiescent(runner.cache)


def test_an_on_token_that_is_not_callable_is_refused_at_submit(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=16 * BLOCK, block_size=BLOCK)
    engine = BatchEngine(runner)
    with pytest.raises(InvalidArgumentError):
        engine.submit(_ids(5, 1), on_token=5)  # type: ignore[arg-type]  # was a TypeError at the first token
    assert engine.num_pending == 0
    assert_quiescent(runner.cache)


def test_a_keyboard_interrupt_from_on_token_fails_its_request_releases_it_and_propagates(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=16 * BLOCK, block_size=BLOCK)
    engine = BatchEngine(runner)

    def interrupt(token: int) -> bool:
        raise KeyboardInterrupt

    handle = engine.submit(_ids(5, 1), SamplingParams(max_new_tokens=3), on_token=interrupt)
    other = engine.submit(_ids(6, 2), SamplingParams(max_new_tokens=3))
    with pytest.raises(KeyboardInterrupt):
        engine.run_until_idle()
    assert isinstance(handle.future.exception(timeout=0), KeyboardInterrupt)  # was left running, its blocks locked
    engine.run_until_idle()
    expected = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=BLOCK).generate(_ids(6, 2), SamplingParams(3))
    assert other.result(timeout=0).token_ids == expected.token_ids
    assert_quiescent(runner.cache)


def test_a_system_exit_from_on_token_does_not_stop_the_background_thread(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=16 * BLOCK, block_size=BLOCK)
    engine = BatchEngine(runner)
    engine.start()
    try:

        def leave(token: int) -> bool:
            raise SystemExit(3)

        handle = engine.submit(_ids(5, 1), SamplingParams(max_new_tokens=3), on_token=leave)
        with pytest.raises(SystemExit):
            handle.result(timeout=30)  # the thread used to die here, every later request waiting forever
        after = engine.submit(_ids(6, 2), SamplingParams(max_new_tokens=2))
        assert len(after.result(timeout=30).token_ids) == 2
        assert engine.wait_idle(30)
        assert_quiescent(runner.cache)
    finally:
        engine.close()


def test_a_preempted_request_resumed_after_a_weight_change_is_served_no_kv_of_the_old_weights() -> None:
    """Resuming is admission: a request preempted before a weight change recomputes every position with the new
    weights (it used to hit the blocks it cached with the old ones, or not, as eviction had it).  Its tokens are what
    it emitted before plus the new model's greedy continuation of prompt + those tokens."""
    model = build_model("tiny", device="cpu")
    runner = PrefixCachingRunner(model, cache_tokens=6 * BLOCK, block_size=BLOCK)
    engine = BatchEngine(runner)
    prompts = [_ids(7, 10 + i) for i in range(3)]
    handles = [engine.submit(prompt, SamplingParams(max_new_tokens=10)) for prompt in prompts]
    while engine.preempted_requests == 0:
        assert engine.step()
    (victim,) = engine._waiting
    index = [handle for handle in handles].index(victim.handle)
    emitted = list(victim.generated)
    old_namespace = runner.namespace_key(None)
    with torch.no_grad():
        model.layers[0].qkv.mul_(1.5)
    resumes: list[tuple[str, int]] = []
    acquire = runner.cache.acquire

    def record(tokens, namespace, **kwargs):
        lease = acquire(tokens, namespace, **kwargs)
        if kwargs.get("resumed"):
            resumes.append((namespace, lease.num_cached_tokens))
        return lease

    runner.cache.acquire = record  # type: ignore[method-assign]
    engine.run_until_idle()
    assert resumes
    assert all(namespace != old_namespace for namespace, _ in resumes)  # nothing of the old weights matched
    fresh = PrefixCachingRunner(model, cache_tokens=4096, block_size=BLOCK)
    rest = fresh.generate(prompts[index] + emitted, SamplingParams(max_new_tokens=10 - len(emitted)))
    assert handles[index].result(timeout=0).token_ids == (*emitted, *rest.token_ids)
    assert_quiescent(runner.cache)


def test_a_weight_check_raced_by_another_thread_never_yields_the_old_fingerprint() -> None:
    """Two threads check the weights at once: the one that finds the version already stored by the other must not
    go on with the old fingerprint while the other is still computing the new one (it used to, so a request
    admitted then hit the K/V of the old weights)."""
    model = build_model("tiny", device="cpu")
    runner = PrefixCachingRunner(model, cache_tokens=64 * BLOCK, block_size=BLOCK)
    prompt = _ids(20, 3)
    runner.generate(prompt, SamplingParams(max_new_tokens=1))
    inside = threading.Event()
    fingerprint = model.fingerprint

    def slow_fingerprint() -> str:
        if threading.current_thread().name == "changer":
            inside.set()
            threading.Event().wait(2)  # the changer is slow to fingerprint; the racer must wait for it
        return fingerprint()

    model.fingerprint = slow_fingerprint  # type: ignore[method-assign]
    with torch.no_grad():
        model.layers[0].qkv.mul_(1.5)
    changer = threading.Thread(target=runner.checks.refresh_weights, name="changer")
    changer.start()
    assert inside.wait(30)
    result = runner.generate(prompt, SamplingParams(max_new_tokens=1))  # the version is stored: only the old print
    changer.join(30)
    assert result.usage.cached_tokens == 0
    assert_quiescent(runner.cache)


def test_a_keyboard_interrupt_from_the_model_in_a_step_releases_its_requests_and_propagates(tiny: LlamaModel) -> None:
    model = FaultyModel(tiny, fail_at=2, exception=KeyboardInterrupt)
    runner = PrefixCachingRunner(model, cache_tokens=16 * BLOCK, block_size=BLOCK)
    engine = BatchEngine(runner)
    handle = engine.submit(_ids(5, 1), SamplingParams(max_new_tokens=3))
    with pytest.raises(KeyboardInterrupt):
        engine.run_until_idle()
    assert isinstance(handle.future.exception(timeout=0), KeyboardInterrupt)  # was left running, its blocks locked
    assert engine.num_pending == 0
    assert_quiescent(runner.cache)


def test_a_request_id_that_is_not_a_str_is_refused_at_submit() -> None:
    runner = PrefixCachingRunner(build_model("tiny", device="cpu"), num_blocks=32, block_size=4)
    engine = BatchEngine(runner)
    with pytest.raises(InvalidArgumentError, match="request_id"):
        engine.submit([1, 2, 3], SamplingParams(max_new_tokens=1), request_id=7)
    assert engine.num_pending == 0
    runner.cache.check_invariants()
