"""Specification of the logits pipeline's filters (stages 7-10 of :mod:`prefixcache.engine.logits`) on rows built
by hand: temperature, then vLLM's min-p and top-k, then top-p on what they kept, and a draw that never leaves the
kept set and repeats with its seed."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from prefixcache import SamplingParams
from prefixcache.engine.logits import LogitsPipeline

CPU = torch.device("cpu")


def probabilities(params: SamplingParams, row: list[float]) -> list[float]:
    return LogitsPipeline(params, CPU, len(row)).probabilities(torch.tensor(row)).tolist()


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    return [w / sum(weights) for w in weights]


def reference_probabilities(row: list[float], p: SamplingParams) -> tuple[list[float], float]:
    """The definitions in float64: the distribution, and how near a kept-or-not decision came to its threshold
    (float32 may decide one that near the other way)."""
    scaled = [x / p.temperature for x in row]
    probs = softmax(scaled)
    keep = set(range(len(row)))
    margin = math.inf
    if p.min_p > 0:
        threshold = p.min_p * max(probs)
        keep = {i for i in keep if probs[i] >= threshold}
        margin = min((abs(q - threshold) / threshold for q in probs if q < max(probs)), default=math.inf)
    if 0 < p.top_k < len(row):
        kth = sorted(scaled, reverse=True)[p.top_k - 1]
        keep = {i for i in keep if scaled[i] >= kth}
    mass = sum(probs[i] for i in keep)
    kept = sorted(keep, key=lambda i: -probs[i])
    if p.top_p < 1:
        before, nucleus = 0.0, []
        for i in kept:
            if before < p.top_p:
                nucleus.append(i)
            margin = min(margin, abs(before - p.top_p))
            before += probs[i] / mass
        kept = nucleus
    mass = sum(probs[i] for i in kept)
    return [probs[i] / mass if i in kept else 0.0 for i in range(len(row))], margin


def test_top_k_keeps_the_k_largest_logits_renormalized() -> None:
    got = probabilities(SamplingParams(temperature=1.0, top_k=2), [1.0, 4.0, 2.0, 3.0])
    expected = softmax([4.0, 3.0])
    assert got == pytest.approx([0.0, expected[0], 0.0, expected[1]])


def test_top_k_keeps_every_token_tied_at_the_kth_logit() -> None:
    got = probabilities(SamplingParams(temperature=1.0, top_k=2), [3.0, 1.0, 3.0, 3.0])
    assert got == pytest.approx([1 / 3, 0.0, 1 / 3, 1 / 3])


@pytest.mark.parametrize("off", [0, -1])
def test_top_k_of_zero_or_minus_one_is_off(off: int) -> None:
    row = [1.0, 4.0, 2.0, 3.0]
    assert probabilities(SamplingParams(temperature=1.0, top_k=off), row) == pytest.approx(
        probabilities(SamplingParams(temperature=1.0), row)
    )
    assert probabilities(SamplingParams(temperature=1.0, top_k=len(row)), row) == pytest.approx(softmax(row))


def test_min_p_keeps_the_tokens_of_at_least_min_p_times_the_top_probability() -> None:
    row = [math.log(q) for q in (0.5, 0.3, 0.15, 0.05)]
    got = probabilities(SamplingParams(temperature=1.0, min_p=0.25), row)  # threshold 0.125: 0.05 goes
    assert got == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def test_min_p_is_applied_at_the_requests_temperature() -> None:
    row = [math.log(q) for q in (0.5, 0.3, 0.15, 0.05)]
    # At temperature 2 the probabilities are proportional to sqrt(q): sqrt(0.05 / 0.5) = 0.32 >= 0.25, all kept.
    got = probabilities(SamplingParams(temperature=2.0, min_p=0.25), row)
    assert all(q > 0 for q in got)
    assert got == pytest.approx(softmax([x / 2 for x in row]))


def test_top_p_applies_to_what_top_k_kept_renormalized() -> None:
    row = [math.log(q) for q in (0.4, 0.3, 0.2, 0.1)]
    # top_k=2 keeps 0.4 and 0.3, renormalized 4/7 and 3/7; top_p=0.5 then keeps only the first (4/7 >= 0.5).  On
    # the whole distribution top_p=0.5 would have kept two.
    assert probabilities(SamplingParams(temperature=1.0, top_k=2, top_p=0.5), row) == pytest.approx([1, 0, 0, 0])
    assert probabilities(SamplingParams(temperature=1.0, top_p=0.5), row) == pytest.approx([4 / 7, 3 / 7, 0, 0])


def test_greedy_ignores_the_filters() -> None:
    picker = LogitsPipeline(SamplingParams(top_k=1, min_p=0.9, top_p=0.1), CPU, 4)
    assert picker.pick(torch.tensor([1.0, 4.0, 2.0, 3.0])) == 1
    assert picker.probabilities(torch.tensor([1.0, 4.0, 2.0, 3.0])).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_draws_stay_in_the_kept_set_and_repeat_with_their_seed() -> None:
    row = torch.tensor([0.1, 2.0, 1.9, -1.0, 1.8, 0.0, 1.7, 0.5])
    params = SamplingParams(temperature=1.5, top_k=4, min_p=0.3, frequency_penalty=2.0, seed=11)

    def draws() -> list[int]:
        picker = LogitsPipeline(params, CPU, len(row))
        picker.accept(6)  # token 6 penalized below token 0.5's level: out of the top 4
        return [picker.pick(row) for _ in range(200)]

    first = draws()
    assert set(first) == {1, 2, 4, 7}
    assert draws() == first


@settings(max_examples=50, deadline=None)
@given(
    row=st.lists(st.integers(-40, 40), min_size=2, max_size=16, unique=True),
    temperature=st.floats(0.2, 3.0),
    top_k=st.integers(-1, 18),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
)
def test_the_distribution_equals_the_definitions(row, temperature, top_k, min_p, top_p) -> None:
    logits = [x / 4 for x in row]  # distinct: no ties at a top-k or top-p cut
    params = SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p, top_p=top_p)
    expected, margin = reference_probabilities(logits, params)
    assume(margin > 1e-4)
    got = probabilities(params, logits)
    assert [q > 0 for q in got] == [q > 0 for q in expected]
    assert got == pytest.approx(expected, abs=1e-5)
