"""Engine calls made on the thread that steps (from ``on_token``, ``on_logprob`` or a ``call_soon`` function) would
wait on the step that made them: they raise InvalidArgumentError naming the call, and the engine serves on.  Every
test runs the engine on a thread with a bounded join, so a deadlock fails instead of hanging."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest
import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import assert_quiescent


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _stepped(engine: BatchEngine, stepping: str) -> None:
    if stepping == "background":
        engine.start()
        return
    thread = threading.Thread(target=engine.run_until_idle, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the engine deadlocked"


@pytest.mark.parametrize("call", ["run_until_idle", "step"])
@pytest.mark.parametrize("stepping", ["background", "caller"])
def test_stepping_again_from_on_token_raises_and_the_request_finishes(
    tiny: LlamaModel, call: str, stepping: str
) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)
    errors: list[BaseException] = []

    def on_token(token: int) -> bool:
        try:
            getattr(engine, call)()
        except InvalidArgumentError as error:
            errors.append(error)
        return False

    handle = engine.submit(_ids(8, 1), SamplingParams(max_new_tokens=3), on_token=on_token)
    _stepped(engine, stepping)
    assert len(handle.result(30).token_ids) == 3
    assert len(errors) == 3 and all(f"{call}()" in str(e) for e in errors)
    engine.close()
    assert_quiescent(runner.cache)


def test_an_on_logprob_callback_that_steps_fails_only_its_own_request(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)
    bad = engine.submit(
        _ids(8, 2), SamplingParams(max_new_tokens=3, logprobs=1), on_logprob=lambda record: engine.step()
    )
    good = engine.submit(_ids(8, 3), SamplingParams(max_new_tokens=3))
    _stepped(engine, "caller")
    with pytest.raises(InvalidArgumentError, match=r"step\(\)"):
        bad.result(30)
    assert len(good.result(30).token_ids) == 3
    engine.close()
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("call", ["run_until_idle", "step"])
def test_stepping_inside_call_soon_raises_through_its_future_and_the_engine_serves_on(
    tiny: LlamaModel, call: str
) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)
    engine.start()
    future = engine.call_soon(lambda: getattr(engine, call)())
    with pytest.raises(InvalidArgumentError, match=rf"{call}\(\)"):
        future.result(30)
    handle = engine.submit(_ids(8, 4), SamplingParams(max_new_tokens=2))
    assert len(handle.result(30).token_ids) == 2
    engine.close()
    assert_quiescent(runner.cache)


def test_the_core_refuses_a_step_from_inside_its_own_step(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)
    errors: list[BaseException] = []

    def on_token(token: int) -> bool:
        try:
            engine.core.step()
        except InvalidArgumentError as error:
            errors.append(error)
        return False

    handle = engine.submit(_ids(8, 5), SamplingParams(max_new_tokens=2), on_token=on_token)
    _stepped(engine, "caller")
    assert len(handle.result(30).token_ids) == 2 and len(errors) == 2
    engine.close()
    assert_quiescent(runner.cache)


def _closed_within(engine: BatchEngine, seconds: float = 10) -> None:
    thread = threading.Thread(target=engine.close, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "close() deadlocked"


@pytest.mark.parametrize("call", ["run_until_idle", "step", "close"])
def test_a_done_callback_that_steps_while_close_drains_raises_instead_of_deadlocking(
    tiny: LlamaModel, call: str
) -> None:
    # close() cancels the queued requests on its own thread, under the step lock: their futures' done callbacks run
    # there, so stepping again from one would wait on that lock forever (close() from one returns, as on_token's).
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)
    seen: list[object] = []

    def again(_future) -> None:
        try:
            seen.append(getattr(engine, call)())
        except InvalidArgumentError as error:
            seen.append(error)

    handle = engine.submit(_ids(8, 6), SamplingParams(max_new_tokens=3))
    handle.future.add_done_callback(again)
    _closed_within(engine)
    assert isinstance(handle.future.exception(), CancelledError) and len(seen) == 1
    if call == "close":
        assert seen == [None]
    else:
        assert isinstance(seen[0], InvalidArgumentError) and f"{call}()" in str(seen[0])
    assert_quiescent(runner.cache)


def test_a_done_callback_that_steps_while_a_close_from_on_token_drains_does_not_hang_the_engine(
    tiny: LlamaModel,
) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner, max_running=1)
    errors: list[BaseException] = []

    def again(_future) -> None:
        try:
            engine.step()
        except InvalidArgumentError as error:
            errors.append(error)

    closer = engine.submit(_ids(8, 7), SamplingParams(max_new_tokens=3), on_token=lambda token: engine.close())
    queued = engine.submit(_ids(8, 8), SamplingParams(max_new_tokens=3))
    queued.future.add_done_callback(again)
    engine.start()
    _closed_within(engine)
    assert all(isinstance(h.future.exception(), CancelledError) for h in (closer, queued))
    assert len(errors) == 1 and "step()" in str(errors[0])
    assert_quiescent(runner.cache)


def test_a_done_callback_that_steps_while_a_failed_step_fails_the_requests_does_not_hang_the_engine(
    tiny: LlamaModel, monkeypatch
) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)
    errors: list[BaseException] = []

    def again(_future) -> None:
        try:
            engine.step()
        except InvalidArgumentError as error:
            errors.append(error)

    def broken() -> None:
        raise RuntimeError("an engine fault")

    monkeypatch.setattr(engine.core, "step", broken)
    handle = engine.submit(_ids(8, 9), SamplingParams(max_new_tokens=3))
    handle.future.add_done_callback(again)
    engine.start()
    with pytest.raises(RuntimeError, match="an engine fault"):
        handle.result(30)
    _closed_within(engine)
    assert len(errors) == 1 and "step()" in str(errors[0])
    assert_quiescent(runner.cache)
