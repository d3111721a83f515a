"""Specification of :class:`~prefixcache.engine.process.EngineProcess`: a BatchEngine in a child process answers
exactly as one on a thread of this process (text deltas, logprob records before their delta, stop strings, grammars,
plain submits), keeps the errors' types, leaves the engine as it was after bad input, cancels and frees, fails a
request whose callback raised with that error, refuses a factory that fails or does not pickle without leaving a
child behind, turns a killed child into EngineDeadError, and cancels what is pending on close().  A child that does
not read never holds a caller (submits and cancels are queued for a sender thread), and one that stops answering is
found by its heartbeat's silence once: everything in flight fails at once, and it serves on when continued."""

from __future__ import annotations

import functools
import json
import os
import pickle
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import pytest

from prefixcache import SamplingParams
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.chat import prepare_chat, prepare_completion, submit_chat
from prefixcache.engine.process import EngineProcess
from prefixcache.errors import (
    CapacityError,
    EngineDeadError,
    InvalidArgumentError,
    InvalidTokensError,
    NamespaceError,
)
from prefixcache.models.llama import build_model
from prefixcache.testing import assert_engine_quiescent, require_extra, tiny_runner

CACHE_TOKENS = 4096
FACTORY = functools.partial(tiny_runner, CACHE_TOKENS)
"""Module-level (prefixcache.testing), so that the child imports it; the same runner the in-thread engine gets."""
ENGINE = {"max_batch_tokens": 64}
ASK = [{"role": "system", "content": "Be brief. " * 6}, {"role": "user", "content": "Say hello to the world."}]
WAIT_S = 120  # how long a test waits for an answer before it fails instead of hanging (not a timing assertion)
LONG = {"max_new_tokens": 3000, "ignore_eos": True}  # a request that runs until cancelled or its engine goes


@pytest.fixture(scope="module")
def remote() -> Iterator[EngineProcess]:
    """One engine process for the module's tests that neither kill nor close it."""
    process = EngineProcess(FACTORY, **ENGINE)
    yield process
    process.close()


@pytest.fixture(scope="module")
def local() -> Iterator[BatchEngine]:
    """The reference: a BatchEngine on a thread of this process over an identically built runner."""
    engine = BatchEngine(FACTORY(), **ENGINE)
    engine.start()
    yield engine
    engine.close()


def run_chat(engine: Any, prepared: Any, namespace: str) -> tuple[Any, list[tuple[str, Any]]]:
    """The ChatCompletion of ``prepared`` on ``engine`` and its callbacks' events, in order: ``("delta", text)`` and
    ``("logprob", record)``."""
    events: list[tuple[str, Any]] = []
    _, future = submit_chat(
        engine,
        prepared,
        namespace=namespace,
        on_delta=lambda text: events.append(("delta", text)),
        on_logprob=lambda record: events.append(("logprob", record)),
    )
    return future.result(WAIT_S), events


def assert_same_completion(got: Any, expected: Any) -> None:
    assert got.content == expected.content
    assert got.token_ids == expected.token_ids
    assert got.finish_reason == expected.finish_reason
    assert got.tool_calls == expected.tool_calls
    assert got.logprobs == expected.logprobs
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens
    assert got.usage.cached_tokens == expected.usage.cached_tokens
    assert got.usage.generated_tokens == expected.usage.generated_tokens


def baseline(process: EngineProcess) -> tuple[int, int, int]:
    """What a rejected request must leave as it was: used blocks, locked tokens, pending requests."""
    stats = process.cache.stats()
    return stats.used_blocks, stats.locked_tokens, process.num_pending


def assert_freed(process: EngineProcess) -> None:
    """Nothing pending, nothing locked, no block owned by a request: every used block is the tree's (checked in the
    child, on its engine thread between two steps)."""
    assert process.num_pending == 0
    process.call(assert_engine_quiescent).result(WAIT_S)


