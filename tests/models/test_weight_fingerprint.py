"""Specification of the Hugging Face model fingerprint: every weight byte counts, it is taken at wrap time and again
only when the weights change, and a snapshot of one checkpoint never loads into a runner over another."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")

from prefixcache import PrefixCachingRunner, SamplingParams  # noqa: E402
from prefixcache.errors import SnapshotMismatchError  # noqa: E402
from prefixcache.models import hf  # noqa: E402
from prefixcache.models.hf import HFCausalLM  # noqa: E402
from prefixcache.testing import assert_quiescent  # noqa: E402

CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": None,
    "eos_token_id": None,
}


def _model(dtype: torch.dtype = torch.float32):
    config = transformers.AutoConfig.for_model("qwen2", **CONFIG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


def _with_one_embedding_element_changed(model, row: int = 4001, column: int = 3):
    """A copy of ``model`` whose embedding differs in one element (a row of a special token, as PEFT's trainable
    token indices retrain), away from the elements a strided sample would read."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.get_input_embeddings().weight[row, column] += 0.5
    return other


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_models_differing_in_one_embedding_element_have_different_fingerprints(dtype: torch.dtype) -> None:
    model = _model(dtype)
    assert HFCausalLM(model).fingerprint() == HFCausalLM(copy.deepcopy(model)).fingerprint()
    assert HFCausalLM(model).fingerprint() != HFCausalLM(_with_one_embedding_element_changed(model)).fingerprint()


def test_fingerprint_sees_a_tied_head_and_a_new_parameter() -> None:
    model = _model()
    before = HFCausalLM(copy.deepcopy(model)).fingerprint()
    model.model.norm.register_parameter("extra", torch.nn.Parameter(torch.zeros(1)))
    assert HFCausalLM(model).fingerprint() != before


def test_weights_are_hashed_at_wrap_time_and_again_only_when_they_change(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = hf.hash_weights
    monkeypatch.setattr(hf, "hash_weights", lambda digest, named: calls.append(1) or real(digest, named))
    wrapped = HFCausalLM(_model())
    assert len(calls) == 1
    runner = PrefixCachingRunner(wrapped, None, cache_tokens=512, block_size=16)
    for seed in range(3):
        runner.generate(list(range(seed + 1, seed + 40)), SamplingParams(max_new_tokens=2))
    assert len(calls) == 1
    first = wrapped.fingerprint()
    with torch.no_grad():
        wrapped.model.get_input_embeddings().weight[4001, 3] += 0.5
    assert wrapped.fingerprint() != first and len(calls) == 2


def test_a_snapshot_of_one_checkpoint_is_refused_by_a_runner_over_another(tmp_path: Path) -> None:
    model = _model()
    saver = PrefixCachingRunner(HFCausalLM(model), None, cache_tokens=512, block_size=16)
    saver.generate(list(range(1, 60)), SamplingParams(max_new_tokens=2))
    saver.save_snapshot(tmp_path / "snap")

    other = PrefixCachingRunner(
        HFCausalLM(_with_one_embedding_element_changed(model)), None, cache_tokens=512, block_size=16
    )
    other.generate(list(range(100, 140)), SamplingParams(max_new_tokens=2))
    before = other.cache.stats()
    with pytest.raises(SnapshotMismatchError, match="model_fingerprint"):
        other.load_snapshot(tmp_path / "snap")
    assert other.cache.stats() == before
    assert_quiescent(other.cache)
    same = PrefixCachingRunner(HFCausalLM(copy.deepcopy(model)), None, cache_tokens=512, block_size=16)
    assert same.load_snapshot(tmp_path / "snap").num_tokens > 0
