"""Specification of the logits pipeline's penalties and masks (stages 2-6 of :mod:`prefixcache.engine.logits`) on
rows and token histories built by hand: each against its definition (OpenAI's presence and frequency penalties and
logit bias, CTRL's repetition penalty as Hugging Face and vLLM apply it, vLLM's min_tokens and ignore_eos), their
order, and a default request that pays for none of them."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import SamplingParams
from prefixcache.engine.logits import LogitsPipeline

ROW = [1.0, 2.0, -1.0, 0.5, 3.0, 0.0]
CPU = torch.device("cpu")


def pipeline(params: SamplingParams, prompt=(), generated=(), vocab_size: int = len(ROW)) -> LogitsPipeline:
    picker = LogitsPipeline(params, CPU, vocab_size, list(prompt))
    for token in generated:
        picker.accept(token)
    return picker


def adjusted(params: SamplingParams, prompt=(), generated=(), row=ROW) -> list[float]:
    return pipeline(params, prompt, generated, len(row)).adjusted(torch.tensor(row)).tolist()


def reference_adjusted(row: list[float], prompt: list[int], generated: list[int], p: SamplingParams) -> list[float]:
    """The definitions, one token at a time, in float64: the order of the module docstring."""
    logits = [float(x) for x in row[: p.vocab_limit]]
    if len(generated) < p.min_tokens and not p.ignore_eos:
        for token in p.stop_token_ids:
            if token < len(logits):
                logits[token] = -math.inf
    for token, bias in p.logit_bias:
        if token < len(logits):
            logits[token] += bias
    for token in set(prompt) | set(generated):
        if token < len(logits):
            x = logits[token]
            logits[token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for token, count in Counter(generated).items():
        if token < len(logits):
            logits[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return logits


def test_frequency_and_presence_penalties_subtract_per_count_of_generated_tokens_only() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # Token 1 generated twice, token 2 once; token 4 is in the prompt only: OpenAI counts the completion so far.
    got = adjusted(params, prompt=[4, 1], generated=[1, 2, 1])
    assert got == pytest.approx([1.0, 2.0 - 2 * 0.5 - 0.25, -1.0 - 0.5 - 0.25, 0.5, 3.0, 0.0])


def test_negative_presence_and_frequency_penalties_encourage_repeats() -> None:
    got = adjusted(SamplingParams(frequency_penalty=-1.0, presence_penalty=-2.0), generated=[3, 3])
    assert got == pytest.approx([1.0, 2.0, -1.0, 0.5 + 2.0 + 2.0, 3.0, 0.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_generated_tokens() -> None:
    got = adjusted(SamplingParams(repetition_penalty=2.0), prompt=[0, 2, 5], generated=[3, 3])
    # 0: 1 / 2; 2: -1 * 2; 3: 0.5 / 2 (once, however often it repeats); 5: 0 stays 0; 1 and 4 never seen.
    assert got == pytest.approx([0.5, 2.0, -2.0, 0.25, 3.0, 0.0])


def test_a_repetition_penalty_below_one_favours_seen_tokens() -> None:
    got = adjusted(SamplingParams(repetition_penalty=0.5), prompt=[0, 2])
    assert got == pytest.approx([2.0, 2.0, -0.5, 0.5, 3.0, 0.0])


def test_logit_bias_adds_to_the_logits_of_its_tokens() -> None:
    got = adjusted(SamplingParams(logit_bias={0: -100, 3: 5.5}))
    assert got == pytest.approx([-99.0, 2.0, -1.0, 6.0, 3.0, 0.0])


def test_logit_bias_of_100_makes_greedy_pick_its_token() -> None:
    picker = pipeline(SamplingParams(logit_bias={2: 100}))
    assert picker.pick(torch.tensor(ROW)) == 2


def test_min_tokens_masks_the_stop_tokens_until_that_many_tokens_are_generated() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=frozenset({4, 1, 99}))  # 99: beyond the row, ignored
    picker = pipeline(params)
    row = torch.tensor(ROW)
    assert picker.adjusted(row).tolist() == [1.0, -math.inf, -1.0, 0.5, -math.inf, 0.0]
    assert picker.pick(row) == 0  # greedy would pick the stop token 4
    picker.accept(0)
    assert picker.pick(row) == 0
    picker.accept(0)
    assert picker.adjusted(row).tolist() == ROW
    assert picker.pick(row) == 4


def test_a_stop_token_ends_the_request_only_after_min_tokens() -> None:
    picker = pipeline(SamplingParams(max_new_tokens=8, min_tokens=2, stop_token_ids=frozenset({4})))
    assert picker.ends(4, 1) is None and picker.ends(4, 2) is None
    assert picker.ends(4, 3) == "stop"
    assert picker.ends(4, 1, stop_requested=True) == "stop"  # a stop string is the caller's verdict


def test_with_ignore_eos_stop_tokens_neither_end_the_request_nor_are_masked() -> None:
    params = SamplingParams(max_new_tokens=3, min_tokens=2, stop_token_ids=frozenset({4}), ignore_eos=True)
    picker = pipeline(params)
    assert picker.adjusted(torch.tensor(ROW)).tolist() == ROW
    assert picker.ends(4, 1) is None and picker.ends(4, 2) is None
    assert picker.ends(4, 3) == "length"


def test_greedy_picks_the_argmax_of_the_penalized_row() -> None:
    row = torch.tensor(ROW)
    assert pipeline(SamplingParams()).pick(row) == 4
    assert pipeline(SamplingParams(presence_penalty=1.5), generated=[4]).pick(row) == 1
    assert pipeline(SamplingParams(repetition_penalty=2.0), prompt=[4]).pick(row) == 1


def test_the_bias_comes_before_the_repetition_penalty() -> None:
    # Token 0: (1 - 3) * 2 = -4 with the bias first (vLLM's order); 1 / 2 - 3 = -2.5 the other way round.
    got = adjusted(SamplingParams(logit_bias={0: -3}, repetition_penalty=2.0), prompt=[0])
    assert got[0] == pytest.approx(-4.0)


def test_the_repetition_penalty_comes_before_the_frequency_penalty() -> None:
    # Token 2: -1 * 2 - 1 = -3 (vLLM's apply_penalties); (-1 - 1) * 2 = -4 the other way round.
    got = adjusted(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0), generated=[2])
    assert got[2] == pytest.approx(-3.0)


def test_penalties_apply_before_temperature() -> None:
    params = SamplingParams(temperature=0.5, frequency_penalty=1.0)
    probs = pipeline(params, generated=[4]).probabilities(torch.tensor(ROW))
    expected = torch.softmax((torch.tensor(ROW) - torch.tensor([0, 0, 0, 0, 1.0, 0])) / 0.5, dim=-1)
    assert torch.allclose(probs, expected, atol=1e-6)


def test_the_vocabulary_limit_cuts_the_row_before_any_bias() -> None:
    got = adjusted(SamplingParams(vocab_limit=4, logit_bias={1: 1, 5: 50}, repetition_penalty=2.0), prompt=[5])
    assert got == pytest.approx([1.0, 3.0, -1.0, 0.5])


def test_adjusting_never_writes_into_the_callers_logits() -> None:
    row = torch.tensor(ROW)
    params = SamplingParams(min_tokens=1, stop_token_ids=frozenset({4}), logit_bias={1: 2}, repetition_penalty=3.0)
    pipeline(params, prompt=[0, 2], generated=[]).pick(row)
    assert row.tolist() == ROW


def test_a_default_request_keeps_no_history_and_gets_its_row_back_untouched() -> None:
    picker = pipeline(SamplingParams(temperature=0.7, top_p=0.9), prompt=[1, 2, 3], generated=[4])
    row = torch.tensor(ROW)
    assert picker.adjusted(row) is row
    assert (picker._counts, picker._seen, picker._bias_ids, picker._stop_ids) == (None, None, None, None)
    assert not picker._adjusting and not picker._filtering


def test_the_history_is_only_what_was_accepted() -> None:
    picker = pipeline(SamplingParams(frequency_penalty=1.0), generated=[1])
    row = torch.tensor(ROW)
    picker.pick(row)  # picking is not appending: the engine accepts what it appends
    assert picker.num_generated == 1
    assert picker.adjusted(row).tolist() == pytest.approx([1.0, 1.0, -1.0, 0.5, 3.0, 0.0])


VOCAB = 12


@settings(max_examples=50, deadline=None)
@given(
    row=st.lists(st.floats(-20, 20, allow_nan=False), min_size=VOCAB, max_size=VOCAB),
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=10),
    generated=st.lists(st.integers(0, VOCAB - 1), max_size=10),
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    repetition=st.floats(0.1, 5),
    bias=st.dictionaries(st.integers(0, VOCAB + 3), st.floats(-100, 100), max_size=4),
    stops=st.frozensets(st.integers(0, VOCAB + 3), max_size=3),
    min_tokens=st.integers(0, 12),
    ignore_eos=st.booleans(),
    vocab_limit=st.one_of(st.none(), st.integers(1, VOCAB + 2)),
)
def test_adjusted_rows_equal_the_definitions(
    row, prompt, generated, presence, frequency, repetition, bias, stops, min_tokens, ignore_eos, vocab_limit
) -> None:
    params = SamplingParams(
        max_new_tokens=12,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        logit_bias=bias,
        stop_token_ids=stops,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        vocab_limit=vocab_limit,
    )
    got = pipeline(params, prompt, generated, VOCAB).adjusted(torch.tensor(row, dtype=torch.float32))
    expected = torch.tensor(reference_adjusted(torch.tensor(row).tolist(), prompt, generated, params))
    assert got.shape == expected.shape
    assert torch.allclose(got.double(), expected.double(), rtol=1e-5, atol=1e-4)


@settings(max_examples=30, deadline=None)
@given(
    row=st.lists(st.integers(-40, 40), min_size=VOCAB, max_size=VOCAB, unique=True),
    generated=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    frequency=st.sampled_from([0.0, 0.3, 1.0, -0.7]),
    repetition=st.sampled_from([1.0, 1.3, 0.8]),
)
def test_greedy_picks_the_argmax_of_the_definition(row, generated, frequency, repetition) -> None:
    # Distinct logits a quarter apart and penalties that keep them apart: the argmax has no near tie to flip.
    logits = [x / 4 for x in row]
    params = SamplingParams(frequency_penalty=frequency, repetition_penalty=repetition)
    expected = reference_adjusted(logits, [], generated, params)
    best = max(range(VOCAB), key=expected.__getitem__)
    if sorted(expected)[-2] > expected[best] - 1e-3:
        return  # a near tie: float32 and float64 may order it differently
    assert pipeline(params, [], generated, VOCAB).pick(torch.tensor(logits)) == best