def started(process: EngineProcess, **sampling: Any) -> tuple[Any, Any]:
    """A long chat request on ``process`` once its first text delta has arrived here (so it is running)."""
    first = threading.Event()
    prepared = prepare_chat(process.tokenizer, ASK, **LONG, **sampling)
    handle, future = submit_chat(process, prepared, on_delta=lambda text: first.set())
    assert first.wait(WAIT_S), "the long request never produced a delta"
    return handle, future


def children_of(pid: int) -> set[int]:
    """The ids of the live (not zombie) processes whose parent is ``pid``, from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.add(int(entry.name))
    return found


# -- exactness ---------------------------------------------------------------------------------------------------------


def test_a_chat_with_logprobs_streams_and_ends_exactly_as_in_process(remote: EngineProcess, local: BatchEngine) -> None:
    def prepared():
        return prepare_chat(remote.tokenizer, ASK, max_new_tokens=24, logprobs=3)

    expected, expected_events = run_chat(local, prepared(), "chat")
    got, events = run_chat(remote, prepared(), "chat")
    assert_same_completion(got, expected)
    assert got.usage.generated_tokens == 24 and len(got.logprobs) == 24
    assert events == expected_events  # the same deltas, the same records, each record before the delta it is part of
    assert "".join(text for kind, text in events if kind == "delta") == got.content
    assert tuple(record for kind, record in events if kind == "logprob") == got.logprobs
    assert events[0][0] == "logprob"
    # A repeat hits the cache in both engines alike.
    again, _ = run_chat(remote, prepared(), "chat")
    assert again.usage.cached_tokens == again.usage.prompt_tokens - 1
    assert_same_completion(again, run_chat(local, prepared(), "chat")[0])


def test_a_completion_with_logprobs_equals_the_in_process_one(remote: EngineProcess, local: BatchEngine) -> None:
    prompt = ByteTokenizer().encode("Once upon a time, in a land far away,")

    def prepared():
        return prepare_completion(remote.tokenizer, prompt, max_new_tokens=20, logprobs=2)

    expected, expected_events = run_chat(local, prepared(), "completion")
    got, events = run_chat(remote, prepared(), "completion")
    assert_same_completion(got, expected)
    assert got.usage.generated_tokens == 20
    assert events == expected_events
    assert "".join(text for kind, text in events if kind == "delta") == got.content


def test_a_plain_submit_returns_the_in_process_result(remote: EngineProcess, local: BatchEngine) -> None:
    sampling = SamplingParams(max_new_tokens=12, logprobs=1)
    prompt = list(range(40, 90))
    expected = local.submit(prompt, sampling, namespace="plain").result(WAIT_S)
    got = remote.submit(prompt, sampling, namespace="plain").result(WAIT_S)
    assert got.token_ids == expected.token_ids and len(got.token_ids) == 12
    assert got.finish_reason == expected.finish_reason == "length"
    assert got.logprobs == expected.logprobs
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens == 50
    assert got.usage.generated_tokens == expected.usage.generated_tokens
    assert got.insert is None  # the child's tree record stays there


def test_a_stop_string_ends_the_request_as_in_process(remote: EngineProcess, local: BatchEngine) -> None:
    free, _ = run_chat(local, prepare_chat(remote.tokenizer, ASK, max_new_tokens=40), "stop-free")
    text = free.content
    # A stop string of two printable ASCII characters (a byte token each: the text before it is streamed before it
    # arrives) whose first occurrence is in the middle of the greedy answer.
    cut = next(
        i
        for i in range(len(text) // 3, len(text) - 2)
        if text.index(text[i : i + 2]) == i and all(c.isascii() and c.isprintable() for c in text[i : i + 2])
    )
    stop = text[cut : cut + 2]

    def prepared():
        return prepare_chat(remote.tokenizer, ASK, max_new_tokens=40, stop=[stop], logprobs=1)

    expected, expected_events = run_chat(local, prepared(), "stop")
    got, events = run_chat(remote, prepared(), "stop")
    assert expected.content == text[:cut] and expected.finish_reason == "stop"
    assert expected.usage.generated_tokens < free.usage.generated_tokens
    assert_same_completion(got, expected)
    # The records of the tokens the stop string cut reach on_logprob too, after the last delta.
    assert expected_events[-1][0] == "logprob"
    assert events == expected_events
    assert tuple(record for kind, record in events if kind == "logprob") == got.logprobs


def test_structured_outputs_cross_as_their_source_and_match_in_process(
    remote: EngineProcess, local: BatchEngine
) -> None:
    require_extra("llguidance", "structured")
    city = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "big": {"type": "boolean"}}}
    city.update(required=["name", "big"], additionalProperties=False)
    ask = [{"role": "user", "content": "Describe a city as JSON."}]
    formats = {
        "json_object": {"type": "json_object"},
        "json_schema": {"type": "json_schema", "json_schema": {"name": "city", "schema": city, "strict": True}},
    }
    answers = {}
    for name, response_format in formats.items():

        def prepared(response_format=response_format):
            return prepare_chat(remote.tokenizer, ask, max_new_tokens=100, response_format=response_format)

        expected, _ = run_chat(local, prepared(), name)
        got, events = run_chat(remote, prepared(), name)
        assert_same_completion(got, expected)
        assert "".join(text for kind, text in events if kind == "delta") == got.content
        answers[name] = got
    assert answers["json_object"].content.startswith("{")
    if answers["json_object"].finish_reason == "stop":
        assert isinstance(json.loads(answers["json_object"].content), dict)
    assert answers["json_schema"].finish_reason == "stop"
    parsed = json.loads(answers["json_schema"].content)
    assert set(parsed) == {"name", "big"} and isinstance(parsed["big"], bool) and len(parsed["name"]) <= 8


def test_the_tokenizer_note_and_functions_run_in_the_child(remote: EngineProcess) -> None:
    assert remote.tokenizer.encode("héllo") == ByteTokenizer().encode("héllo")
    assert remote.note == ""  # the factory returned a bare runner
    assert Path(f"/proc/{remote.pid}/task/{remote.engine_thread_id}").exists()
    assert remote.alive and remote.pid != os.getpid()
    assert remote.query(getattr, "max_batch_tokens") == 64
    assert remote.call(getattr, "policy").result(WAIT_S) == "lpm"
    with pytest.raises(AttributeError, match="no_such_attribute"):
        remote.query(getattr, "no_such_attribute")
    with pytest.raises(AttributeError, match="no_such_attribute"):
        remote.call(getattr, "no_such_attribute").result(WAIT_S)
    assert remote.cache.stats().num_blocks == CACHE_TOKENS // 16


# -- bad input ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "options", "error"),
    [
        ([1, 2, 512], {}, InvalidTokensError),  # outside the tiny model's vocabulary of 512
        ([], {}, InvalidTokensError),
        (5, {}, InvalidTokensError),
        ("abc", {}, InvalidTokensError),
        ([1, 2, 3], {"sampling": SamplingParams(max_new_tokens=CACHE_TOKENS)}, CapacityError),
        ([1, 2, 3], {"namespace": 5}, NamespaceError),
        ([1, 2, 3], {"sampling": "greedy"}, InvalidArgumentError),
        ([1, 2, 3], {"request_id": 7}, InvalidArgumentError),
    ],
)
def test_bad_input_fails_with_the_in_process_error_and_changes_nothing(
    remote: EngineProcess, local: BatchEngine, prompt: Any, options: dict[str, Any], error: type
) -> None:
    before = baseline(remote)
    with pytest.raises(error) as expected:
        local.submit(prompt, **options)
    # The submit does not wait for the child: its refusal is the handle's error.
    with pytest.raises(error) as raised:
        remote.submit(prompt, **options).result(WAIT_S)
    assert type(raised.value) is type(expected.value)
    assert str(raised.value) == str(expected.value)
    assert baseline(remote) == before
    assert_freed(remote)
    # The engine serves on.
    assert remote.submit([1, 2, 3], SamplingParams(max_new_tokens=2)).result(WAIT_S).finish_reason == "length"


def test_per_token_callbacks_are_refused_before_anything_is_sent(remote: EngineProcess) -> None:
    before = baseline(remote)
    for option in ("on_token", "on_logprob"):
        with pytest.raises(InvalidArgumentError, match="do not cross to an engine process"):
            remote.submit([1, 2, 3], SamplingParams(max_new_tokens=2), **{option: print})
    assert baseline(remote) == before


# -- cancel and failing callbacks -------------------------------------------------------------------------------------


def test_a_cancelled_request_ends_cancelled_and_frees_its_blocks(remote: EngineProcess) -> None:
    cancelled = remote.cancelled_requests
    handle, future = started(remote)
    assert remote.num_pending == 1
    with pytest.raises(AssertionError, match="locked"):  # its prompt's cached blocks, while it runs
        remote.call(assert_engine_quiescent).result(WAIT_S)
    handle.cancel()
    with pytest.raises(CancelledError):
        future.result(WAIT_S)
    assert handle.cancelled
    assert remote.cancelled_requests == cancelled + 1
    assert_freed(remote)
    handle.cancel()  # harmless once it has ended
    assert remote.cancelled_requests == cancelled + 1


def test_a_plain_submit_is_cancelled_too(remote: EngineProcess) -> None:
    cancelled = remote.cancelled_requests
    handle = remote.submit(list(range(10, 30)), SamplingParams(**LONG))
    handle.cancel()
    with pytest.raises(CancelledError):
        handle.result(WAIT_S)
    assert remote.cancelled_requests == cancelled + 1
    assert_freed(remote)


def test_futures_cancelled_by_their_holder_leave_the_engine_serving(remote: EngineProcess) -> None:
    # asyncio.wrap_future cancels the concurrent future when the task awaiting it is cancelled (a server's snapshot
    # task at shutdown): its outcome must not stop the process's receiver, as in-process it does not stop the engine.
    cancelled = remote.cancelled_requests
    handle = remote.submit(list(range(10, 30)), SamplingParams(**LONG))
    assert handle.future.cancel()
    handle.cancel()  # reaches the child all the same, as in-process
    evicting = remote.evict_all()
    evicting.cancel()
    # Each call runs between two steps: the second in a step after the one that dropped the request, whose end the
    # receiver has therefore read before the second's.
    for _ in range(2):
        assert remote.call(getattr, "policy").result(WAIT_S) == "lpm"
    assert remote.cancelled_requests == cancelled + 1
    assert_freed(remote)
    assert remote.submit([1, 2, 3], SamplingParams(max_new_tokens=2)).result(WAIT_S).finish_reason == "length"


@pytest.mark.parametrize("boom", [ValueError("the client's callback failed"), SystemExit(3)])
def test_a_callback_that_raises_fails_its_request_with_that_error(remote: EngineProcess, boom: BaseException) -> None:
    # Even a SystemExit (as on the engine thread in-process): the receiver thread serves the other requests on.
    cancelled = remote.cancelled_requests

    def on_delta(text: str) -> None:
        raise boom

    prepared = prepare_chat(remote.tokenizer, ASK, **LONG)
    handle, future = submit_chat(remote, prepared, on_delta=on_delta)
    with pytest.raises(type(boom)) as raised:
        future.result(WAIT_S)
    assert raised.value is boom
    assert handle.cancelled and remote.cancelled_requests == cancelled + 1  # the child dropped it as a cancel
    assert_freed(remote)
    assert remote.submit([1, 2, 3], SamplingParams(max_new_tokens=2)).result(WAIT_S).finish_reason == "length"


def test_an_on_logprob_that_raises_fails_its_request_too(remote: EngineProcess) -> None:
    def on_logprob(record: Any) -> None:
        raise KeyError(record.token_id)

    prepared = prepare_chat(remote.tokenizer, ASK, logprobs=1, **LONG)
    _, future = submit_chat(remote, prepared, on_logprob=on_logprob)
    with pytest.raises(KeyError):
        future.result(WAIT_S)
    assert_freed(remote)


# -- snapshots ---------------------------------------------------------------------------------------------------------


def test_a_snapshot_saved_evicted_and_loaded_through_the_process_hits_again(
    remote: EngineProcess, tmp_path: Path
) -> None:
    pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")

    def prepared():
        return prepare_chat(remote.tokenizer, ASK, max_new_tokens=8)

    first, _ = run_chat(remote, prepared(), "snapshot")
    saved = remote.save_snapshot(tmp_path).result(WAIT_S)
    assert saved.num_tokens == remote.cache.stats().cached_tokens > 0
    remote.evict_all().result(WAIT_S)
    assert remote.cache.stats().cached_tokens == 0
    loaded = remote.load_snapshot(tmp_path).result(WAIT_S)
    assert loaded.num_tokens == saved.num_tokens
    assert remote.cache.stats().cached_tokens == saved.num_tokens
    again, _ = run_chat(remote, prepared(), "snapshot")
    assert again.usage.cached_tokens == again.usage.prompt_tokens - 1
    assert again.content == first.content and again.token_ids == first.token_ids


# -- factories ---------------------------------------------------------------------------------------------------------


def test_a_factory_that_raises_fails_the_constructor_with_its_error_and_leaves_no_child() -> None:
    factory = functools.partial(build_model, "no-such-preset")
    with pytest.raises(InvalidArgumentError) as expected:
        factory()
    before = children_of(os.getpid())
    with pytest.raises(InvalidArgumentError) as raised:
        EngineProcess(factory)
    assert str(raised.value) == str(expected.value)
    assert children_of(os.getpid()) == before


def test_a_child_that_exits_while_starting_is_an_engine_dead_error() -> None:
    before = children_of(os.getpid())
    with pytest.raises(EngineDeadError, match="exit code 3"):
        EngineProcess(functools.partial(os._exit, 3))
    assert children_of(os.getpid()) == before


def test_an_unpicklable_factory_is_refused_at_construction_and_leaves_no_child() -> None:
    before = children_of(os.getpid())
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        EngineProcess(lambda: tiny_runner(CACHE_TOKENS))
    assert children_of(os.getpid()) == before


# -- a killed child, close ---------------------------------------------------------------------------------------------


def test_a_killed_child_fails_what_it_held_and_every_later_call_with_engine_dead_error() -> None:
    process = EngineProcess(FACTORY, **ENGINE)
    try:
        handle, future = started(process)
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exit code -9"):
            future.result(WAIT_S)
        assert not process.alive
        handle.cancel()  # harmless on a dead engine
        with pytest.raises(EngineDeadError):
            process.submit([1, 2, 3])
        with pytest.raises(EngineDeadError):
            submit_chat(process, prepare_chat(process.tokenizer, ASK, max_new_tokens=2))
        with pytest.raises(EngineDeadError):
            process.num_pending  # noqa: B018 - a round trip to the child
        with pytest.raises(EngineDeadError):
            process.cache.stats()
        with pytest.raises(EngineDeadError):
            process.evict_all()
    finally:
        process.close()
    process.close()  # idempotent
    assert not process.alive
    assert process.pid not in children_of(os.getpid())
    with pytest.raises(InvalidArgumentError, match="the engine is closed"):
        process.submit([1, 2, 3])


def test_close_cancels_what_is_pending_ends_the_child_and_refuses_later_requests() -> None:
    process = EngineProcess(FACTORY, **ENGINE)
    try:
        _, future = started(process)
        plain = process.submit([1, 2, 3], SamplingParams(**LONG))
    finally:
        process.close()
    with pytest.raises(CancelledError):
        future.result(WAIT_S)
    with pytest.raises(CancelledError):
        plain.result(WAIT_S)
    assert not process.alive
    assert process.pid not in children_of(os.getpid())
    with pytest.raises(InvalidArgumentError, match="the engine is closed"):
        process.submit([1, 2, 3])
    with pytest.raises(InvalidArgumentError, match="the engine is closed"):
        submit_chat(process, prepare_chat(process.tokenizer, ASK, max_new_tokens=2))
    with pytest.raises(InvalidArgumentError, match="the engine is closed"):
        process.call(getattr, "steps")
    process.close()  # idempotent


def test_errors_with_their_own_fields_cross_the_process_boundary_as_themselves() -> None:
    from prefixcache.engine.process_wire import portable
    from prefixcache.errors import PoolBusyError, SnapshotWriteError

    busy = PoolBusyError(3, free_blocks=1, evictable_blocks=0, locked_blocks=2, owned_blocks=1, pool_blocks=4, what="x")
    copy = pickle.loads(pickle.dumps(portable(busy)))
    assert type(copy) is PoolBusyError and str(copy) == str(busy)
    assert (copy.needed_blocks, copy.locked_blocks, copy.pool_blocks, copy.what) == (3, 2, 4, "x")
    written = pickle.loads(pickle.dumps(portable(SnapshotWriteError("disk full", 28))))
    assert type(written) is SnapshotWriteError and str(written) == "disk full" and written.errno == 28


def test_close_from_a_done_callback_on_the_receiver_thread_ends_the_child() -> None:
    process = EngineProcess(FACTORY, **ENGINE)
    closed = threading.Event()

    def close_here(_: Any) -> None:
        process.close()
        closed.set()

    process.submit([1, 2, 3], SamplingParams(max_new_tokens=2)).future.add_done_callback(close_here)
    assert closed.wait(WAIT_S)
    assert not process.alive
    with pytest.raises(InvalidArgumentError, match="the engine is closed"):
        process.submit([1, 2, 3])


def test_the_child_does_not_import_from_its_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # python -c puts the current folder first on sys.path; a torch.py there would run in the engine process.
    (tmp_path / "torch.py").write_text("raise SystemExit('imported from the current folder')\n")
    monkeypatch.chdir(tmp_path)
    process = EngineProcess(FACTORY, **ENGINE)
    try:
        assert process.submit([1, 2, 3], SamplingParams(max_new_tokens=2)).result(WAIT_S).usage.generated_tokens == 2
    finally:
        process.close()


def finished_within(fn: Any, seconds: float) -> tuple[bool, Any]:
    """``(True, fn())`` when ``fn()`` returns within ``seconds``, else ``(False, None)`` (it is left running on a
    daemon thread): a call that would block forever fails the test instead of hanging it."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    return bool(result), result[0] if result else None


