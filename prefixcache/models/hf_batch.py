"""Several requests' new tokens through a Hugging Face model in one forward over a padded batch cache (extra
``prefixcache[hf]``).

Each row's prefix K/V (its live cache, else gathered from the pool) is copied once into one batch cache, left-padded
to the longest prefix with an attention mask; the batch cache stays attached to the rows' live caches
(:class:`~prefixcache.models.hf_cache.PaddedBatch`), so the next decode step of the same rows appends to it without
copying again.  Each row's new K/V go to its own live cache and its pool slots.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from prefixcache.models.base import BatchRow, check_live
from prefixcache.models.hf_cache import PaddedBatch
from prefixcache.models.hf_pool import PoolTransfer, flat_pool

__all__ = ["forward_padded"]


def forward_padded(
    rows: list[BatchRow],
    checked: list[tuple[torch.Tensor, torch.Tensor]],
    kv: torch.Tensor,
    transfer: PoolTransfer,
    logits_of: Callable[..., torch.Tensor],
) -> list[torch.Tensor]:
    """One forward of ``B`` rows of ``n`` new tokens each; per row the float32 logits ``[1, vocab_size]`` of its last
    token.  ``checked`` holds each row's checked ``(token ids [n], block table)``; ``kv`` is the pool; ``transfer``
    moves K/V between it and the caches; ``logits_of(cache, return_logits, **inputs)`` runs the model.  Cost: one
    forward of ``B x n`` queries, plus the prefixes' copy into the batch cache when the rows have none attached."""
    model = transfer.model
    device, dtype = model.device, model.dtype
    n, batch = checked[0][0].numel(), len(rows)
    caches = []
    for row, (_, table) in zip(rows, checked, strict=True):
        reuse = check_live(row.live, row.start_pos)
        end_pos = row.start_pos + n
        caches.append(row.live.data if reuse else transfer.cache_from_pool(row.live, kv, table, row.start_pos, end_pos))
    starts = [row.start_pos for row in rows]
    offsets = torch.arange(n, device=device)
    positions = torch.stack([offsets + start for start in starts])  # [B, n]
    state = PaddedBatch.find(caches, starts)
    if state is not None:
        mask = torch.cat([state.mask, state.mask.new_ones(batch, n)], dim=1)
    else:
        longest = max(starts)
        mask = torch.ones(batch, longest + n, dtype=torch.long, device=device)
        for b, start in enumerate(starts):
            mask[b, start:longest] = 0
        # Room for the longest any member may still grow, so that decode steps append without regrowing.
        batch_cache = transfer.new_cache(max(r.live.room(r.start_pos + n) - r.start_pos + longest for r in rows))
        layout = transfer.kv_layout
        for index, layer in enumerate(batch_cache.layers):
            keys = [cache.layers[index].keys if start else None for cache, start in zip(caches, starts, strict=True)]
            values = [
                cache.layers[index].values if start else None for cache, start in zip(caches, starts, strict=True)
            ]
            sizes = (layout.num_kv_heads, layout.key_dim, layout.value_dim)
            layer.fill_padded(keys, values, starts, longest, sizes, dtype, device)
        state = PaddedBatch.attach(caches, mask, batch_cache)
    width = mask.shape[1] - n
    batch_cache = state.cache
    logits = logits_of(
        batch_cache,
        False,
        input_ids=torch.stack([ids for ids, _ in checked]),
        attention_mask=mask,
        position_ids=positions,
    )
    new = transfer.new_rows(batch_cache, width, width + n, batch)  # [L, 2, B, n, H_kv, D]
    state.mask, state.ends = mask, tuple(start + n for start in starts)
    slots = []
    for b, (row, (_, table)) in enumerate(zip(rows, checked, strict=True)):
        row_positions = offsets + row.start_pos
        slots.append(table[row_positions // kv.shape[3]] * kv.shape[3] + row_positions % kv.shape[3])
        keys, values = transfer.kv_layout.unpack(new[:, :, b])  # [L, n, H_kv, D_k], [L, n, H_kv, D_v]
        for layer_index, layer in enumerate(caches[b].layers):
            # [1, H_kv, n, D], the layout the model appends in.
            layer.update(keys[layer_index].transpose(0, 1)[None], values[layer_index].transpose(0, 1)[None])
        row.live.num_tokens = row.start_pos + n
    flat_pool(kv).index_copy_(2, torch.cat(slots), new.flatten(2, 3))
    return list(logits[:, -1].float().split(1))
