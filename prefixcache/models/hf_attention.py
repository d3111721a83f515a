"""A Hugging Face attention function whose decode step (one query) is :func:`~.decode_attention.decode_attention`
(extra ``prefixcache[hf]``).

Transformers' ``sdpa`` attention hands a decode query to PyTorch's CPU flash kernel (see
:mod:`~prefixcache.models.decode_attention` for what that costs).  :data:`NAME` is registered in transformers'
``AttentionInterface`` (and, for its masks, as ``sdpa`` in ``AttentionMaskInterface``): one float32 query with no
dropout, soft-capping, sinks or position bias, and no mask or a boolean one shared by the heads, goes to
``decode_attention``; every other call to transformers' own ``sdpa_attention_forward``, unchanged.
:func:`single_query_attention` switches a model's configs from ``sdpa`` to it for the duration of one of our
forwards, so the user's model object is as it was outside them (the design of
:func:`~prefixcache.models.linear.tall_skinny_linears`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from prefixcache.models.decode_attention import decode_attention

__all__ = ["NAME", "register", "sdpa_configs", "single_query_attention"]

NAME = "prefixcache_sdpa"
"""The attention implementation name registered with transformers."""

_DELEGATED = ("softcap", "s_aux", "sinks", "position_bias", "output_attentions")


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention signature: ``query[B, H, q, D]``, ``key``/``value[B, H_kv, S, D]`` -> ``[B, q, H, D_v]``
    and no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    plain = (
        q_len == 1
        and query.dtype == torch.float32  # half precision: SDPA accumulates the scores in float32, keep its numbers
        and not dropout
        and heads % kv_heads == 0
        and (attention_mask is None or (attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1))
        and not any(kwargs.get(name) is not None and kwargs.get(name) is not False for name in _DELEGATED)
    )
    if not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    mask = None if attention_mask is None else attention_mask[..., : key.shape[-2]]  # [B, 1, 1, S]
    out = decode_attention(query.view(batch, kv_heads, heads // kv_heads, dim), key, value, scaling, mask)
    return out.reshape(batch, heads, 1, -1).transpose(1, 2).contiguous(), None


@functools.cache
def register() -> str:
    """Register :data:`NAME` with transformers (once per process); returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def sdpa_configs(model: torch.nn.Module) -> list[Any]:
    """The distinct configs among ``model``'s modules (sub-configs of multimodal models included) that attend with
    ``sdpa``.  O(modules)."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_attn_implementation_internal", None) == "sdpa":
            seen.setdefault(id(config), config)
    return list(seen.values())


@contextmanager
def single_query_attention(configs: list[Any]) -> Iterator[None]:
    """Inside the block, those of ``configs`` (from :func:`sdpa_configs`) that still attend with ``sdpa`` attend with
    :data:`NAME`; they are set back to ``sdpa`` after, also on an error.  O(len(configs))."""
    swapped = [config for config in configs if getattr(config, "_attn_implementation_internal", None) == "sdpa"]
    if swapped:
        name = register()
        for config in swapped:
            config._attn_implementation_internal = name
    try:
        yield
    finally:
        for config in swapped:
            config._attn_implementation_internal = "sdpa"