def wait_until(condition: Any, seconds: float = WAIT_S) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_child_that_does_not_read_never_holds_a_submit_a_cancel_or_num_pending() -> None:
    # A stopped child reads nothing: a message larger than the socket's buffer (3 MB of prompt ids here) used to
    # block its sender in send_bytes, holding the lock that every later send (a server's cancels, on its event loop)
    # waited on.  The watchdog is kept out of the way (a long answer_timeout_s): this is about the sends alone.
    process = EngineProcess(FACTORY, answer_timeout_s=60.0, **ENGINE)
    big = list(range(500)) * 2000
    assert len(pickle.dumps(big)) > 2_000_000
    try:
        os.kill(process.pid, signal.SIGSTOP)
        try:
            returned, handle = finished_within(lambda: process.submit(big, SamplingParams(max_new_tokens=2)), 1.0)
            assert returned, "submit waited for the stopped child to read"
            returned, second = finished_within(lambda: process.submit([1, 2, 3], SamplingParams(**LONG)), 1.0)
            assert returned, "a second submit waited behind the first"
            assert finished_within(handle.cancel, 1.0)[0], "cancel waited for the stopped child"
            assert finished_within(second.cancel, 1.0)[0]
            # The second never left this process (the sender is still writing the first): taken back, it ended here.
            assert finished_within(lambda: process.num_pending, 1.0) == (True, 1)
        finally:
            os.kill(process.pid, signal.SIGCONT)
        # Once it reads again, both are answered: the large one refused by the child's checks, the other cancelled.
        with pytest.raises((CapacityError, CancelledError)):
            handle.result(WAIT_S)
        with pytest.raises(CancelledError):
            second.result(WAIT_S)
        assert process.submit([4, 5, 6], SamplingParams(max_new_tokens=2)).result(WAIT_S).usage.generated_tokens == 2
    finally:
        process.close()


