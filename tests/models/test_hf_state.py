"""Specification of the Hugging Face adapter against what happens to the wrapped model after wrapping (train mode,
``.to()``) and against models whose K/V layout the config does not tell: each is refused with an error of
``prefixcache.errors`` that leaves the cache as it was, or served exactly.  Tiny random models; nothing downloaded."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from prefixcache.engine.runner import PrefixCachingRunner, SamplingParams  # noqa: E402
from prefixcache.errors import InvalidArgumentError, UnsupportedModelError  # noqa: E402
from prefixcache.models.base import BatchRow, LiveKV  # noqa: E402
from prefixcache.models.hf import HFCausalLM  # noqa: E402
from prefixcache.models.hf_tiny import tiny_random_model  # noqa: E402

_TINY = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
    "initializer_range": 0.2,
    "bos_token_id": None,
    "eos_token_id": None,
}
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11, 64]
GREEDY = SamplingParams(max_new_tokens=4)


def _model(model_type: str, **overrides):
    config = transformers.AutoConfig.for_model(model_type, **{**_TINY, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config)


def _greedy_reference(wrapped: HFCausalLM, prompt: list[int], steps: int) -> list[int]:
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(wrapped.forward_reference(torch.tensor(seq))[-1].argmax()))
    return seq[len(prompt) :]


def _cache_state(runner: PrefixCachingRunner) -> tuple[int, int]:
    runner.cache.check_invariants()
    return runner.pool.num_free_blocks, runner.cache.stats().cached_tokens


def test_a_model_put_back_in_training_mode_is_refused_before_anything_runs() -> None:
    model = _model("gpt2", resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    wrapped = HFCausalLM(model)
    runner = PrefixCachingRunner(wrapped, block_size=4, cache_tokens=256)
    runner.generate(PROMPT[:5], GREEDY)
    before = _cache_state(runner)
    model.train()
    with pytest.raises(InvalidArgumentError, match="training mode"):
        runner.generate(PROMPT, GREEDY)
    with pytest.raises(InvalidArgumentError, match="training mode"):
        wrapped.forward_reference(torch.tensor(PROMPT))
    assert _cache_state(runner) == before


def test_one_submodule_in_training_mode_is_refused_too() -> None:
    model = _model("llama", attention_dropout=0.5)
    wrapped = HFCausalLM(model)
    kv = torch.zeros(2, 2, 4, 4, wrapped.num_kv_heads, wrapped.head_dim)
    model.model.layers[1].train()
    row = BatchRow(torch.tensor([1, 2]), 0, torch.tensor([0]), LiveKV())
    with pytest.raises(InvalidArgumentError, match="training mode"):
        wrapped.forward_batch([row, BatchRow(torch.tensor([3, 4]), 0, torch.tensor([1]), LiveKV())], kv)
    assert not kv.any()
    model.eval()
    assert len(wrapped.forward_batch([row], kv)) == 1


def test_dtype_and_device_follow_a_model_moved_after_wrapping() -> None:
    model = _model("llama", num_key_value_heads=2)
    wrapped = HFCausalLM(model)
    runner = PrefixCachingRunner(wrapped, block_size=4, cache_tokens=256)
    runner.generate(PROMPT[:5], GREEDY)
    before, fingerprint = _cache_state(runner), wrapped.fingerprint()
    model.to(torch.float64)
    assert wrapped.dtype == torch.float64
    assert wrapped.fingerprint() != fingerprint
    # The runner's pool is float32: refused with a clear error, not a RuntimeError from index_copy_.
    with pytest.raises(InvalidArgumentError, match="float64"):
        runner.generate(PROMPT, GREEDY)
    assert _cache_state(runner) == before
    fresh = PrefixCachingRunner(wrapped, block_size=4, cache_tokens=256)
    assert list(fresh.generate(PROMPT, GREEDY).token_ids) == _greedy_reference(wrapped, PROMPT, 4)


def test_a_base_model_without_lm_head_is_refused_at_wrap_time() -> None:
    with pytest.raises(UnsupportedModelError, match="LM head"):
        HFCausalLM(_model("llama").model)


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "qwen2"])
def test_tiny_random_model_serves_every_tested_type_exactly(model_type: str) -> None:
    wrapped = tiny_random_model(model_type, vocab_size=300)
    runner = PrefixCachingRunner(wrapped, block_size=4, cache_tokens=256)
    runner.generate(PROMPT[:5], SamplingParams(max_new_tokens=0))
    result = runner.generate(PROMPT, GREEDY)
    assert result.usage.cached_tokens == 5
    assert list(result.token_ids) == _greedy_reference(wrapped, PROMPT, 4)


def test_kv_heads_are_read_from_the_model_not_a_stray_config_key() -> None:
    # Falcon's multi-query attention keeps one K/V head whatever num_attention_heads says; a stray
    # num_key_value_heads on a GPT-2 config is not read by GPT-2 at all.
    for model in (
        _model("falcon", new_decoder_architecture=False, multi_query=True, alibi=False),
        _model("gpt2", num_key_value_heads=2),
    ):
        wrapped = HFCausalLM(model)
        runner = PrefixCachingRunner(wrapped, block_size=4, cache_tokens=256)
        runner.generate(PROMPT[:6], SamplingParams(max_new_tokens=0))
        result = runner.generate(PROMPT, GREEDY, return_logits=True)
        reference = wrapped.forward_reference(torch.tensor(PROMPT), return_logits=True)
        assert result.usage.cached_tokens == 6
        torch.testing.assert_close(result.prompt_logits, reference[6:], atol=1e-4, rtol=0)
        assert list(result.token_ids) == _greedy_reference(wrapped, PROMPT, 4)


def test_a_new_head_from_resize_token_embeddings_is_not_taken_for_training_mode() -> None:
    model = _model("qwen2", tie_word_embeddings=False, num_key_value_heads=2)
    wrapped = HFCausalLM(model)
    model.resize_token_embeddings(320)
    assert model.get_output_embeddings().training  # torch makes new modules in training mode
    runner = PrefixCachingRunner(wrapped, block_size=4, cache_tokens=256)
    prompt = [*PROMPT, 310]
    assert list(runner.generate(prompt, GREEDY).token_ids) == _greedy_reference(wrapped, prompt, 4)


def test_a_config_the_model_cannot_run_is_refused_at_wrap_time() -> None:
    # Qwen2's default of 32 K/V heads over 4 query heads: the model's own forward fails.
    with pytest.raises(UnsupportedModelError, match="one-token forward"):
        HFCausalLM(_model("qwen2"))


def test_a_dropout_added_after_wrapping_is_watched_once_the_weights_check_sees_its_parameters() -> None:
    # As a LoRA adapter brings its dropout: a new module in training mode (torch's default) with a parameter.
    model = _model("llama")
    runner = PrefixCachingRunner(HFCausalLM(model), num_blocks=64, block_size=4)
    runner.generate(PROMPT, SamplingParams(max_new_tokens=1))
    before = _cache_state(runner)
    model.model.layers[0].adapter = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(2, 2))
    with pytest.raises(InvalidArgumentError, match="training mode"):
        runner.generate(PROMPT, SamplingParams(max_new_tokens=1))
    assert _cache_state(runner) == before
    model.model.layers[0].adapter.eval()
    assert len(runner.generate(PROMPT, SamplingParams(max_new_tokens=1)).token_ids) == 1
