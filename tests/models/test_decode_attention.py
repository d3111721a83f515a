"""Single-query decode attention (``prefixcache.models.decode_attention``) and its transformers registration
(``prefixcache.models.hf_attention``): the same numbers as SDPA up to float rounding, on strided views of a live
buffer, masks included; the user's model config left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixcache.models.decode_attention import decode_attention


def _qkv(batch: int, kv_heads: int, group: int, keys: int, dim: int = 16):
    """q ``[B, H_kv, G, D]``; K, V ``[B, H_kv, S, D]`` as strided views of a ``[B, capacity, H_kv, D]`` buffer, as the
    embedded model keeps them."""
    gen = torch.Generator().manual_seed(keys)
    q = torch.randn(batch, kv_heads, group, dim, generator=gen)
    buffer = torch.randn(2, batch, keys + 7, kv_heads, dim, generator=gen)
    return q, buffer[0, :, :keys].transpose(1, 2), buffer[1, :, :keys].transpose(1, 2)


@pytest.mark.parametrize(("kv_heads", "group", "keys"), [(1, 1, 1), (2, 7, 100), (4, 2, 1000)])
def test_equals_sdpa_for_one_query_per_head(kv_heads: int, group: int, keys: int) -> None:
    q, k, v = _qkv(1, kv_heads, group, keys)
    expected = F.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(decode_attention(q, k, v), expected, atol=1e-6, rtol=1e-5)


def test_reads_strided_keys_without_copying() -> None:
    q, k, v = _qkv(1, 2, 3, 50)
    assert not k.is_contiguous()
    assert torch.allclose(decode_attention(q, k, v), F.scaled_dot_product_attention(q, k, v), atol=1e-6)


def test_mask_hides_keys_as_sdpa_does() -> None:
    q, k, v = _qkv(2, 2, 3, 40)
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., 10:25] = False  # the gap after a shorter row of a padded batch
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(decode_attention(q, k, v, mask=mask), expected, atol=1e-6)


def test_scale_is_applied_to_the_scores() -> None:
    q, k, v = _qkv(1, 2, 2, 30)
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert torch.allclose(decode_attention(q, k, v, scale=0.3), expected, atol=1e-6)


def test_embedded_decode_logits_agree_with_sdpa_and_reference() -> None:
    from prefixcache.engine.runner import PrefixCachingRunner
    from prefixcache.engine.sampling import SamplingParams
    from prefixcache.models.llama import build_model

    model = build_model("tiny", device="cpu")
    assert model.single_query_attention
    prompt = list(range(3, 90))
    params = SamplingParams(max_new_tokens=12)
    ours = PrefixCachingRunner(model).generate(prompt, params).token_ids
    model.single_query_attention = False
    try:
        theirs = PrefixCachingRunner(model).generate(prompt, params).token_ids
    finally:
        model.single_query_attention = True
    assert ours == theirs


def test_hf_decode_uses_it_and_puts_transformers_sdpa_back() -> None:
    pytest.importorskip("transformers")
    from transformers import AttentionInterface

    from prefixcache.engine.runner import PrefixCachingRunner
    from prefixcache.engine.sampling import SamplingParams
    from prefixcache.models import hf_attention
    from prefixcache.models.hf_tiny import tiny_random_model

    model = tiny_random_model("qwen2")
    sdpa = AttentionInterface._global_mapping["sdpa"]
    calls = []
    original = hf_attention.decode_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    prompt = list(range(5, 60))
    params = SamplingParams(max_new_tokens=6)
    hf_attention.decode_attention = counting
    try:
        ours = PrefixCachingRunner(model).generate(prompt, params)
    finally:
        hf_attention.decode_attention = original
    assert calls and AttentionInterface._global_mapping["sdpa"] is sdpa
    model.single_query_attention = False
    theirs = PrefixCachingRunner(model).generate(prompt, params)
    assert ours.token_ids == theirs.token_ids


def test_nested_blocks_restore_sdpa_when_the_last_ends() -> None:
    pytest.importorskip("transformers")
    from transformers import AttentionInterface

    from prefixcache.models.hf_attention import single_query_attention

    sdpa = AttentionInterface._global_mapping["sdpa"]
    with single_query_attention():
        with single_query_attention():
            assert AttentionInterface._global_mapping["sdpa"] is not sdpa
        assert AttentionInterface._global_mapping["sdpa"] is not sdpa
    assert AttentionInterface._global_mapping["sdpa"] is sdpa
    with pytest.raises(RuntimeError), single_query_attention():
        raise RuntimeError("a failed forward")
    assert AttentionInterface._global_mapping["sdpa"] is sdpa
