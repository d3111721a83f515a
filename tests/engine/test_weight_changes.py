"""A weight change invalidates the cache before the next request (issue 11, item 5): in-place writes are seen through
torch's version counters, the embedded model's fingerprint covers its weights, ``runner.invalidate()`` covers what no
counter sees.  Each case: 0 cached tokens next time, and output equal to the uncached reference."""

from __future__ import annotations

import pytest
import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.engine.batching import BatchEngine
from prefixcache.models.llama import build_model
from prefixcache.testing import assert_quiescent, greedy_reference

transformers = pytest.importorskip("transformers")

from prefixcache.models.hf import HFCausalLM  # noqa: E402
from prefixcache.models.hf_tiny import tiny_random_model  # noqa: E402

NEW = 6
VOCAB = 1000


def prompt(n: int = 200, seed: int = 0) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_model(seed: int = 0) -> torch.nn.Module:
    return tiny_random_model("llama", vocab_size=VOCAB, seed=seed).model


def warm_then_check(runner: PrefixCachingRunner, change) -> None:
    ids = prompt()
    first = runner.generate(ids, SamplingParams(max_new_tokens=NEW))
    again = runner.generate(ids, SamplingParams(max_new_tokens=NEW))
    assert again.usage.cached_tokens == len(ids) - 1  # the cache works before the change
    assert first.token_ids == again.token_ids
    with torch.no_grad():
        change()
    after = runner.generate(ids, SamplingParams(max_new_tokens=NEW))
    assert after.usage.cached_tokens == 0
    expected, _ = greedy_reference(runner.model, ids, NEW)
    assert list(after.token_ids) == expected


def test_scaling_a_projection_of_the_embedded_model_in_place_invalidates() -> None:
    model = build_model("tiny", device="cpu")
    runner = PrefixCachingRunner(model, cache_tokens=4096, block_size=16)
    warm_then_check(runner, lambda: model.layers[0].qkv.mul_(1.5))


def test_the_embedded_models_fingerprint_covers_its_weights() -> None:
    model = build_model("tiny", device="cpu")
    before = model.fingerprint()
    assert build_model("tiny", device="cpu").fingerprint() == before  # equal weights, equal fingerprint
    with torch.no_grad():
        model.lm_head[0, 0] += 1.0
    assert model.fingerprint() != before


def test_load_state_dict_into_a_wrapped_hf_model_invalidates() -> None:
    module = hf_model(0)
    runner = PrefixCachingRunner(HFCausalLM(module), cache_tokens=4096, block_size=16)
    other = hf_model(1).state_dict()
    warm_then_check(runner, lambda: module.load_state_dict(other))


def test_a_lora_style_merge_into_a_wrapped_hf_model_invalidates() -> None:
    module = hf_model(0)
    runner = PrefixCachingRunner(HFCausalLM(module), cache_tokens=4096, block_size=16)
    generator = torch.Generator().manual_seed(3)
    rank = 4

    def merge() -> None:
        for layer in module.model.layers:
            proj = layer.self_attn.k_proj.weight
            a = torch.randn(rank, proj.shape[1], generator=generator) * 0.1
            b = torch.randn(proj.shape[0], rank, generator=generator) * 0.1
            proj.add_(b @ a)  # W += B A, as merging a LoRA adapter does

    warm_then_check(runner, merge)


def test_invalidate_covers_a_change_no_counter_sees() -> None:
    model = build_model("tiny", device="cpu")
    runner = PrefixCachingRunner(model, cache_tokens=4096, block_size=16)
    ids = prompt(100)
    runner.generate(ids, SamplingParams(max_new_tokens=2))
    before = runner.fingerprint
    runner.invalidate()
    assert runner.fingerprint != before
    assert runner.generate(ids, SamplingParams(max_new_tokens=2)).usage.cached_tokens == 0


def test_unchanged_weights_keep_the_fingerprint() -> None:
    model = build_model("tiny", device="cpu")
    runner = PrefixCachingRunner(model, cache_tokens=4096, block_size=16)
    before = runner.fingerprint
    ids = prompt(50)
    runner.generate(ids, SamplingParams(max_new_tokens=2))
    assert runner.generate(ids, SamplingParams(max_new_tokens=2)).usage.cached_tokens == 49
    assert runner.fingerprint == before


