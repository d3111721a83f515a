"""Specification of SamplingParams' checks of the penalties, filters and stop options: a bad value is an
InvalidArgumentError naming it, at construction or at submit, and a refused request leaves the cache as it was."""

from __future__ import annotations

import math

import pytest
import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import LlamaModel
from prefixcache.testing import ScriptedModel, assert_quiescent

BAD = [
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": math.nan}, "min_p"),
    ({"min_p": "0.1"}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -math.inf}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": None}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"repetition_penalty": 10**400}, "repetition_penalty"),  # an int no float holds
    ({"temperature": -(10**400)}, "temperature"),
    ({"logit_bias": {1: 100.5}}, "logit_bias"),
    ({"logit_bias": {1: -101}}, "logit_bias"),
    ({"logit_bias": {1: math.nan}}, "logit_bias"),
    ({"logit_bias": {1: "5"}}, "logit_bias"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"logit_bias": {-1: 5}}, "logit_bias"),
    ({"logit_bias": {True: 5}}, "logit_bias"),
    ({"logit_bias": [(1, 2), (1, 3)]}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": 5}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 33}, "min_tokens"),  # above max_new_tokens (32), as vLLM refuses it
    ({"min_tokens": 1.0}, "min_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
]


@pytest.mark.parametrize(("kwargs", "name"), BAD)
def test_bad_values_are_refused_naming_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(InvalidArgumentError, match=name):
        SamplingParams(**kwargs)


def test_good_values_are_kept_and_logit_bias_becomes_sorted_pairs() -> None:
    params = SamplingParams(
        top_k=-1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        repetition_penalty=1.2,
        logit_bias={7: 1, 2: -100, 5: 100.0},
        min_tokens=32,
        ignore_eos=True,
    )
    assert params.logit_bias == ((2, -100.0), (5, 100.0), (7, 1.0))
    assert SamplingParams(logit_bias=[(7, 1), (2, -100)]).logit_bias == ((2, -100.0), (7, 1.0))
    assert SamplingParams(logit_bias={torch.tensor(3).item(): 1}).logit_bias == ((3, 1.0),)
    assert hash(params) == hash(SamplingParams(**{f: getattr(params, f) for f in params.__slots__}))


def test_a_logit_bias_outside_the_models_vocabulary_is_refused_at_submit_leaving_nothing(tiny: LlamaModel) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=512, block_size=4)
    engine = BatchEngine(runner)
    sampling = SamplingParams(max_new_tokens=2, logit_bias={tiny.vocab_size: 1})
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        engine.submit([1, 2, 3], sampling)
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        runner.generate([1, 2, 3], sampling)
    assert not engine.step()
    assert_quiescent(runner.cache)
    assert runner.cache.stats().cached_tokens == 0
    ok = SamplingParams(max_new_tokens=2, logit_bias={tiny.vocab_size - 1: 1})
    assert len(runner.generate([1, 2, 3], ok).token_ids) == 2


@pytest.mark.parametrize(("kwargs", "name"), BAD[::3])
def test_bad_values_through_chat_are_refused_before_anything_runs(kwargs: dict, name: str) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["hello"]), cache_tokens=1024)
    with pytest.raises(InvalidArgumentError, match=name):
        runner.chat([{"role": "user", "content": "hi"}], **kwargs)
    assert_quiescent(runner.cache)
    assert runner.cache.stats().cached_tokens == 0


def test_a_penalty_given_as_an_int_beyond_int64_is_a_float_and_runs(tiny: LlamaModel) -> None:
    # JSON's 1180591620717411303424 is a Python int: torch could not divide the logits by it (an OverflowError on
    # the engine thread, a 500 from the server).
    params = SamplingParams(max_new_tokens=3, repetition_penalty=2**70, temperature=2**70, top_p=1)
    assert (params.repetition_penalty, params.temperature, params.top_p) == (2.0**70, 2.0**70, 1.0)
    assert all(type(getattr(params, name)) is float for name in ("repetition_penalty", "temperature", "top_p"))
    runner = PrefixCachingRunner(tiny, cache_tokens=512, block_size=4)
    result = runner.generate([1, 2, 3, 1, 2], params)
    assert len(result.token_ids) == 3
    assert_quiescent(runner.cache)
