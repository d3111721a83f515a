"""The replay's untimed warm-up: one prefill of the start of the first prompt, before the cached and uncached sides are
timed, so that a fresh process's one-time costs count against neither."""

from __future__ import annotations

from array import array

import pytest

from prefixcache.models.llama import build_model
from prefixcache.replay.reference import UncachedReference
from prefixcache.replay.replayer import Replayer
from prefixcache.replay.requests import ReplayRequest


class Recording:
    """The model, recording the (start, length) of every ``forward_cached`` call."""

    def __init__(self, model) -> None:
        self._model, self.calls = model, []

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def forward_cached(self, ids, start, *rest, **kwargs):
        self.calls.append((start, len(ids)))
        return self._model.forward_cached(ids, start, *rest, **kwargs)


@pytest.mark.parametrize(
    ("chunk", "prompt_tokens", "expected"),
    [(64, 200, [(0, 64), (64, 16)]), (64, 30, [(0, 30)]), (None, 600, [(0, 256)]), (64, 0, [])],
)
def test_the_warm_up_prefills_one_chunk_and_a_block_of_the_prompt(chunk, prompt_tokens, expected) -> None:
    model = Recording(build_model("tiny"))
    reference = UncachedReference(model, 16, 1e-4, chunk)
    reference.warm_up(array("i", [65 + i % 26 for i in range(prompt_tokens)]))
    assert model.calls == expected


def test_a_replay_warms_up_once_before_its_first_request() -> None:
    model = Recording(build_model("tiny"))
    prompt = array("i", [65 + i % 26 for i in range(100)])
    requests = [ReplayRequest("s", 0, 0, prompt, array("i", [66]))]
    report = Replayer(model, prefill_chunk_tokens=64).replay("s", requests)
    # Warm-up (64 + 16), then the request cached (nothing is: 64 + 36), then its uncached baseline (64 + 36).
    assert model.calls[:2] == [(0, 64), (64, 16)]
    assert report.prompt_tokens == 100 and report.cached_tokens == 0
