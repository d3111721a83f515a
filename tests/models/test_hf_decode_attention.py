"""Specification of the grouped decode attention of the Hugging Face adapter (``models/hf_decode_attention.py``): one
decode query attends its KV heads as transformers' SDPA does, up to float rounding; every other call is SDPA's own;
the model's attention setting is back as it was after each of our forwards; decode through the runner stays exact."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from prefixcache.engine.runner import PrefixCachingRunner  # noqa: E402
from prefixcache.engine.sampling import SamplingParams  # noqa: E402
from prefixcache.models import hf_decode_attention  # noqa: E402
from prefixcache.models.hf_decode_attention import (  # noqa: E402
    ATTENTION_NAME,
    grouped_decode,
    grouped_decode_attention,
)
from prefixcache.models.hf_tiny import tiny_random_model  # noqa: E402

TOL = 1e-5


class _Attention(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _qkv(batch: int, heads: int, kv_heads: int, queries: int, keys: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, 16, generator=gen)
    k = torch.randn(batch, kv_heads, keys, 16, generator=gen)
    v = torch.randn(batch, kv_heads, keys, 16, generator=gen)
    return q, k, v


@pytest.mark.parametrize(("batch", "heads", "kv_heads"), [(1, 14, 2), (2, 4, 2), (1, 8, 1), (3, 6, 3)])
def test_one_decode_query_equals_sdpa_with_its_kv_heads_repeated(batch: int, heads: int, kv_heads: int) -> None:
    module = _Attention(heads // kv_heads)
    q, k, v = _qkv(batch, heads, kv_heads, 1, 37)
    ours, weights = grouped_decode_attention(module, q, k, v, None, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    assert weights is None and ours.shape == theirs.shape == (batch, 1, heads, 16)
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    # Query head h reads KV head h // group: the plain product with the KV heads repeated, written out.
    repeated_k = k.repeat_interleave(heads // kv_heads, dim=1)
    repeated_v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = (q @ repeated_k.transpose(-1, -2) * 0.3).softmax(-1)
    torch.testing.assert_close(ours, (scores @ repeated_v).transpose(1, 2), atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "case", ["two queries", "a mask", "no grouping", "a position bias", "a soft cap", "sinks", "dropout"]
)
def test_every_call_it_does_not_cover_is_sdpas_own(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(
        "transformers.integrations.sdpa_attention.sdpa_attention_forward",
        lambda *args, **kwargs: seen.append((args, kwargs)) or ("sdpa", None),
    )
    heads, kv_heads, queries, mask, kwargs = 4, 2, 1, None, {}
    if case == "two queries":
        queries = 2
    elif case == "a mask":
        mask = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    elif case == "no grouping":
        kv_heads = 4
    elif case == "dropout":
        kwargs["dropout"] = 0.1
    else:
        name = {"a position bias": "position_bias", "a soft cap": "softcap", "sinks": "s_aux"}[case]
        kwargs[name] = torch.zeros(1)
    q, k, v = _qkv(1, heads, kv_heads, queries, 9)
    out = grouped_decode_attention(_Attention(heads // kv_heads), q, k, v, mask, **kwargs)
    assert out == ("sdpa", None) and len(seen) == 1
    args, passed = seen[0]
    assert args[1] is q and args[2] is k and args[3] is v and args[4] is mask
    assert all(passed[key] is value for key, value in kwargs.items())


def test_the_setting_is_the_models_own_again_after_the_block_even_on_error() -> None:
    model = tiny_random_model("qwen2")
    config = model.config
    assert config._attn_implementation == "sdpa"
    with grouped_decode(config):
        assert config._attn_implementation == ATTENTION_NAME
    assert config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"), grouped_decode(config):
        raise RuntimeError("boom")
    assert config._attn_implementation == "sdpa"
    with grouped_decode(config, enabled=False):
        assert config._attn_implementation == "sdpa"


def test_other_model_types_and_attention_settings_are_left_alone() -> None:
    gpt2 = tiny_random_model("gpt2")
    before = gpt2.config._attn_implementation
    with grouped_decode(gpt2.config):
        assert gpt2.config._attn_implementation == before
    eager = tiny_random_model("llama")
    eager.config._attn_implementation = "eager"
    with grouped_decode(eager.config):
        assert eager.config._attn_implementation == "eager"


def test_masks_are_built_as_for_sdpa_under_the_registered_name() -> None:
    # A padded batch: row 0 has a 3-token gap its mask hides.  Under our name the model must build SDPA's mask (an
    # unknown name gets none, and the gap would be attended): the logits equal the model's own, bit for bit.
    model = tiny_random_model("llama").model
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, 2:5] = 0
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask).logits
        with grouped_decode(model.config):
            ours = model(input_ids=ids, attention_mask=mask).logits
        unmasked = model(input_ids=ids).logits
    assert torch.equal(own, ours)
    assert not torch.allclose(own[0], unmasked[0], atol=1e-3)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "qwen3"])
def test_runner_decode_attends_grouped_and_stays_exact(model_type: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_random_model(model_type, vocab_size=300, max_positions=512)
    grouped_calls = []
    real = hf_decode_attention.F.scaled_dot_product_attention

    def counting(query, key, value, **kwargs):
        # The grouped layout: [B, H_kv, group, D] queries against [B, H_kv, S, D] keys.
        grouped_calls.append(query.shape[1] == key.shape[1] and query.shape[2] == 2)
        return real(query, key, value, **kwargs)

    functional = type("F", (), {"scaled_dot_product_attention": staticmethod(counting)})
    monkeypatch.setattr(hf_decode_attention, "F", functional)
    # Through the model's own layers (the adapter's own decode step, .hf_decode_step, is tested on its own).
    monkeypatch.setattr("prefixcache.models.hf_decode_step.decode_layers", lambda base, config: None)
    runner = PrefixCachingRunner(model, cache_tokens=1024, block_size=16)
    prompt = torch.randint(1, 300, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    runner.prefill(prompt[:40])
    result = runner.generate(prompt, SamplingParams(max_new_tokens=12))
    # 11 decode steps after the prefill's token, each through both layers.
    assert len(grouped_calls) == 2 * 11 and all(grouped_calls)
    tokens = list(result.token_ids)
    reference = model.forward_reference(
        torch.tensor(prompt + tokens[:-1]), return_logits=True, logits_from=len(prompt) - 1
    )
    assert reference.argmax(-1).tolist() == tokens
    assert model.config._attn_implementation == "sdpa"


def test_a_user_setting_made_inside_the_block_is_kept() -> None:
    # Another thread may call set_attn_implementation while our forward runs: its choice must survive our exit.
    config = tiny_random_model("qwen2").config
    with grouped_decode(config):
        config._attn_implementation = "eager"
    assert config._attn_implementation == "eager"


def test_a_users_own_sdpa_function_is_what_decode_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers lets a user register another "sdpa"; then the model computes that, and so must cached decode
    # (neither the grouped attention nor the adapter's own decode step may stand in for it).
    from transformers import AttentionInterface

    from prefixcache.models.base import LiveKV, kv_pool_shape
    from prefixcache.models.hf_decode_step import decode_layers

    calls = []

    def scaled_sdpa(module, query, key, value, attention_mask, **kwargs):
        calls.append(query.shape[2])
        return sdpa_attention_forward(module, query * 1.5, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", scaled_sdpa)
    model = tiny_random_model("llama", max_positions=256)
    assert not hf_decode_attention.applies(model.config)
    assert decode_layers(model.model.model, model.config) is None
    prompt = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    kv = torch.zeros(kv_pool_shape(model, 4, 16))
    live, table = LiveKV(), torch.arange(4)
    model.forward_cached(torch.tensor(prompt), 0, kv, table, live=live)
    calls.clear()
    logits = model.forward_cached(torch.tensor([7]), len(prompt), kv, table, live=live)
    assert calls == [1, 1]  # the decode step's one query, through the user's function in both layers
    torch.testing.assert_close(logits, model.forward_reference(torch.tensor([*prompt, 7])), atol=TOL, rtol=0)
