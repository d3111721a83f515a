"""A prompt longer than the model can take is refused by its length, before its ids are converted or checked, so
a huge prompt costs O(1) to refuse (its conversion is a C loop that holds the GIL and stalls every other thread)."""

from __future__ import annotations

from array import array

import pytest

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.errors import CapacityError, InvalidTokensError
from prefixcache.models.llama import build_model
from prefixcache.testing import assert_quiescent


@pytest.fixture(scope="module")
def runner() -> PrefixCachingRunner:
    return PrefixCachingRunner(build_model("tiny", device="cpu"), cache_tokens=1024)


@pytest.mark.parametrize("kind", [list, tuple, lambda ids: array("q", ids)])
def test_a_prompt_over_the_models_positions_is_refused_by_its_length(runner, kind) -> None:
    too_long = kind([-1] * (runner.model.max_position + 1))  # ids that would be refused one by one, too
    with pytest.raises(CapacityError, match=f"{runner.model.max_position + 5} tokens exceed"):
        runner.checks.request(too_long, SamplingParams(max_new_tokens=4))
    assert_quiescent(runner.cache)


def test_a_prompt_that_fits_still_has_its_ids_checked(runner) -> None:
    with pytest.raises(InvalidTokensError):
        runner.checks.request([-1] * 10, SamplingParams(max_new_tokens=4))
    with pytest.raises(InvalidTokensError):
        runner.checks.request([], SamplingParams(max_new_tokens=4))
