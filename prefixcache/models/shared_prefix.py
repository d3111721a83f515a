"""Decode attention for rows that share a prefix: the shared K/V are read once for all rows (cascade attention).

When several requests decode behind one cached system prompt, their block tables start with the same pool blocks, so
the K/V of those positions are the same memory.  Attending each row on its own reads that prefix once per row and per
step; here the rows' queries are stacked and attend the shared prefix in one matmul, each row attends its own suffix,
and the two partial softmaxes are merged exactly through their log-sum-exps (the split softmax of FlashAttention;
the shared-prefix batching of Hydragen, Juravsky et al. 2024, and FlashInfer's cascade attention).  The result equals
one softmax over all keys up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SharedPrefixGroup:
    """Decode rows whose first ``shared_tokens`` positions sit in the same pool blocks.

    ``rows`` are indices into the batch; ``suffix_slots[B, S]`` the pool slots (flat ``block * block_size + offset``)
    of each row's positions ``shared_tokens .. end - 1``, padded with the row's last slot where ``suffix_mask[B, S]``
    is False.
    """

    rows: tuple[int, ...]
    shared_tokens: int
    suffix_slots: torch.Tensor
    suffix_mask: torch.Tensor


def plan_shared_prefix_groups(
    tables: list[list[int]], ends: list[int], decode_rows: list[int], block_size: int, device: torch.device
) -> list[SharedPrefixGroup]:
    """Group the ``decode_rows`` (one new token each, at position ``ends[r] - 1``) by the longest run of leading block
    ids they share, counting only blocks wholly before every member's new token.

    ``tables[r]`` is row r's block table (block ids) and ``ends[r]`` its positions after the step.  Rows are grouped
    by their first block id; a group needs two rows and one shared block.  O(rows * blocks).
    """
    by_first: dict[int, list[int]] = {}
    for r in decode_rows:
        if ends[r] - 1 >= block_size:
            by_first.setdefault(tables[r][0], []).append(r)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        limit = min((ends[r] - 1) // block_size for r in members)
        first = tables[members[0]]
        shared = 1
        while shared < limit and all(tables[r][shared] == first[shared] for r in members):
            shared += 1
        shared_tokens = shared * block_size
        width = max(ends[r] for r in members) - shared_tokens
        slots = torch.empty((len(members), width), dtype=torch.long)
        mask = torch.zeros((len(members), width), dtype=torch.bool)
        for b, r in enumerate(members):
            positions = torch.arange(shared_tokens, ends[r])
            table = torch.tensor(tables[r][: -(-ends[r] // block_size)])
            row_slots = table[positions // block_size] * block_size + positions % block_size
            slots[b, : row_slots.numel()] = row_slots
            slots[b, row_slots.numel() :] = row_slots[-1]
            mask[b, : row_slots.numel()] = True
        groups.append(SharedPrefixGroup(tuple(members), shared_tokens, slots.to(device), mask.to(device)))
    return groups


def shared_prefix_decode_attention(
    q: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    suffix_mask: torch.Tensor,
) -> torch.Tensor:
    """Attention of one query per row over a shared prefix plus the row's own suffix.

    Args:
        q: ``[B, H, D]``, head h reading KV head ``h // (H / H_kv)``.
        shared_k, shared_v: ``[P, H_kv, D]``, the prefix every row sees.
        suffix_k, suffix_v: ``[B, S, H_kv, D]``, each row's later keys; ``suffix_mask[B, S]`` marks the real ones
            (each row has at least one).

    Returns ``[B, H * D]`` in q's dtype; softmax scale ``1 / sqrt(D)``, scores and merge in float32.
    Cost: the prefix is read once for all B rows (B * H * P * D multiply-adds), the suffixes once each.
    """
    batch, heads, dim = q.shape
    kv_heads = shared_k.shape[1]
    group = heads // kv_heads
    scale = dim**-0.5
    qf = q.float().view(batch, kv_heads, group, dim)
    # Shared part: all rows' queries of one KV head in one matmul, [H_kv, B * group, P].
    q_shared = qf.permute(1, 0, 2, 3).reshape(kv_heads, batch * group, dim)
    out_shared, lse_shared = _partial_softmax(
        torch.matmul(q_shared, shared_k.float().permute(1, 2, 0)) * scale, shared_v.float().transpose(0, 1)
    )
    out_shared = out_shared.view(kv_heads, batch, group, dim).transpose(0, 1)  # [B, H_kv, group, D]
    lse_shared = lse_shared.view(kv_heads, batch, group, 1).transpose(0, 1)
    # Own suffix: [B, H_kv, group, S].
    scores = torch.matmul(qf, suffix_k.float().permute(0, 2, 3, 1)) * scale
    scores = scores.masked_fill(~suffix_mask[:, None, None, :], float("-inf"))
    out_own, lse_own = _partial_softmax(scores, suffix_v.float().transpose(1, 2))
    lse = torch.logaddexp(lse_shared, lse_own)
    out = out_shared * torch.exp(lse_shared - lse) + out_own * torch.exp(lse_own - lse)
    return out.reshape(batch, heads * dim).to(q.dtype)


def _partial_softmax(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(scores) @ v`` and the log-sum-exp of ``scores[..., K]`` (``[..., 1]``), with one exp pass."""
    top = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v) / total, top + torch.log(total)
