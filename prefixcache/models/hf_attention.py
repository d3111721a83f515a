"""A Hugging Face ``sdpa`` attention whose decode step (one query) is :func:`~.decode_attention.decode_attention`
(extra ``prefixcache[hf]``).

Transformers' ``sdpa`` attention hands a decode query to PyTorch's CPU flash kernel (see
:mod:`~prefixcache.models.decode_attention` for what that costs).  Inside :func:`single_query_attention` (one of our
forwards) the ``sdpa`` entry of transformers' ``AttentionInterface`` is this module's function: one float32 query
with no dropout, soft-capping, sinks or position bias, and no mask or a boolean one shared by the heads, goes to
``decode_attention``; every other call to transformers' own ``sdpa_attention_forward``, unchanged.  The name stays
``sdpa``, so the masks transformers builds and models that test for ``"sdpa"`` by name (Falcon) are as before; the
entry is put back when the last such block in the process ends.  Another thread's ``sdpa`` call meanwhile gets the
same numbers up to float rounding.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from prefixcache.models.decode_attention import decode_attention

__all__ = ["single_query_attention"]

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
        sdpa = _saved[0] if _saved else sdpa_attention_forward  # whatever ``sdpa`` was before the block
        return sdpa(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    mask = None if attention_mask is None else attention_mask[..., : key.shape[-2]]  # [B, 1, 1, S]
    out = decode_attention(query.view(batch, kv_heads, heads // kv_heads, dim), key, value, scaling, mask)
    return out.reshape(batch, heads, 1, -1).transpose(1, 2).contiguous(), None


_lock = threading.Lock()
_active = 0
_saved: list[Any] = []


def _install() -> None:
    """Make :func:`_attention` transformers' ``sdpa`` attention (the first of nested or concurrent blocks)."""
    from transformers import AttentionInterface

    global _active
    with _lock:
        if _active == 0:
            _saved[:] = [AttentionInterface._global_mapping["sdpa"]]
            AttentionInterface._global_mapping["sdpa"] = _attention
        _active += 1


def _uninstall() -> None:
    """Put transformers' own ``sdpa`` entry back when the last block ends."""
    from transformers import AttentionInterface

    global _active
    with _lock:
        _active -= 1
        if _active == 0:
            AttentionInterface._global_mapping["sdpa"] = _saved.pop()


@contextmanager
def single_query_attention(enabled: bool = True) -> Iterator[None]:
    """Inside the block (when ``enabled``), transformers' ``sdpa`` attention runs a decode query through
    :func:`~prefixcache.models.decode_attention.decode_attention`; restored after, also on an error.  O(1)."""
    if not enabled:
        yield
        return
    _install()
    try:
        yield
    finally:
        _uninstall()
