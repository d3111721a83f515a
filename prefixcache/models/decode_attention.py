"""Attention of one new query per row over that row's live K/V: the decode step's attention, on the CPU.

PyTorch's CPU ``scaled_dot_product_attention`` runs its flash kernel (blocked over queries and keys, online softmax,
one parallel region over batch x heads x query blocks) even for a single query.  Profiled on this project's 2-core
machine with 2 torch threads and another process running, a decode step of the 4-layer Qwen2.5-0.5B shape at 2,048
keys spent 7-9 ms a layer there (about a fifth of the step: a parallel region of two work items waits for a
descheduled peer); measured alone with one thread it takes 0.2-0.3 ms, and the same arithmetic written as two matrix
products and a softmax 0.1-0.25 ms: the scores of one query are only ``[H, S]`` floats, nothing needs blocking.  The
query heads of each KV head are stacked as the rows of one product (grouped-query attention without repeating the
K/V, as llama.cpp's and FlashInfer's decode kernels lay it out), and the keys are read where they lie (a view of the
live buffer, any row stride): no copy of the context per step.

Results equal SDPA's up to float rounding (another summation order); the softmax runs in float32.
"""

from __future__ import annotations

import math

import torch

__all__ = ["decode_attention"]


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of ``q[B, H_kv, G, D]`` (the ``G`` query heads of each KV head, one position) over
    ``k[B, H_kv, S, D]`` and ``v[B, H_kv, S, D_v]``; returns ``[B, H_kv, G, D_v]`` in ``q``'s dtype.

    ``scale`` defaults to ``1 / sqrt(D)``; ``mask`` (bool, broadcastable to ``[B, H_kv, G, S]``, True = attend) hides
    keys, e.g. the gap of a padded batch.  ``k`` and ``v`` may be strided views (rows of a larger buffer); nothing is
    copied.  Cost: ``4 * B * H_kv * G * S * D`` FLOPs, one read of K and V.  A row whose every key is masked gets NaN,
    as SDPA's math path does.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)).float()  # [B, H_kv, G, S]
    scores.mul_(scale)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(weights, v)