@pytest.mark.parametrize("kind", ["embedded", "qwen2"])
def test_invalidate_after_a_write_through_data_reaches_batched_decode(kind: str) -> None:
    """README: a write through ``tensor.data`` is not seen, so call ``runner.invalidate()``.  Batched decode on the
    CPU multiplies by packed copies of the weights (models.linear.WeightPacks), which follow the same version
    counters: invalidate must drop them too, or ``generate_many`` keeps decoding with the old weights."""
    model = build_model("tiny", device="cpu") if kind == "embedded" else tiny_random_model(kind, vocab_size=VOCAB)
    head = model.lm_head if kind == "embedded" else model.model.lm_head.weight
    runner = PrefixCachingRunner(model, cache_tokens=4096, block_size=16)
    prompts = [prompt(20 + i, seed=i) for i in range(3)]
    sampling = SamplingParams(max_new_tokens=NEW)
    runner.generate_many(prompts, sampling)

    head.data.mul_(-1.0)
    runner.invalidate()
    results = runner.generate_many(prompts, sampling)

    for ids, result in zip(prompts, results, strict=True):
        assert result.usage.cached_tokens == 0
        assert list(result.token_ids) == greedy_reference(model, ids, NEW)[0]


@pytest.mark.parametrize("together", [False, True])
def test_resized_token_embeddings_reach_serial_and_batched_decode(together: bool) -> None:
    """``resize_token_embeddings`` replaces the LM head module and grows the vocabulary: the adapter must run the new
    head (logits over the new vocabulary, new token ids accepted), not the one it found at construction."""
    module = hf_model(3)
    model = HFCausalLM(module)
    runner = PrefixCachingRunner(model, cache_tokens=4096, block_size=16)
    prompts = [prompt(40, seed) for seed in (1, 2)]
    runner.generate_many(prompts, SamplingParams(max_new_tokens=NEW)) if together else runner.generate(prompts[0])

    module.resize_token_embeddings(VOCAB + 24)
    with torch.no_grad():
        module.get_output_embeddings().weight[VOCAB:].normal_(0, 5.0, generator=torch.Generator().manual_seed(9))
    assert model.vocab_size == VOCAB + 24
    grown = [p + [VOCAB + 3] for p in prompts]  # a token id only the resized model has
    params = SamplingParams(max_new_tokens=NEW)
    results = runner.generate_many(grown, params) if together else [runner.generate(p, params) for p in grown]
    for ids, result in zip(grown, results, strict=True):
        expected, _ = greedy_reference(model, ids, NEW)
        assert list(result.token_ids) == expected
    assert any(t >= VOCAB for r in results for t in r.token_ids)  # the new rows of the head are in use


@pytest.mark.parametrize("change", ["in_place", "invalidate"])
def test_a_request_queued_before_a_weight_change_is_served_with_the_new_weights(change: str) -> None:
    """The batching engine admits a request later than it is submitted: the weight check belongs to admission.  A
    request queued behind a running one, the weights changed before it is admitted, must not reuse what was cached
    with the old weights (0 cached tokens, output equal to the uncached reference of the new model)."""
    model = build_model("tiny", device="cpu")
    runner = PrefixCachingRunner(model, cache_tokens=4096, block_size=16)
    engine = BatchEngine(runner, max_running=1)
    ids = prompt(100)
    engine.submit(ids, SamplingParams(max_new_tokens=2))
    engine.run_until_idle()
    queued = engine.submit([*ids, 7, 8, 9], SamplingParams(max_new_tokens=NEW))

    with torch.no_grad():
        if change == "in_place":
            model.layers[0].qkv.mul_(1.5)
        else:
            model.lm_head.data.mul_(-1.0)
            runner.invalidate()
    engine.run_until_idle()

    result = queued.result(timeout=0)
    assert result.usage.cached_tokens == 0
    assert list(result.token_ids) == greedy_reference(model, [*ids, 7, 8, 9], NEW)[0]
    assert_quiescent(runner.cache)
