"""The batching engine's per-request options, as the server uses them: a token callback that ends a request (string
stop sequences through :func:`submit_chat`), ``request_id`` / ``priority`` / ``retain_s`` as in ``runner.stream``,
the weights check at submit, and functions run on the engine thread between steps (``call_soon``)."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.chat import prepare_chat, submit_chat
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import LlamaModel, build_model
from prefixcache.testing import ScriptedModel, assert_quiescent, greedy_reference, snapshot

CALL = '<tool_call>\n{"name": "search", "arguments": {"q": "kv cache"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
SYSTEM = {"role": "system", "content": "Be useful. " * 10}


def scripted_runner(*texts: str) -> PrefixCachingRunner:
    return PrefixCachingRunner(ScriptedModel.from_texts(texts), cache_tokens=8192, block_size=4)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serial_stream(runner: PrefixCachingRunner, prompt: list[int], stop_at: int, max_new_tokens: int):
    """``runner.stream`` sent ``"stop"`` after its ``stop_at``-th token (1-based)."""
    steps = runner.stream(prompt, SamplingParams(max_new_tokens=max_new_tokens))
    count = 0
    try:
        next(steps)
        while True:
            count += 1
            steps.send("stop" if count == stop_at else None)
    except StopIteration as done:
        return done.value


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
@pytest.mark.parametrize("stop_at", [1, 3, 7])
def test_on_token_returning_true_ends_the_request_as_a_stream_sent_stop(
    tiny: LlamaModel, policy: str, stop_at: int
) -> None:
    prompt = _ids(23, 1)
    serial_runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    expected = serial_stream(serial_runner, prompt, stop_at, 10)
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner, policy=policy)
    seen: list[int] = []

    def on_token(token: int) -> bool:
        seen.append(token)
        return len(seen) == stop_at

    handle = engine.submit(prompt, SamplingParams(max_new_tokens=10), on_token=on_token)
    other = engine.submit(_ids(9, 2), SamplingParams(max_new_tokens=5))
    engine.run_until_idle()
    result = handle.result()
    assert result.token_ids == expected.token_ids == tuple(seen)
    assert result.finish_reason == expected.finish_reason == "stop"
    assert other.result().finish_reason == "length"
    # The prompt and the tokens before the stopping one are cached; the stopping token's K/V were never computed.
    sequence = prompt + list(result.token_ids)
    cached = [r.cache.cached_length(sequence, r.namespace_key(None)) for r in (runner, serial_runner)]
    assert cached == [len(sequence) - 1] * 2
    assert_quiescent(runner.cache)


def test_an_on_token_error_fails_only_its_request_and_frees_its_blocks(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)

    def explode(token: int) -> bool:
        raise ValueError("sink broke")

    failing = engine.submit(_ids(12, 3), SamplingParams(max_new_tokens=4), on_token=explode)
    fine = engine.submit(_ids(12, 4), SamplingParams(max_new_tokens=4))
    engine.run_until_idle()
    with pytest.raises(ValueError, match="sink broke"):
        failing.result()
    assert len(fine.result().token_ids) == 4
    assert_quiescent(runner.cache)


def test_request_id_priority_and_host_tier_reach_the_cache(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)
    prompt = _ids(40, 5)
    engine.submit(prompt, SamplingParams(max_new_tokens=2), request_id="r1", priority=2)
    engine.run_until_idle()
    assert runner.cache.stats().retained_tokens == 40
    again = engine.submit(prompt + [7], SamplingParams(max_new_tokens=1), request_id="r1")
    engine.run_until_idle()
    assert again.result().usage.cached_tokens == 40
    assert runner.cache.stats().self_hit_tokens == 40
    assert again.result().usage.host_cached_tokens == 0
    assert_quiescent(runner.cache)


def test_usage_counts_tokens_promoted_from_the_host_tier_as_the_runner_does(tiny: LlamaModel) -> None:
    document = list(range(1, 300))

    def pressed() -> PrefixCachingRunner:
        runner = PrefixCachingRunner(tiny, cache_tokens=512, host_cache_tokens=8192)
        runner.prefill(document)
        runner.prefill(list(range(300, 512)) * 2)  # pushes most of the document into the host tier
        return runner

    expected = pressed().generate(document + [7], SamplingParams(max_new_tokens=2)).usage
    runner = pressed()
    engine = BatchEngine(runner)
    handle = engine.submit(document + [7], SamplingParams(max_new_tokens=2))
    engine.run_until_idle()
    usage = handle.result().usage
    assert usage.host_cached_tokens == expected.host_cached_tokens > 0
    assert usage.cached_tokens == expected.cached_tokens
    assert_quiescent(runner.cache)


def test_bad_retention_is_refused_at_submit_and_queues_nothing(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)
    before = snapshot(runner.cache, [runner.namespace_key(None)])
    for options in ({"retain_s": 5.0}, {"priority": 0}, {"priority": 1, "retain_s": -1}):
        with pytest.raises(InvalidArgumentError):
            engine.submit(_ids(5, 6), SamplingParams(max_new_tokens=1), **options)
    assert engine.num_pending == 0 and not engine.step()
    assert snapshot(runner.cache, [runner.namespace_key(None)]) == before


def test_a_weight_change_seen_at_submit_starts_a_new_namespace() -> None:
    model = build_model("tiny", device="cpu")
    runner = PrefixCachingRunner(model, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)
    prompt = _ids(20, 7)
    engine.submit(prompt, SamplingParams(max_new_tokens=1))
    engine.run_until_idle()
    before = runner.fingerprint
    with torch.no_grad():
        model.layers[0].qkv.mul_(1.5)
    handle = engine.submit(prompt, SamplingParams(max_new_tokens=3))
    engine.run_until_idle()
    assert runner.fingerprint != before
    assert handle.result().usage.cached_tokens == 0
    assert list(handle.result().token_ids) == greedy_reference(model, prompt, 3)[0]


def test_call_soon_runs_between_steps_on_the_engine_thread(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)
    engine.start()
    try:
        handle = engine.submit(_ids(30, 8), SamplingParams(max_new_tokens=20))
        seen = engine.call_soon(lambda: (threading.current_thread().name, engine._step_lock.locked())).result(30)
        assert seen == ("prefixcache-batch-engine", True)  # inside step(), before its forward
        with pytest.raises(ZeroDivisionError):
            engine.call_soon(lambda: 1 / 0).result(30)
        assert len(handle.result(30).token_ids) == 20
        assert engine.wait_idle(30) and engine.num_pending == 0
    finally:
        engine.close()
    with pytest.raises(InvalidArgumentError):
        engine.call_soon(lambda: None)
    assert_quiescent(runner.cache)


def test_a_running_call_counts_as_pending_work(tiny: LlamaModel) -> None:
    engine = BatchEngine(PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4))
    engine.start()
    started, release = threading.Event(), threading.Event()
    try:
        done = engine.call_soon(lambda: (started.set(), release.wait(30))[1])
        assert started.wait(30)
        assert engine.num_pending == 1 and not engine.wait_idle(0.05)
        release.set()
        assert done.result(30) is True and engine.wait_idle(30) and engine.num_pending == 0
    finally:
        release.set()
        engine.close()


def test_close_cancels_queued_calls_and_requests(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)
    call = engine.call_soon(lambda: "never")
    handle = engine.submit(_ids(8, 9), SamplingParams(max_new_tokens=3))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        call.result(1)
    with pytest.raises(CancelledError):
        handle.result(1)
    assert engine.cancelled_requests == 1
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("stepping", ["background", "caller"])
def test_close_called_on_the_stepping_thread_cancels_every_request_and_returns(tiny: LlamaModel, stepping: str) -> None:
    """``close()`` from an ``on_token`` callback (a client's code, on the thread that steps) must neither join its own
    thread nor wait for the step lock that thread holds: the step ends, then every request is cancelled."""
    runner = PrefixCachingRunner(tiny, cache_tokens=1024, block_size=4)
    engine = BatchEngine(runner)

    def close_at_first_token(token: int) -> bool:
        engine.close()
        return False

    handles = [engine.submit(_ids(8, 1), SamplingParams(max_new_tokens=5), on_token=close_at_first_token)]
    handles += [engine.submit(_ids(8, 2 + i), SamplingParams(max_new_tokens=5)) for i in range(2)]
    if stepping == "background":
        engine.start()
        thread = engine._thread
    else:
        thread = threading.Thread(target=engine.run_until_idle, daemon=True)
        thread.start()
    thread.join(30)

    assert not thread.is_alive()
    for handle in handles:
        with pytest.raises(CancelledError):
            handle.result(30)
    assert engine.cancelled_requests == 3 and engine.num_pending == 0
    assert_quiescent(runner.cache)
    with pytest.raises(InvalidArgumentError, match="closed"):
        engine.call_soon(lambda: None)


SCRIPTS = [
    "Thought: search it\nAction: search\nObservation: found",
    "Searching.\n" + CALL,
    "It is a radix tree. Observation: none",
    "plain answer without stops",
]


def conversation(turns: int, question: str) -> list[dict]:
    """``turns`` earlier exchanges, then ``question``: the scripted model answers with ``SCRIPTS[turns]``."""
    earlier = [
        m for k in range(turns) for m in ({"role": "user", "content": f"q{k}"}, {"role": "assistant", "content": "ok"})
    ]
    return [SYSTEM, *earlier, {"role": "user", "content": question}]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chosen=st.lists(st.tuples(st.integers(0, len(SCRIPTS) - 1), st.sampled_from("ab")), min_size=1, max_size=6),
    stop=st.sampled_from([None, "Observation:", ["Observation:", "tree"], "e"]),
    max_new_tokens=st.integers(1, 80),
    policy=st.sampled_from(["lpm", "fcfs"]),
    steps_between=st.integers(0, 3),
)
def test_concurrent_chats_equal_serial_runner_chat(chosen, stop, max_new_tokens, policy, steps_between) -> None:
    # Conversations sharing the system prompt and their earlier turns; tools on every request.
    chats = [conversation(turns, question) for turns, question in chosen]
    serial = scripted_runner(*SCRIPTS)
    expected = [serial.chat(chat, TOOLS, stop=stop, max_new_tokens=max_new_tokens) for chat in chats]
    runner = scripted_runner(*SCRIPTS)
    engine = BatchEngine(runner, policy=policy, max_batch_tokens=64)
    streamed: list[list[str]] = [[] for _ in chats]
    futures = []
    for i, chat in enumerate(chats):
        prepared = prepare_chat(runner.tokenizer, chat, TOOLS, stop=stop, max_new_tokens=max_new_tokens)
        futures.append(submit_chat(engine, prepared, on_delta=streamed[i].append)[1])
        for _ in range(steps_between):
            engine.step()
    engine.run_until_idle()
    for want, future, pieces in zip(expected, futures, streamed, strict=True):
        got = future.result()
        assert (got.content or "", got.tool_calls, got.finish_reason) == (
            want.text,
            want.tool_calls,
            want.finish_reason,
        )
        assert got.token_ids == want.token_ids
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        if not got.tool_calls:
            assert "".join(pieces) == want.text
    assert_quiescent(runner.cache)
    runner.cache.check_invariants()


def test_a_fault_inside_a_step_fails_its_requests_and_the_engine_keeps_serving(
    tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=4096, block_size=4)
    engine = BatchEngine(runner)
    faults = iter([RuntimeError("a bug in planning")])
    plan = engine.core._plan

    def faulty_plan():
        fault = next(faults, None)
        if fault is not None:
            raise fault
        return plan()

    monkeypatch.setattr(engine.core, "_plan", faulty_plan)
    engine.start()
    try:
        first = engine.submit(_ids(30, 1), SamplingParams(max_new_tokens=4))
        with pytest.raises(RuntimeError, match="a bug in planning"):
            first.result(timeout=60)
        assert engine.wait_idle(timeout=60)
        assert_quiescent(runner.cache)
        second = engine.submit(_ids(30, 1), SamplingParams(max_new_tokens=4))
        expected, _ = greedy_reference(tiny, _ids(30, 1), 4)
        assert list(second.result(timeout=60).token_ids) == expected
    finally:
        engine.close()
    assert_quiescent(runner.cache)