def test_a_stopped_child_fails_every_request_and_call_at_once_then_serves_again_when_continued(tmp_path: Path) -> None:
    process = EngineProcess(FACTORY, answer_timeout_s=1.0, **ENGINE)
    failed_at: list[float] = []
    try:
        _, running = started(process)
        os.kill(process.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            queued = [process.submit([4, 5, 6 + i], SamplingParams(max_new_tokens=2)) for i in range(3)]
            calls = [process.call(getattr, "policy"), process.save_snapshot(tmp_path / "snapshot")]
            futures = [running, *(handle.future for handle in queued), *calls]
            for future in futures:
                future.add_done_callback(lambda _: failed_at.append(time.monotonic()))
            for future in futures:
                with pytest.raises(EngineDeadError, match="did not answer within 1.0 s"):
                    future.result(WAIT_S)
            # Detected once, by the heartbeat's silence: all at one moment, not one timeout after another.
            assert len(failed_at) == len(futures)
            assert max(failed_at) - min(failed_at) < 0.5
            assert max(failed_at) - stopped_at < 10  # a bound on a hang, not a timing: 1 s plus a heartbeat
            assert not process.alive
            # While it is silent, what needs it fails at once.
            refused_at = time.monotonic()
            with pytest.raises(EngineDeadError, match="did not answer within 1.0 s"):
                process.submit([7, 8, 9], SamplingParams(max_new_tokens=2))
            with pytest.raises(EngineDeadError, match="did not answer within 1.0 s"):
                _ = process.num_pending
            with pytest.raises(EngineDeadError, match="did not answer within 1.0 s"):
                process.query(getattr, "num_pending")
            assert time.monotonic() - refused_at < 1.0
        finally:
            os.kill(process.pid, signal.SIGCONT)
        # Heard again, it serves on; the requests failed meanwhile were cancelled in the child.
        assert wait_until(lambda: process.alive), "the continued child was never heard again"
        assert process.submit([4, 5, 6], SamplingParams(max_new_tokens=2)).result(WAIT_S).usage.generated_tokens == 2
        assert wait_until(lambda: process.query(getattr, "num_pending") == 0)
        assert_freed(process)
    finally:
        process.close()


def test_an_idle_child_is_not_taken_for_a_stopped_one() -> None:
    # Nothing in flight: only the heartbeat keeps it heard, for several answer timeouts in a row.
    process = EngineProcess(FACTORY, answer_timeout_s=1.0, **ENGINE)
    try:
        time.sleep(3.0)
        assert process.alive
        assert process.num_pending == 0
        assert process.query(getattr, "num_pending") == 0
    finally:
        process.close()


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("inf"), True, "60"])
def test_an_answer_timeout_that_is_not_a_positive_number_of_seconds_is_refused(timeout_s: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="answer_timeout_s"):
        EngineProcess(FACTORY, answer_timeout_s=timeout_s)


