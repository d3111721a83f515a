"""Decode attention for rows that share a prefix: the shared K/V are read once for all rows (cascade attention).

When several requests decode behind one cached system prompt, their block tables start with the same pool blocks, so
the K/V of those positions are the same memory.  Attending each row on its own reads that prefix once per row and per
step; here the rows' queries are stacked so that one matmul per KV head scores the shared prefix for all of them (the
shared-prefix batching of Hydragen, Juravsky et al. 2024, and FlashInfer's cascade attention).  Each row's own
suffix keys (the positions after the shared blocks, a few dozen while sessions decode) are packed side by side and
scored by the same stacked queries, a bias of -inf hiding the other rows' suffixes; one softmax then runs over the
shared and the packed keys together, so no partial softmaxes need merging.  The result equals one softmax over each
row's own keys up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SharedPrefixGroup:
    """Decode rows whose first ``shared_tokens`` positions sit in the same pool blocks.

    ``rows`` are indices into the batch.  ``suffix_slots[T]`` are the pool slots (flat ``block * block_size +
    offset``) of every member's positions ``shared_tokens .. end - 1``, packed in member order (``T`` the sum of the
    members' suffix lengths); ``suffix_bias[B, T]`` (float32) is 0 where a slot is the member's own and -inf where it
    is another member's.
    """

    rows: tuple[int, ...]
    shared_tokens: int
    suffix_slots: torch.Tensor
    suffix_bias: torch.Tensor


def plan_shared_prefix_groups(
    tables: list[list[int]], ends: list[int], decode_rows: list[int], block_size: int, device: torch.device
) -> list[SharedPrefixGroup]:
    """Group the ``decode_rows`` (one new token each, at position ``ends[r] - 1``) by the longest run of leading block
    ids they share, counting only blocks wholly before every member's new token.

    ``tables[r]`` is row r's block table (block ids) and ``ends[r]`` its positions after the step.  Rows are grouped
    by their first block id; a group needs two rows and one shared block.  O(rows * blocks) list comparisons (C
    speed), plus O(suffix tokens) Python work for the packed slots.
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
        shared = min(_common_prefix(first, tables[r], limit) for r in members[1:])
        shared_tokens = shared * block_size
        slots: list[int] = []
        bounds = []
        for r in members:
            table, lo = tables[r], len(slots)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(shared_tokens, ends[r]))
            bounds.append((lo, len(slots)))
        bias = torch.full((len(members), len(slots)), float("-inf"))
        for b, (lo, hi) in enumerate(bounds):
            bias[b, lo:hi] = 0.0
        suffix_slots = torch.tensor(slots, dtype=torch.long, device=device)
        groups.append(SharedPrefixGroup(tuple(members), shared_tokens, suffix_slots, bias.to(device)))
    return groups


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a[:limit]`` and ``b[:limit]``; one C-speed comparison when they are equal."""
    if a[:limit] == b[:limit]:
        return limit
    return next(i for i in range(limit) if a[i] != b[i])


def shared_prefix_decode_attention(
    q: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    suffix_bias: torch.Tensor,
) -> torch.Tensor:
    """Attention of one query per row over a shared prefix plus the row's own suffix.

    Args:
        q: ``[B, H, D]``, head h reading KV head ``h // (H / H_kv)``.
        shared_k, shared_v: ``[P, H_kv, D]``, the prefix every row sees.
        suffix_k, suffix_v: ``[T, H_kv, D]``, every row's later keys packed together; ``suffix_bias[B, T]`` (float32)
            is 0 on row b's own keys and -inf on the others (each row has at least one key of its own).

    Returns ``[B, H * D]`` in q's dtype; softmax scale ``1 / sqrt(D)``, scores and softmax in float32.
    Cost: the prefix is read once for all B rows (B * H * (P + T) * D multiply-adds for scores and again for values).
    """
    batch, heads, dim = q.shape
    kv_heads = shared_k.shape[1]
    group = heads // kv_heads
    packed = suffix_k.shape[0]
    # All rows' queries of one KV head stacked: [H_kv, B * group, D], row-major in (row, query head).
    qs = (q.float() * dim**-0.5).view(batch, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)
    bias = suffix_bias[:, None, :].expand(batch, group, packed).reshape(batch * group, packed)
    scores = torch.cat(
        [
            torch.matmul(qs, shared_k.float().permute(1, 2, 0)),  # [H_kv, B * group, P]
            torch.baddbmm(bias.expand(kv_heads, -1, -1), qs, suffix_k.float().permute(1, 2, 0)),  # [H_kv, B*group, T]
        ],
        dim=-1,
    )
    probs = torch.softmax(scores, dim=-1)
    shared = shared_k.shape[0]
    out = torch.baddbmm(
        torch.matmul(probs[..., :shared], shared_v.float().transpose(0, 1)),
        probs[..., shared:],
        suffix_v.float().transpose(0, 1),
    )  # [H_kv, B * group, D]
    return out.view(kv_heads, batch, group, dim).transpose(0, 1).reshape(batch, heads * dim).to(q.dtype)
