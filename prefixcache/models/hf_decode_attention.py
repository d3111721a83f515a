"""One decode query's attention with grouped KV heads, for a Hugging Face forward on the CPU.

transformers' SDPA attention (``sdpa_attention_forward``) hands a grouped-query model's single decode query to
PyTorch with ``enable_gqa=True`` when no mask is given, which is what a one-row decode step over a live cache sends.
On the CPU that kernel runs one task per query head, each reading its KV head's whole context again: Qwen2.5-0.5B's
14 query heads read the 2 KV heads' keys and values 7 times over.  Laying the one query out as ``[B, H_kv, group,
D]`` (the ``group`` query heads of a KV head as that head's rows, what transformers itself does when a mask is given,
and what the embedded model does, ``LlamaModel._attention``) makes it one unmasked product per KV head that reads
the context once.  Measured on this project's 2-core Intel host, two threads, 24 layers of 2,048 keys: alone (the
attention calls in a loop, K/V from DRAM) 7.6 -> 4.0 ms a step; inside the HF adapter's 24-layer decode step (the
attention function's own time) 8.7-10.1 -> 5.7-6.5 ms.

:func:`grouped_decode_attention` is that function, registered with transformers' ``AttentionInterface`` under
:data:`ATTENTION_NAME` (with SDPA's own mask function under the same name, so the masks a model builds are SDPA's);
:func:`grouped_decode` selects it for the duration of one of our forwards (the model's config names it, then
``"sdpa"`` again), so the user's model computes as before outside them.  Every call it does not cover
(more than one query, a mask, another device, a position bias, a soft cap, attention sinks, no grouping) goes to
transformers' own ``sdpa_attention_forward`` unchanged.  Results equal SDPA's up to float rounding (another
summation order), as the embedded model's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from prefixcache.models.hf_support import LLAMA_FAMILY_TYPES

__all__ = [
    "ATTENTION_NAME",
    "GROUPED_DECODE_TYPES",
    "applies",
    "grouped_decode",
    "grouped_decode_attention",
    "sdpa_is_stock",
]

ATTENTION_NAME = "prefixcache_grouped_decode"
"""The name :func:`grouped_decode_attention` is registered under in transformers' ``AttentionInterface``."""

GROUPED_DECODE_TYPES = LLAMA_FAMILY_TYPES
"""``config.model_type`` values whose attention modules call the attention function with plain ``query [B, H, n, D]``,
``key``/``value [B, H_kv, S, D]`` and ``num_key_value_groups`` (transformers' Llama family), where
:func:`grouped_decode` applies."""

_UNCOVERED = ("position_bias", "softcap", "s_aux", "sinks")
"""Keyword arguments that change what attention computes: a call carrying any of them goes to SDPA as it is."""


def grouped_decode_attention(
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
    """transformers' attention-function signature: ``query [B, H, n, D]``, ``key [B, H_kv, S, D]``, ``value [B, H_kv,
    S, D_v]`` -> ``([B, n, H, D_v], None)``.

    One query (``n == 1``) on the CPU, no mask, no dropout, ``H = group * H_kv`` with ``group > 1`` and none of the
    arguments that change the scores: ``[B, H_kv, group, D]`` queries against their KV head, one SDPA call without
    ``enable_gqa`` (query head ``h`` reads KV head ``h // group``, as transformers' ``repeat_kv`` pairs them).  Any
    other call: transformers' ``sdpa_attention_forward`` with the same arguments.  Raises what SDPA raises.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, queries, _ = query.shape
    if (
        queries != 1
        or groups <= 1
        or attention_mask is not None
        or dropout
        or query.device.type != "cpu"
        or heads != groups * key.shape[1]
        or any(kwargs.get(name) is not None for name in _UNCOVERED)
        or kwargs.get("output_attentions")
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    grouped = query.reshape(batch, key.shape[1], groups, query.shape[-1])
    out = F.scaled_dot_product_attention(grouped, key, value, scale=scaling)  # [B, H_kv, group, D_v]
    return out.reshape(batch, 1, heads, value.shape[-1]), None


_REGISTERED: list[bool] = []


def _registered() -> bool:
    """Register :func:`grouped_decode_attention` and, under the same name, transformers' own SDPA mask function (the
    masks a model builds depend on its attention implementation's name: an unknown name gets no mask at all, which
    would drop causal, padding and window masks); once.  False where this transformers has no such registries."""
    if not _REGISTERED:
        try:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        except ImportError:
            _REGISTERED.append(False)
        else:
            AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
            AttentionInterface.register(ATTENTION_NAME, grouped_decode_attention)
            _REGISTERED.append(True)
    return _REGISTERED[0]


def sdpa_is_stock() -> bool:
    """Whether the attention and mask functions registered as ``"sdpa"`` are transformers' own: a user may register
    another under that name (``AttentionInterface.register("sdpa", fn)``, documented by transformers), and then a
    model's ``"sdpa"`` computes what that function does, which neither :func:`grouped_decode_attention` nor
    :mod:`~prefixcache.models.hf_decode_step` would."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    return (
        ALL_ATTENTION_FUNCTIONS.get("sdpa") is sdpa_attention_forward
        and ALL_MASK_ATTENTION_FUNCTIONS.get("sdpa") is sdpa_mask
    )


def applies(config: Any) -> bool:
    """Whether :func:`grouped_decode` takes effect for a model of ``config``: a type of :data:`GROUPED_DECODE_TYPES`
    whose attention implementation is ``"sdpa"``, transformers' own (:func:`sdpa_is_stock`), with a transformers
    that registers attention functions."""
    return (
        getattr(config, "model_type", None) in GROUPED_DECODE_TYPES
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and sdpa_is_stock()
        and _registered()
    )


@contextmanager
def grouped_decode(config: Any, enabled: bool = True) -> Iterator[None]:
    """Within the block, a model of ``config`` (where :func:`applies`) attends through
    :func:`grouped_decode_attention`; its ``config._attn_implementation`` is ``"sdpa"`` again on leaving, exception
    or not (unless something set another value meanwhile: that one stays).  ``enabled=False`` or a config it does
    not apply to: nothing changes.  The setting is the model's (its config object): run the block where nothing else
    calls the same model at the same time, or that call attends this way too (equal results up to float rounding,
    about 5e-6 in the logits of a tiny model)."""
    if not enabled or not applies(config):
        yield
        return
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        # Unless the user chose another setting meanwhile (set_attn_implementation from another thread): theirs stays.
        if config._attn_implementation == ATTENTION_NAME:
            config._attn_implementation = "sdpa"