def test_a_stopped_child_is_killed_at_close_without_waiting_for_it() -> None:
    process = EngineProcess(FACTORY, answer_timeout_s=1.0, **ENGINE)
    os.kill(process.pid, signal.SIGSTOP)
    assert wait_until(lambda: not process.alive, 30)
    closed, _ = finished_within(lambda: process.close(timeout_s=60), 5.0)
    assert closed, "close waited for a child that cannot read its close"
    assert process.pid not in children_of(os.getpid())


def test_a_snapshot_folder_that_is_not_a_path_is_the_engines_invalid_argument(remote: EngineProcess) -> None:
    with pytest.raises(InvalidArgumentError, match="path"):
        remote.save_snapshot(123).result(WAIT_S)  # type: ignore[arg-type]


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once it is stopped (the signal is delivered asynchronously: a child still running
    for a moment could admit what the test sends next)."""
    os.kill(pid, signal.SIGSTOP)
    state = lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]  # noqa: E731
    assert wait_until(lambda: state() == "T", 10), "the child did not stop"


def test_requests_failed_while_the_child_was_stopped_never_run_when_it_continues() -> None:
    # 60 prompts of 3,000 ids (about 360 KB pickled): more than the socket's buffer holds, so some wait in this
    # process's sender and the rest in the socket.  Once the watchdog has failed them, the ones still unsent are
    # dropped and the ones the child will read arrive cancelled: when it runs again it admits none of them (it used
    # to prefill them all first, as its cancels came after them).
    process = EngineProcess(FACTORY, answer_timeout_s=1.0, **ENGINE)
    try:
        assert process.query(getattr, "cancelled_requests") == 0
        stop(process.pid)
        try:
            prompts = [[(i + k) % 200 + 1 for k in range(3000)] for i in range(60)]
            handles = [process.submit(prompt, SamplingParams(max_new_tokens=2)) for prompt in prompts]
            for handle in handles:
                with pytest.raises(EngineDeadError, match="did not answer within 1.0 s"):
                    handle.result(WAIT_S)
            # The failures are settled as soon as the cancels are queued; their sender thread writes them a moment
            # later.  A child continued within that moment could read a request before its cancel (under load, seen
            # once in a full run): wait for the write, as a child stopped for a second or more always sees it.
            assert wait_until(lambda: process._cancels.unsent_bytes == 0), "the cancels were never written"
        finally:
            os.kill(process.pid, signal.SIGCONT)
        assert wait_until(lambda: process.alive), "the continued child was never heard again"
        assert process.submit([4, 5, 6], SamplingParams(max_new_tokens=2)).result(WAIT_S).usage.generated_tokens == 2
        assert process.query(getattr, "cancelled_requests") == 0  # none was admitted, so none was cancelled
        assert process.cache.stats().used_blocks <= 1  # the small request's prompt and answer, nothing of theirs
        assert_freed(process)
    finally:
        process.close()


def test_a_request_cancelled_before_it_was_sent_ends_at_once_and_is_never_sent() -> None:
    process = EngineProcess(FACTORY, answer_timeout_s=60.0, **ENGINE)
    big = list(range(1, 201)) * 5000  # 2 MB pickled: the stopped child's socket cannot take it whole
    try:
        stop(process.pid)
        try:
            first = process.submit(big, SamplingParams(max_new_tokens=2))
            queued = process.submit([1, 2, 3], SamplingParams(**LONG))
            queued.cancel()
            with pytest.raises(CancelledError):
                queued.result(1.0)  # settled here, without the child
            assert process.num_pending == 1
        finally:
            os.kill(process.pid, signal.SIGCONT)
        with pytest.raises(CapacityError):  # the child's own answer to the first: it was sent
            first.result(WAIT_S)
        assert process.query(getattr, "cancelled_requests") == 0  # the child never saw the cancelled one
        assert process.cancelled_requests == 1  # counted all the same, as in-process
        assert_freed(process)
    finally:
        process.close()


def test_the_child_heard_while_the_parent_still_starts_up_is_no_error(monkeypatch) -> None:
    """The receiver thread tells the watchdog of every message it reads: the watchdog exists before the receiver
    starts (a child heard while the parent was still making its watchdog killed the receiver, and every request then
    waited for an answer that never came)."""
    from prefixcache.engine import process as process_module

    class SlowToMake(process_module.Watchdog):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            time.sleep(0.5)  # heartbeats arrive every answer_timeout_s / 4 = 0.25 s meanwhile
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(process_module, "Watchdog", SlowToMake)
    process = EngineProcess(FACTORY, answer_timeout_s=1.0, **ENGINE)
    try:
        time.sleep(0.5)
        result = process.submit([4, 5, 6], SamplingParams(max_new_tokens=2)).result(30)  # not a timing assertion
        assert result.usage.generated_tokens == 2
    finally:
        process.close()
