"""Specification of ``forward_reference(..., return_logits=True, logits_from=k)``: the rows of positions k.. of the full
reference, computed without running the LM head on the positions before k (what a verified replay compares)."""

from __future__ import annotations

import pytest
import torch

from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import build_model
from prefixcache.testing import ScriptedModel


@pytest.fixture(scope="module", params=["embedded", "qwen2"])
def model(request):
    if request.param == "embedded":
        return build_model("tiny", device="cpu")
    pytest.importorskip("transformers")
    from prefixcache.models.hf_tiny import tiny_random_model

    return tiny_random_model("qwen2")


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("logits_from", [0, 1, 17, 29])
def test_logits_from_gives_the_rows_of_those_positions(model, logits_from: int) -> None:
    ids = _ids(30)
    full = model.forward_reference(ids, return_logits=True)

    part = model.forward_reference(ids, return_logits=True, logits_from=logits_from)

    assert part.shape == (30 - logits_from, model.vocab_size)
    assert torch.allclose(part, full[logits_from:], atol=1e-5, rtol=0)


def test_logits_from_without_return_logits_still_gives_the_last_position(model) -> None:
    ids = _ids(12)

    last = model.forward_reference(ids, logits_from=5)

    assert torch.allclose(last, model.forward_reference(ids, return_logits=True)[-1:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("logits_from", [-1, 12, 1.5, True])
def test_logits_from_outside_the_sequence_is_refused(model, logits_from) -> None:
    with pytest.raises(InvalidArgumentError, match="logits_from"):
        model.forward_reference(_ids(12), return_logits=True, logits_from=logits_from)


def test_the_scripted_test_model_honours_logits_from() -> None:
    scripted = ScriptedModel([[5, 6]], turn_marker=[1], end_token_id=2, vocab_size=16)
    ids = torch.tensor([1, 5, 6, 2, 1, 5, 3, 1])

    assert torch.equal(
        scripted.forward_reference(ids, return_logits=True, logits_from=3),
        scripted.forward_reference(ids, return_logits=True)[3:],
    )
