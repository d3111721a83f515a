"""Specification of PrefixCachingRunner: cached serving is exact, accounts for every prompt token, samples as
asked, and leaves nothing behind when a request is cancelled or fails."""

from __future__ import annotations

import math

import pytest
import torch

from prefixcache import ChatResult, PrefixCachingRunner, SamplingParams, Usage
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.errors import CapacityError, InvalidArgumentError, InvalidTokensError
from prefixcache.models import LlamaModel

TOL = 1e-4
GREEDY_NONE = SamplingParams(max_new_tokens=0)


def ids(n: int, seed: int) -> list[int]:
    """``n`` token ids a ByteTokenizer could produce (0..258), fixed by ``seed``."""
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(model: LlamaModel, prompt: list[int]) -> torch.Tensor:
    return model.forward_reference(torch.tensor(prompt, dtype=torch.long), return_logits=True).float().cpu()


def reference_greedy(model: LlamaModel, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding by full recompute of the whole sequence at every step, no cache at all."""
    sequence = list(prompt)
    for _ in range(num_tokens):
        sequence.append(int(reference_logits(model, sequence)[-1].argmax()))
    return sequence[len(prompt) :]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


def assert_nothing_held(runner: PrefixCachingRunner) -> None:
    """No lock, no request-owned block: once everything unlocked is evicted, every block is free again."""
    cache = runner.cache
    cache.check_invariants()
    assert cache.stats().locked_tokens == 0
    cache.evict_all()
    assert cache.stats().free_blocks == runner.pool.num_blocks


# (block size, cached prefix length): a prefix ending inside a block and one ending on a block boundary.
CACHED_CASES = [(1, 7), (1, 12), (4, 10), (4, 12), (16, 37), (16, 32)]
CASE_IDS = [f"bs{bs}-cached{n}-{'mid_block' if n % bs else 'boundary'}" for bs, n in CACHED_CASES]


@pytest.mark.parametrize(("block_size", "cached"), CACHED_CASES, ids=CASE_IDS)
def test_cached_prompt_logits_equal_uncached_logits(tiny: LlamaModel, block_size: int, cached: int) -> None:
    runner = PrefixCachingRunner(tiny, block_size=block_size)
    prompt = ids(cached + 9, seed=cached)
    runner.prefill(prompt[:cached])

    result = runner.generate(prompt, GREEDY_NONE, return_logits=True)

    assert result.usage.cached_tokens == cached
    assert result.prompt_logits.shape == (9, tiny.vocab_size)
    assert max_diff(result.prompt_logits, reference_logits(tiny, prompt)[cached:]) < TOL


@pytest.mark.parametrize(("block_size", "cached"), CACHED_CASES, ids=CASE_IDS)
def test_copied_tokens_are_the_rows_of_a_partially_matched_block(
    tiny: LlamaModel, block_size: int, cached: int
) -> None:
    runner = PrefixCachingRunner(tiny, block_size=block_size)
    prompt = ids(cached + 9, seed=cached)
    # A cached branch that goes on past the match inside its last block: those rows are the branch's, so copied.
    runner.prefill([*prompt[:cached], (prompt[cached] + 1) % tiny.vocab_size, *prompt[cached + 1 :]])

    result = runner.generate(prompt, GREEDY_NONE, return_logits=True)

    assert (result.usage.cached_tokens, result.usage.copied_tokens) == (cached, cached % block_size)
    assert max_diff(result.prompt_logits, reference_logits(tiny, prompt)[cached:]) < TOL


@pytest.mark.parametrize(("block_size", "cached"), CACHED_CASES, ids=CASE_IDS)
def test_a_match_taking_all_of_a_cached_prompt_extends_its_partial_block_in_place(
    tiny: LlamaModel, block_size: int, cached: int
) -> None:
    runner = PrefixCachingRunner(tiny, block_size=block_size)
    prompt = ids(cached + 9, seed=cached)
    runner.prefill(prompt[:cached])

    result = runner.generate(prompt, GREEDY_NONE, return_logits=True)

    assert (result.usage.cached_tokens, result.usage.copied_tokens) == (cached, 0)  # no rows copied
    assert max_diff(result.prompt_logits, reference_logits(tiny, prompt)[cached:]) < TOL
    again = runner.generate(prompt, GREEDY_NONE, return_logits=True)  # through the block written in place
    assert again.usage.cached_tokens == len(prompt) - 1
    assert max_diff(again.prompt_logits, reference_logits(tiny, prompt)[-1:]) < TOL


def test_greedy_generation_with_the_cache_equals_greedy_recompute(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = ids(23, seed=1)
    runner.prefill(prompt[:10])

    result = runner.generate(prompt, SamplingParams(max_new_tokens=12))

    assert result.usage.cached_tokens == 10
    assert list(result.token_ids) == reference_greedy(tiny, prompt, 12)


def test_greedy_generation_from_a_cached_answer_repeats_itself(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = ids(13, seed=2)
    first = runner.generate(prompt, SamplingParams(max_new_tokens=10))

    again = runner.generate(prompt, SamplingParams(max_new_tokens=10))

    assert again.usage.cached_tokens == 12
    assert again.token_ids == first.token_ids


def test_greedy_generation_that_must_evict_stays_exact(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, num_blocks=8, block_size=4)
    for seed in range(10, 14):
        runner.prefill(ids(7, seed=seed))
    prompt = ids(14, seed=3)

    result = runner.generate(prompt, SamplingParams(max_new_tokens=10))

    assert runner.cache.stats().evictions > 0
    assert list(result.token_ids) == reference_greedy(tiny, prompt, 10)
    runner.cache.check_invariants()


@pytest.mark.parametrize("length", [10, 13], ids=["last_token_mid_block", "last_token_opens_a_block"])
def test_fully_cached_prompt_prefills_exactly_its_last_token(tiny: LlamaModel, length: int) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = ids(length, seed=length)
    runner.prefill(prompt)

    usage = runner.generate(prompt, GREEDY_NONE).usage

    assert (usage.cached_tokens, usage.prefilled_tokens) == (length - 1, 1)


@pytest.mark.parametrize("length", [10, 13], ids=["last_token_mid_block", "last_token_opens_a_block"])
def test_fully_cached_prompt_logits_equal_uncached_logits(tiny: LlamaModel, length: int) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = ids(length, seed=length)
    runner.prefill(prompt)

    result = runner.generate(prompt, GREEDY_NONE, return_logits=True)

    assert result.usage.prefilled_tokens == 1
    assert max_diff(result.prompt_logits, reference_logits(tiny, prompt)[-1:]) < TOL


@pytest.mark.parametrize("prefix_len", [3, 8, 19])
def test_suffix_positions_continue_from_the_cached_length(tiny: LlamaModel, prefix_len: int) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prefix, suffix = ids(prefix_len, seed=40 + prefix_len), ids(7, seed=40)
    runner.prefill(prefix)

    result = runner.generate(prefix + suffix, GREEDY_NONE, return_logits=True)

    assert result.usage.cached_tokens == prefix_len
    assert max_diff(result.prompt_logits, reference_logits(tiny, prefix + suffix)[prefix_len:]) < TOL


@pytest.mark.parametrize(("block_size", "cached"), [(4, 10), (16, 32)], ids=["mid_block", "boundary"])
def test_bf16_cached_prompt_logits_are_as_close_to_float32_as_uncached_bf16(
    tiny: LlamaModel, block_size: int, cached: int
) -> None:
    # Bounded by the measured error of the uncached bf16 path, so that prefilling the suffix at a wrong position
    # (off by one: logits move by 0.5 or more) fails, where a bound of a fraction of max|logit| would not.
    model = LlamaModel(tiny.config, dtype=torch.bfloat16, device="cpu")
    runner = PrefixCachingRunner(model, block_size=block_size)
    prompt = ids(cached + 9, seed=cached)
    runner.prefill(prompt[:cached])

    result = runner.generate(prompt, GREEDY_NONE, return_logits=True)

    exact = reference_logits(tiny, prompt)[cached:]
    rounding = max_diff(reference_logits(model, prompt)[cached:], exact)
    assert result.usage.cached_tokens == cached
    assert 0 < rounding < 0.1
    assert max_diff(result.prompt_logits, exact) <= 2 * rounding


EDIT_POINTS = [6, 8]
EDIT_IDS = ["edit_inside_a_block", "edit_at_a_block_boundary"]


def edited(conversation: list[int], k: int, length: int) -> list[int]:
    """Equal to ``conversation`` up to token ``k``, then different (token ``k`` itself differs)."""
    tail = ids(length - k, seed=100 + k)
    tail[0] = (conversation[k] + 1) % 259
    return conversation[:k] + tail


@pytest.mark.parametrize("k", EDIT_POINTS, ids=EDIT_IDS)
def test_edited_prompt_reuses_exactly_the_tokens_before_the_edit(tiny: LlamaModel, k: int) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    conversation = ids(24, seed=5)
    runner.prefill(conversation)

    usage = runner.generate(edited(conversation, k, 20), GREEDY_NONE).usage

    assert (usage.cached_tokens, usage.copied_tokens) == (k, k % 4)


@pytest.mark.parametrize("k", EDIT_POINTS, ids=EDIT_IDS)
def test_edited_prompt_output_equals_uncached_output(tiny: LlamaModel, k: int) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    conversation = ids(24, seed=5)
    runner.prefill(conversation)
    prompt = edited(conversation, k, 20)

    result = runner.generate(prompt, SamplingParams(max_new_tokens=6), return_logits=True)

    assert max_diff(result.prompt_logits, reference_logits(tiny, prompt)[k:]) < TOL
    assert list(result.token_ids) == reference_greedy(tiny, prompt, 6)
    runner.cache.check_invariants()


def test_forced_tokens_are_returned_as_the_answer(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    answer = ids(7, seed=61)

    result = runner.generate(ids(10, seed=60), forced_tokens=answer)

    assert result.token_ids == tuple(answer)
    assert result.finish_reason == "forced"
    assert result.usage.generated_tokens == 7


def test_next_turn_after_a_forced_answer_reuses_prompt_and_answer(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt, answer, more = ids(10, seed=60), ids(7, seed=61), ids(5, seed=62)
    runner.generate(prompt, forced_tokens=answer)

    usage = runner.generate(prompt + answer + more, GREEDY_NONE).usage

    assert usage.cached_tokens == 17


def test_forced_answer_kv_gives_the_uncached_logits_next_turn(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt, answer, more = ids(10, seed=60), ids(7, seed=61), ids(5, seed=62)
    runner.generate(prompt, forced_tokens=answer)
    full = prompt + answer + more

    result = runner.generate(full, GREEDY_NONE, return_logits=True)

    assert max_diff(result.prompt_logits, reference_logits(tiny, full)[17:]) < TOL


def test_empty_forced_answer_generates_nothing(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)

    result = runner.generate(ids(10, seed=60), forced_tokens=[])

    assert (result.token_ids, result.finish_reason, result.usage.generated_tokens) == ((), "forced", 0)


def usage_counts(usage: Usage) -> tuple[int, int, int, int, int]:
    return (
        usage.prompt_tokens,
        usage.cached_tokens,
        usage.prefilled_tokens,
        usage.copied_tokens,
        usage.generated_tokens,
    )


@pytest.fixture
def two_requests(tiny: LlamaModel) -> tuple[Usage, Usage]:
    """Block size 4: a 10-token prompt, then a 13-token prompt sharing its first 6 tokens; 3 new tokens each."""
    runner = PrefixCachingRunner(tiny, block_size=4)
    first = ids(10, seed=70)
    second = first[:6] + edited(first, 6, 13)[6:]
    sampling = SamplingParams(max_new_tokens=3)
    return runner.generate(first, sampling).usage, runner.generate(second, sampling).usage


def test_usage_of_a_cold_prompt(two_requests: tuple[Usage, Usage]) -> None:
    assert usage_counts(two_requests[0]) == (10, 0, 10, 0, 3)


def test_usage_of_a_prompt_sharing_six_tokens_mid_block(two_requests: tuple[Usage, Usage]) -> None:
    # 6 tokens reused: block 0 shared, 2 rows of block 1 copied; 7 prefilled.
    assert usage_counts(two_requests[1]) == (13, 6, 7, 2, 3)


def test_usage_cached_plus_prefilled_is_the_prompt(two_requests: tuple[Usage, Usage]) -> None:
    for usage in two_requests:
        assert usage.cached_tokens + usage.prefilled_tokens == usage.prompt_tokens


def test_usage_times_are_measured(two_requests: tuple[Usage, Usage]) -> None:
    for usage in two_requests:
        assert usage.ttft_s > 0 and usage.decode_s >= 0


def test_usage_to_openai(two_requests: tuple[Usage, Usage]) -> None:
    usage = two_requests[1]

    out = usage.to_openai()

    assert out == {
        "prompt_tokens": 13,
        "completion_tokens": 3,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 6},
        "prefilled_tokens": 7,
        "copied_tokens": 2,
        "host_cached_tokens": 0,
        "unresumed_tokens": 0,
        "drafted_tokens": 0,
        "accepted_tokens": 0,
        "ttft_s": usage.ttft_s,
        "decode_s": usage.decode_s,
    }


def test_prefill_caches_the_prompt_without_generating(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = ids(9, seed=80)

    usage = runner.prefill(prompt)

    assert usage_counts(usage) == (9, 0, 9, 0, 0)
    assert runner.cache.cached_sequences(runner.namespace_key(None)) == [prompt]


def test_namespaces_share_nothing(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = ids(9, seed=81)
    runner.prefill(prompt, namespace="alice")

    assert runner.generate(prompt, GREEDY_NONE, namespace="bob").usage.cached_tokens == 0
    assert runner.generate(prompt, GREEDY_NONE, namespace="alice").usage.cached_tokens == 8


def test_seeded_temperature_sampling_is_repeatable(tiny: LlamaModel) -> None:
    prompt = ids(12, seed=90)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)

    first = PrefixCachingRunner(tiny, block_size=4).generate(prompt, sampling)
    second = PrefixCachingRunner(tiny, block_size=4).generate(prompt, sampling)

    assert first.token_ids == second.token_ids


def test_different_seeds_sample_different_tokens(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = ids(12, seed=90)

    outputs = {
        runner.generate(prompt, SamplingParams(max_new_tokens=12, temperature=1.0, seed=s)).token_ids for s in range(3)
    }

    assert len(outputs) == 3


def test_tiny_top_p_is_greedy(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = ids(12, seed=91)

    nucleus = runner.generate(prompt, SamplingParams(max_new_tokens=10, temperature=1.0, top_p=1e-6, seed=3))

    assert list(nucleus.token_ids) == reference_greedy(tiny, prompt, 10)


def test_stop_token_ends_generation_and_is_kept(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = ids(12, seed=92)
    greedy = reference_greedy(tiny, prompt, 8)
    stop = greedy[3]
    expected = greedy[: greedy.index(stop) + 1]

    result = runner.generate(prompt, SamplingParams(max_new_tokens=8, stop_token_ids=frozenset({stop})))

    assert list(result.token_ids) == expected
    assert result.finish_reason == "stop"
    assert result.usage.generated_tokens == len(expected)


def test_generation_without_a_stop_token_ends_by_length(tiny: LlamaModel) -> None:
    result = PrefixCachingRunner(tiny, block_size=4).generate(ids(12, seed=92), SamplingParams(max_new_tokens=5))

    assert (len(result.token_ids), result.finish_reason) == (5, "length")


def test_max_new_tokens_zero_generates_nothing(tiny: LlamaModel) -> None:
    result = PrefixCachingRunner(tiny, block_size=4).generate(ids(12, seed=93), GREEDY_NONE)

    assert (result.token_ids, result.finish_reason, result.usage.generated_tokens) == ((), "prefill", 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": -1},
        {"max_new_tokens": 1.5},
        {"max_new_tokens": True},
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"top_p": 0.0},
        {"top_p": -0.5},
        {"top_p": 1.01},
        {"top_p": math.nan},
        {"stop_token_ids": frozenset({-1})},
    ],
    ids=repr,
)
def test_sampling_params_reject_out_of_range_values(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_edges_of_their_ranges() -> None:
    params = SamplingParams(max_new_tokens=0, temperature=0.0, top_p=1.0, stop_token_ids=[0, 5])

    assert (params.max_new_tokens, params.temperature, params.top_p) == (0, 0.0, 1.0)
    assert params.stop_token_ids == frozenset({0, 5})


@pytest.mark.parametrize("prompt", [[], [1, 512], [1, -2]], ids=["empty", "beyond_vocab", "negative"])
def test_bad_prompt_ids_are_rejected_and_leave_the_cache_as_it_was(tiny: LlamaModel, prompt: list[int]) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    runner.prefill(ids(9, seed=95))
    before = runner.cache.stats()

    with pytest.raises(InvalidTokensError):
        runner.generate(prompt)

    assert runner.cache.stats() == before
    runner.cache.check_invariants()


def test_request_larger_than_the_pool_is_a_capacity_error_and_holds_nothing(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=16, block_size=4)
    runner.prefill(ids(9, seed=96))

    with pytest.raises(CapacityError):
        runner.generate(ids(10, seed=97), SamplingParams(max_new_tokens=7))

    assert runner.cache.stats().cached_tokens == 9
    assert_nothing_held(runner)


def test_request_that_fits_an_idle_full_pool_evicts_what_it_does_not_reuse(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=16, block_size=4)
    cached = ids(16, seed=98)
    runner.prefill(cached)

    usage = runner.generate(cached[:5] + ids(11, seed=99), GREEDY_NONE).usage

    assert (usage.cached_tokens, usage.copied_tokens) == (5, 1)


def test_stream_yields_the_tokens_of_generate_and_returns_the_result(tiny: LlamaModel) -> None:
    prompt = ids(12, seed=110)
    sampling = SamplingParams(max_new_tokens=6)
    expected = PrefixCachingRunner(tiny, block_size=4).generate(prompt, sampling)
    stream = PrefixCachingRunner(tiny, block_size=4).stream(prompt, sampling)

    streamed = []
    with pytest.raises(StopIteration) as done:
        while True:
            streamed.append(next(stream))

    assert tuple(streamed) == expected.token_ids
    assert done.value.value.token_ids == expected.token_ids


def test_on_token_sees_every_token_in_order(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    seen: list[int] = []

    streamed = list(runner.stream(ids(12, seed=111), SamplingParams(max_new_tokens=5), on_token=seen.append))

    assert seen == streamed and len(seen) == 5


def test_on_token_sees_each_forced_token_as_it_is_yielded(tiny: LlamaModel) -> None:
    """Teacher forcing streams its answer one token at a time: on_token runs for a token just before the stream
    yields it, so a stream closed after its first token told on_token of that one only (it told all of them), and
    an on_token error at the second token comes after the first was yielded (none was)."""
    runner = PrefixCachingRunner(tiny, block_size=4)
    answer = ids(4, seed=112)
    seen: list[int] = []
    stream = runner.stream(ids(12, seed=111), forced_tokens=answer, on_token=seen.append)
    assert next(stream) == answer[0]
    stream.close()
    assert seen == answer[:1]

    streamed: list[int] = []
    with pytest.raises(Boom):
        for token in runner.stream(ids(12, seed=111), forced_tokens=answer, on_token=fail_on_third_token()):
            streamed.append(token)
    assert streamed == answer[:2]
    assert_nothing_held(runner)


@pytest.fixture
def cancelled(tiny: LlamaModel) -> tuple[PrefixCachingRunner, list[int]]:
    """A runner with an 8-token prefix cached, and a 15-token prompt extending it."""
    runner = PrefixCachingRunner(tiny, block_size=4)
    prompt = ids(15, seed=120)
    runner.prefill(prompt[:8])
    return runner, prompt


def test_closing_a_stream_midway_releases_every_lock_and_block(cancelled) -> None:
    runner, prompt = cancelled
    stream = runner.stream(prompt, SamplingParams(max_new_tokens=10))
    next(stream), next(stream)

    stream.close()

    assert_nothing_held(runner)


def test_closing_a_stream_midway_caches_nothing_of_it(cancelled) -> None:
    runner, prompt = cancelled
    stream = runner.stream(prompt, SamplingParams(max_new_tokens=10))
    next(stream), next(stream)

    stream.close()

    assert runner.generate(prompt, GREEDY_NONE).usage.cached_tokens == 8


class Boom(Exception):
    pass


def fail_on_third_token() -> object:
    count = 0

    def on_token(_token: int) -> None:
        nonlocal count
        count += 1
        if count == 3:
            raise Boom

    return on_token


def test_exception_from_on_token_propagates_and_releases_every_lock_and_block(cancelled) -> None:
    runner, prompt = cancelled

    with pytest.raises(Boom):
        list(runner.stream(prompt, SamplingParams(max_new_tokens=10), on_token=fail_on_third_token()))

    assert_nothing_held(runner)


def test_exception_from_on_token_caches_nothing_of_the_request(cancelled) -> None:
    runner, prompt = cancelled

    with pytest.raises(Boom):
        list(runner.stream(prompt, SamplingParams(max_new_tokens=10), on_token=fail_on_third_token()))

    assert runner.generate(prompt, GREEDY_NONE).usage.cached_tokens == 8


def test_exception_from_on_token_during_forced_tokens_caches_nothing(cancelled) -> None:
    runner, prompt = cancelled

    with pytest.raises(Boom):
        list(runner.stream(prompt, forced_tokens=ids(6, seed=121), on_token=fail_on_third_token()))

    assert runner.generate(prompt, GREEDY_NONE).usage.cached_tokens == 8
    assert_nothing_held(runner)


SYSTEM = {"role": "system", "content": "You are a terse assistant who answers in one short sentence."}


def test_chat_prompt_is_the_rendered_template(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    messages = [SYSTEM, {"role": "user", "content": "Name a colour."}]

    result = runner.chat(messages, max_new_tokens=6)

    assert result.usage.prompt_tokens == len(ByteTokenizer().render_chat(messages, add_generation_prompt=True))


def test_chat_text_is_the_decoded_tokens_without_stop_tokens(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    tokenizer = ByteTokenizer()

    result = runner.chat([SYSTEM, {"role": "user", "content": "Name a colour."}], max_new_tokens=6)

    assert isinstance(result, ChatResult)
    assert len(result.token_ids) == result.usage.generated_tokens > 0
    assert all(t < tokenizer.vocab_size for t in result.token_ids)
    kept = [t for t in result.token_ids if t not in tokenizer.eos_token_ids]
    assert result.text == tokenizer.decode(kept)


def test_second_chat_with_the_same_system_prompt_reuses_it(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, block_size=4)
    tokenizer = ByteTokenizer()
    first = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    second = [SYSTEM, {"role": "user", "content": "Name a fruit."}]
    runner.chat(first, max_new_tokens=4)

    usage = runner.chat(second, max_new_tokens=4).usage

    system_tokens = len(tokenizer.render_chat([SYSTEM], add_generation_prompt=False))
    # The renderings agree through "<|im_start|>user\nName a " and differ at the noun.
    shared = len(tokenizer.render_chat([SYSTEM, {"role": "user", "content": "Name a "}], add_generation_prompt=False))
    assert usage.cached_tokens >= system_tokens
    assert usage.cached_tokens == shared - 2
