"""Faults in the middle of a request: the model raising during prefill, after writing K/V, or while decoding;
the pool running dry at a chosen allocation; an insert failing; KeyboardInterrupt from inside the model.

After every fault the cache is quiescent (invariants hold, nothing locked, no block owned by a caller), holds
nothing of the failed request, and a later request for the same tokens prefills them afresh and gets exactly the
uncached output."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import GenerationResult, KVBlockPool, PrefixCachingRunner, RadixCache, SamplingParams
from prefixcache.errors import OutOfBlocksError
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import (
    FaultyModel,
    InjectedFault,
    assert_quiescent,
    fail_on_call,
    greedy_reference,
)

BLOCK_SIZE = 4
SYSTEM = list(range(1, 15))  # 14 tokens: 3 full blocks and half of a fourth
PROMPTS = [
    SYSTEM + [20, 21, 22],
    SYSTEM + [20, 21, 23, 24, 25],
    SYSTEM + [30],
    SYSTEM[:6] + [40, 41, 42, 43, 44, 45],
    [50, 51, 52, 53, 54, 55, 56],
]
MAX_NEW = 5
ATOL = 1e-4


_REFERENCE: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}


def reference(model: LlamaModel, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    key = tuple(prompt)
    if key not in _REFERENCE:
        _REFERENCE[key] = greedy_reference(model, prompt, MAX_NEW)
    return _REFERENCE[key]


def make_runner(
    model: LlamaModel, num_blocks: int = 64, block_size: int = BLOCK_SIZE
) -> tuple[PrefixCachingRunner, FaultyModel]:
    faulty = FaultyModel(model)
    return PrefixCachingRunner(faulty, num_blocks=num_blocks, block_size=block_size), faulty


def serve(runner: PrefixCachingRunner, prompt: list[int], **kwargs) -> GenerationResult:
    return runner.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW), return_logits=True, **kwargs)


def assert_exact(model: LlamaModel, prompt: list[int], result: GenerationResult) -> None:
    tokens, logits = reference(model, prompt)
    assert list(result.token_ids) == tokens
    cached = result.usage.cached_tokens
    assert torch.allclose(result.prompt_logits, logits[cached:], atol=ATOL, rtol=0)


def sequences(runner: PrefixCachingRunner) -> list[tuple[int, ...]]:
    return sorted(tuple(s) for s in runner.cache.cached_sequences(runner.namespace_key(None)))


def assert_nothing_new_cached(before: list[tuple[int, ...]], after: list[tuple[int, ...]]) -> None:
    """Every sequence cached now is a prefix of one cached before (eviction may have shortened some)."""
    for seq in after:
        assert any(old[: len(seq)] == seq for old in before), f"{seq} was cached by the failed request"


def warm(runner: PrefixCachingRunner, model: LlamaModel) -> None:
    for prompt in PROMPTS[:2]:
        assert_exact(model, prompt, serve(runner, prompt))


@pytest.mark.parametrize("scribble", [False, True], ids=["before-write", "after-write"])
def test_model_fault_during_prefill_leaves_the_cache_quiescent_and_caches_nothing(model, scribble) -> None:
    runner, faulty = make_runner(model)
    warm(runner, model)
    before = sequences(runner)
    prompt = PROMPTS[1][:-1] + [99, 98, 97]
    faulty.arm(1, scribble=scribble)

    with pytest.raises(InjectedFault):
        serve(runner, prompt)

    assert_quiescent(runner.cache)
    assert sequences(runner) == before
    faulty.arm(None)
    retry = serve(runner, prompt)
    assert retry.usage.cached_tokens == len(PROMPTS[1]) - 1  # the warm prefix, not the failed request's tokens
    assert_exact(model, prompt, retry)


@pytest.mark.parametrize("fail_at", [2, 3, MAX_NEW])
def test_model_fault_while_decoding_releases_everything_and_caches_nothing(model, fail_at) -> None:
    runner, faulty = make_runner(model)
    warm(runner, model)
    before = sequences(runner)
    prompt = SYSTEM + [60, 61, 62, 63, 64, 65]
    faulty.arm(fail_at, scribble=True)

    with pytest.raises(InjectedFault):
        serve(runner, prompt)

    assert faulty.faults == 1
    assert_quiescent(runner.cache)
    assert sequences(runner) == before
    faulty.arm(None)
    retry = serve(runner, prompt)
    assert retry.usage.cached_tokens == len(SYSTEM)
    assert_exact(model, prompt, retry)


def test_model_fault_on_teacher_forced_tokens_caches_neither_prompt_nor_answer(model) -> None:
    runner, faulty = make_runner(model)
    warm(runner, model)
    before = sequences(runner)
    prompt = SYSTEM + [70, 71]
    faulty.arm(2, scribble=True)

    with pytest.raises(InjectedFault):
        runner.generate(prompt, forced_tokens=[72, 73, 74, 75, 76])

    assert_quiescent(runner.cache)
    assert sequences(runner) == before
    faulty.arm(None)
    follow_up = prompt + [72, 73, 74, 75, 76, 77]
    retry = serve(runner, follow_up)
    assert retry.usage.cached_tokens == len(SYSTEM)
    assert_exact(model, follow_up, retry)


@pytest.mark.parametrize("fail_at", [1, 2, 4], ids=["prefill", "first-decode", "late-decode"])
def test_keyboard_interrupt_from_inside_the_model_propagates_and_releases_everything(model, fail_at) -> None:
    runner, faulty = make_runner(model)
    warm(runner, model)
    before = sequences(runner)
    faulty.arm(fail_at, exception=KeyboardInterrupt, scribble=True)

    with pytest.raises(KeyboardInterrupt):
        serve(runner, PROMPTS[2])

    assert_quiescent(runner.cache)
    assert sequences(runner) == before
    faulty.arm(None)
    assert_exact(model, PROMPTS[2], serve(runner, PROMPTS[2]))


def test_keyboard_interrupt_between_steps_of_generate_releases_at_once(model) -> None:
    """A signal can land in ``generate``'s own frame between two decode steps; the request must not stay
    suspended, holding its lock and blocks, for as long as the exception (and its traceback) is kept."""
    runner, _ = make_runner(model)
    warm(runner, model)
    code = PrefixCachingRunner.generate.__code__
    step_line = next(
        i for i, line in enumerate(inspect.getsourcelines(code)[0], code.co_firstlineno) if "next(steps)" in line
    )
    visits = 0

    def trace_lines(frame, event, arg):
        nonlocal visits
        if event == "line" and frame.f_lineno == step_line:
            visits += 1
            if visits == 3:  # after the prefill and one decode step
                raise KeyboardInterrupt
        return trace_lines

    def trace_calls(frame, event, arg):
        return trace_lines if frame.f_code is code else None

    previous = sys.gettrace()
    sys.settrace(trace_calls)
    try:
        serve(runner, SYSTEM + [20, 21, 30])
    except KeyboardInterrupt as error:
        kept = error
    finally:
        sys.settrace(previous)

    assert visits == 3 and kept.__traceback__ is not None
    assert_quiescent(runner.cache)


@pytest.mark.parametrize(
    ("prompt", "allocation"),
    [
        (SYSTEM[:6] + [80, 81, 82], 2),  # the blocks of the prompt (call 1 is its copy-on-write block)
        (SYSTEM[:6] + [80, 81, 82], 3),  # a block for a decode step crossing a block boundary
        ([90, 91, 92, 93], 1),  # no cached prefix: the prompt's blocks
        ([90, 91, 92, 93], 2),  # the first decode block
    ],
)
def test_pool_running_dry_at_a_chosen_allocation_releases_everything(model, prompt, allocation) -> None:
    runner, _ = make_runner(model)
    warm(runner, model)
    before = sequences(runner)

    with (
        fail_on_call(runner.cache._blocks, "allocate", allocation, OutOfBlocksError) as calls,
        pytest.raises(OutOfBlocksError),
    ):
        serve(runner, prompt)

    assert calls[0] == allocation
    assert_quiescent(runner.cache)
    assert sequences(runner) == before
    assert_exact(model, prompt, serve(runner, prompt))


def test_pool_dry_for_the_copy_on_write_block_recomputes_the_partial_block_instead_of_failing(model) -> None:
    runner, _ = make_runner(model)
    warm(runner, model)
    prompt = SYSTEM[:6] + [80, 81, 82]  # matches 6 tokens: one whole block and 2 rows of the next

    with fail_on_call(runner.cache._blocks, "allocate", 1, OutOfBlocksError) as calls:
        result = serve(runner, prompt)

    assert calls[0] >= 1
    assert (result.usage.cached_tokens, result.usage.copied_tokens) == (BLOCK_SIZE, 0)
    assert_exact(model, prompt, result)
    assert_quiescent(runner.cache)


def test_pool_really_exhausted_by_a_paused_stream_fails_the_newcomer_cleanly(model) -> None:
    runner, _ = make_runner(model, num_blocks=8)
    long_prompt = list(range(100, 120))  # 5 blocks, and decoding needs a sixth
    paused = runner.stream(long_prompt, SamplingParams(max_new_tokens=MAX_NEW))
    assert next(paused) == reference(model, long_prompt)[0][0]
    held = runner.cache.stats()

    with pytest.raises(OutOfBlocksError, match="locked by running requests"):
        serve(runner, PROMPTS[0])  # 17 prompt tokens need 5 blocks; only 3 are left

    assert runner.cache.stats().locked_tokens == held.locked_tokens
    assert runner.cache.pool.num_free_blocks == held.free_blocks
    runner.cache.check_invariants()
    paused.close()
    assert_quiescent(runner.cache)
    assert runner.cache.stats().cached_tokens == 0
    assert runner.cache.pool.num_free_blocks == 8


@pytest.mark.parametrize("method", ["commit", "insert_owned"])
def test_insert_failing_caches_nothing_and_releases_everything(model, method) -> None:
    runner, _ = make_runner(model)
    warm(runner, model)
    before = sequences(runner)
    prompt = SYSTEM + [20, 21, 26, 27]

    target = runner.cache if method == "commit" else runner.cache._blocks
    with fail_on_call(target, method, 1), pytest.raises(InjectedFault):
        serve(runner, prompt)

    assert_quiescent(runner.cache)
    assert sequences(runner) == before
    retry = serve(runner, prompt)
    assert retry.usage.cached_tokens == len(SYSTEM) + 2
    assert_exact(model, prompt, retry)


def test_copy_on_write_failing_in_acquire_releases_the_lock_and_the_private_block(model) -> None:
    runner, _ = make_runner(model)
    warm(runner, model)

    with fail_on_call(runner.cache.pool, "copy_rows", 1), pytest.raises(InjectedFault):
        serve(runner, SYSTEM[:6] + [80, 81, 82])

    assert_quiescent(runner.cache)


FAULTS = st.sampled_from(["none", "model", "model-scribble", "interrupt", "allocate", "insert"])
EXPECTED_ERROR = {
    "model": InjectedFault,
    "model-scribble": InjectedFault,
    "interrupt": KeyboardInterrupt,
    "allocate": OutOfBlocksError,
    "insert": InjectedFault,
}
LONGEST = max(len(p) for p in PROMPTS) + MAX_NEW  # tokens of the longest request, answer included


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(
        st.tuples(st.integers(0, len(PROMPTS) - 1), FAULTS, st.integers(1, MAX_NEW + 1), st.booleans()),
        min_size=1,
        max_size=8,
    ),
    block_size=st.integers(1, 16),
    spare_blocks=st.integers(0, 12),
)
def test_any_sequence_of_faults_leaves_the_cache_exact_and_quiescent(model, plan, block_size, spare_blocks) -> None:
    """Random requests (one of two namespaces) with a random fault at a random call in a small pool that evicts:
    after each one the cache is quiescent and adds nothing for a failed request; every success is exact, and
    a request fails exactly when its fault was reached, with the fault's own error."""
    # Enough for a request's own blocks (plus a copy-on-write block) beside the whole locked edges of its match.
    num_blocks = 2 * -(-LONGEST // block_size) + 2 + spare_blocks
    runner, faulty = make_runner(model, num_blocks=num_blocks, block_size=block_size)
    for index, kind, call, salted in plan:
        prompt = PROMPTS[index]
        namespace = "tenant" if salted else None
        key = runner.namespace_key(namespace)
        before = sorted(tuple(s) for s in runner.cache.cached_sequences(key))
        faulty.arm(call if kind in ("model", "model-scribble", "interrupt") else None, scribble=kind != "model")
        if kind == "interrupt":
            faulty.exception = KeyboardInterrupt
        # A request's commit files its blocks through insert_owned (the tree walk starts at the lease's lock).
        patch = {"allocate": "allocate", "insert": "insert_owned"}.get(kind)
        failed, faults_before = False, faulty.faults
        try:
            if patch is None:
                result = serve(runner, prompt, namespace=namespace)
            else:
                with fail_on_call(
                    runner.cache._blocks, patch, call, OutOfBlocksError if kind == "allocate" else InjectedFault
                ):
                    result = serve(runner, prompt, namespace=namespace)
        except (InjectedFault, OutOfBlocksError, KeyboardInterrupt) as error:
            failed = True
            assert type(error) is EXPECTED_ERROR.get(kind), (kind, error)
        # A request calls the model once to prefill and MAX_NEW - 1 times to decode, and inserts once.
        if kind in ("model", "model-scribble", "interrupt"):
            assert failed == (call <= MAX_NEW) == (faulty.faults == faults_before + 1)
        elif kind == "insert":
            assert failed == (call == 1)
        assert_quiescent(runner.cache)
        if failed:
            assert_nothing_new_cached(before, sorted(tuple(s) for s in runner.cache.cached_sequences(key)))
        else:
            assert_exact(model, prompt, result)
    faulty.arm(None)
    for prompt in PROMPTS:
        assert_exact(model, prompt, serve(runner, prompt))
    assert_quiescent(runner.cache)


def test_a_lone_request_that_fits_the_pool_never_runs_out_of_blocks() -> None:
    cache = RadixCache(KVBlockPool(8, BLOCK_SIZE))
    cache.insert(list(range(1, 21)), cache.allocate(5))  # one edge of 20 tokens in 5 blocks
    lease = cache.acquire([1, 2, 3, 4, 99])  # uses 1 of those blocks

    table = cache.reserve(lease, 8 * BLOCK_SIZE)  # the whole pool: the other 4 blocks must be evictable

    assert sorted(table.tolist()) == list(range(8))
    stats = cache.stats()
    assert (stats.free_blocks, stats.cached_tokens, stats.locked_tokens, stats.evicted_tokens) == (0, 4, 4, 16)
    cache.check_invariants()


def test_a_lone_request_whose_match_ends_at_an_edge_end_inside_a_block_can_use_the_whole_pool() -> None:
    cache = RadixCache(KVBlockPool(8, BLOCK_SIZE))
    cache.insert(list(range(1, 11)), cache.allocate(3))  # one edge of 10 tokens: 2 whole blocks and 2 rows
    lease = cache.acquire(list(range(1, 11)) + [99])  # shares the 2 whole blocks, extends the third in place

    table = cache.reserve(lease, 8 * BLOCK_SIZE)  # the whole pool: the edge's third block is the lease's too

    assert (lease.num_cached_tokens, lease.num_copied_tokens) == (10, 0)
    assert sorted(table.tolist()) == list(range(8))
    stats = cache.stats()
    assert (stats.free_blocks, stats.cached_tokens, stats.locked_tokens, stats.evicted_tokens) == (0, 10, 10, 0)
    cache.check_invariants()
