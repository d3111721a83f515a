"""Attention that reads K/V straight out of the block pool through the block table: no gathered copy.

The pool holds one layer's keys as ``[num_blocks, block_size, H_kv, D]``; a request's positions live in the blocks its
block table names, in order, anywhere in the pool and possibly shared with other requests.  The gather path
(``index_select`` of the request's slots into a contiguous ``[S, H_kv, D]`` tensor, then SDPA) copies the whole
context on every forward.  Here attention runs over the pool itself and a mask tells which pool slots belong to the
request and are causally visible.

What we chose: PyTorch's ``flex_attention`` with a *physical* ``BlockMask``, the mechanism of PyTorch's paged
attention example (``torch.nn.attention.experimental._paged_attention``) and vLLM's FlexAttention backend:

- The key axis is the flattened pool (``num_blocks * block_size`` slots), and the BlockMask's KV tile is one pool
  block.  For each tile of ``Q_BLOCK_SIZE`` queries the mask lists the request's physical block ids, taken from the
  block table without a copy of K/V: blocks wholly before the tile's first query are *full* (no mask evaluated), the
  rest up to the tile's last query are *partial*.  A fused kernel therefore touches only those blocks, in any order,
  shared or not.
- ``mask_mod`` maps a physical slot back to its logical position (a ``[num_blocks]`` physical-to-logical table, -1
  for blocks the request does not own) and keeps it when it is at or before the query's position.  It is the whole
  truth: the eager implementation ignores the block lists and evaluates it over every slot.
- GQA through ``enable_gqa`` (query head h reads KV head ``h // (H / H_kv)``), scale ``1 / sqrt(D)`` as SDPA.

Why not the alternatives: a hand-written Triton or CUDA paged kernel (vLLM's ``paged_attention_v1``, FlashInfer) is
faster but is a second language to build, ship and test on machines without a GPU; SDPA needs contiguous K/V, so it
cannot avoid the gather; FlashAttention's ``flash_attn_with_kvcache(block_table=...)`` reads pages natively but is an
optional CUDA-only wheel and wants pages of 256 tokens.  ``flex_attention`` ships with torch, compiles to one fused
Triton kernel per shape class on CUDA (a decoding kernel for short query sets), and keeps this module in Python.

Trade-offs: the fused kernel needs ``torch.compile`` (the first call of each shape compiles, seconds; shapes are
marked dynamic to limit recompiles), a KV tile of at least 16 tokens (``block_size`` a multiple of 16; the kernel's
``BLOCK_N`` must divide it, so it is set to the largest of 64, 32, 16 that does), and it builds a small BlockMask per
forward (``[1, 1, ceil(n / Q_BLOCK_SIZE), num_table_blocks]`` int32, shared by every layer; no query-major copy,
which only the backward pass reads).  Eager ``flex_attention``
(the CPU here) is the unfused reference: it materializes ``[H, n, num_blocks * block_size]`` scores over the *whole
pool*, so it is correct but slower than the gather on CPU.  Hence :func:`paged_attention_default`: on for CUDA, off on
the CPU, where tests switch it on to check it against the gather path.  Not yet run on a GPU: whether the compiled
kernel keeps the pool's strided ``[1, H_kv, slots, D]`` view without a copy, and compiles once per shape class rather
than once per forward (each forward brings a new ``mask_mod`` closure), are the first things to check there.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_BLOCK_SIZE = 128
"""Queries per BlockMask row tile (flex_attention's default sparse block size)."""

_BLOCK_N_CHOICES = (64, 32, 16)


def paged_attention_default(device: torch.device, block_size: int | None = None) -> bool:
    """Whether a model on ``device`` should attend through the pool by default: on CUDA (the fused kernel) when the
    pool's ``block_size`` (tokens) suits the kernel (a multiple of 16, or unknown yet); never on the CPU, where the
    eager implementation scores the whole pool and the gather path is faster."""
    return device.type == "cuda" and (block_size is None or block_size % 16 == 0)


def paged_attention_supported(device: torch.device, block_size: int) -> bool:
    """Whether :class:`PagedAttention` runs on ``device`` with pool blocks of ``block_size`` tokens: always in eager
    mode (CPU), and on CUDA when the fused kernel's tile fits a block (``block_size`` a multiple of 16)."""
    return device.type != "cuda" or block_size % 16 == 0


def physical_to_logical(block_table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[num_blocks]`` int32: the logical index of each pool block in ``block_table[m]``, -1 where it is not there.

    Ids in ``block_table`` must be distinct (one request never holds a block twice).  O(num_blocks) on the device.
    """
    table = torch.full((num_blocks,), -1, dtype=torch.int32, device=block_table.device)
    table[block_table] = torch.arange(block_table.numel(), dtype=torch.int32, device=block_table.device)
    return table


def paged_block_mask(
    block_table: torch.Tensor, first_pos: int, num_queries: int, num_blocks: int, block_size: int
) -> BlockMask:
    """The physical BlockMask of ``num_queries`` consecutive queries at positions ``first_pos ..`` over the pool.

    Args:
        block_table: ``[m]`` int64 pool block ids of the request, in logical order, on the pool's device;
            ``m >= ceil((first_pos + num_queries) / block_size)``.
        first_pos: position (tokens) of the first query; every earlier position is context in the pool.
        num_queries: queries ``n >= 1``.
        num_blocks, block_size: the pool's shape (blocks, tokens per block).

    Tile j covers queries ``j * Q_BLOCK_SIZE ..``: its full blocks are logical blocks
    ``0 .. (p_lo + 1) // block_size - 1``, its partial blocks the rest up to ``p_hi // block_size``, with ``p_lo``,
    ``p_hi`` its first and last query positions.  Cost: O(tiles * m) int32 on the device, no host sync.
    """
    device = block_table.device
    num_tiles = -(-num_queries // Q_BLOCK_SIZE)
    used = (first_pos + num_queries - 1) // block_size + 1
    table = block_table[:used].to(torch.int32)
    tile = torch.arange(num_tiles, device=device)
    p_lo = first_pos + tile * Q_BLOCK_SIZE
    p_hi = torch.clamp(p_lo + Q_BLOCK_SIZE - 1, max=first_pos + num_queries - 1)
    num_full = (p_lo + 1) // block_size  # [tiles]
    num_partial = p_hi // block_size + 1 - num_full
    column = torch.arange(used, device=device)
    full_indices = torch.where(column[None, :] < num_full[:, None], table[None, :], 0)
    partial_at = torch.clamp(num_full[:, None] + column[None, :], max=used - 1)
    partial_indices = torch.where(column[None, :] < num_partial[:, None], table[partial_at], 0)
    logical = physical_to_logical(block_table[:used], num_blocks)
    query_offset = torch.tensor(first_pos, dtype=torch.int32, device=device)

    def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        logical_block = logical[kv_idx // block_size]
        position = logical_block * block_size + kv_idx % block_size
        return (logical_block >= 0) & (position <= q_idx + query_offset)

    return BlockMask.from_kv_blocks(
        num_partial.to(torch.int32)[None, None],
        partial_indices.to(torch.int32)[None, None],
        num_full.to(torch.int32)[None, None],
        full_indices.to(torch.int32)[None, None],
        BLOCK_SIZE=(Q_BLOCK_SIZE, block_size),
        mask_mod=visible,
        seq_lengths=(num_queries, num_blocks * block_size),
        compute_q_blocks=False,
    )


class PagedAttention:
    """One forward's attention over the pool for one request: ``attend(q, k_pool, v_pool, start)``.

    Built per forward from the request's block table and its span of positions ``start_pos .. end_pos - 1``; the
    queries of a call are always the span's last ``n`` positions (all of them, or only the last one where the model
    needs a single hidden state), so their first position is ``end_pos - n`` with no device sync.  The BlockMask is
    built once per query count and shared by every layer.
    """

    def __init__(self, block_table: torch.Tensor, end_pos: int, num_blocks: int, block_size: int) -> None:
        self.block_table = block_table
        self.end_pos = end_pos
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._masks: dict[int, BlockMask] = {}

    def __call__(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, start: int) -> torch.Tensor:
        """q ``[n, H, D]`` (the span's last n positions); k_pool, v_pool ``[num_blocks * block_size, H_kv, D]``: one
        layer of the pool, holding this request's rows up to ``end_pos`` -> ``[n, H * D]``.  ``start`` (the first
        query's position) is not read: the span says it."""
        n = q.shape[0]
        mask = self._masks.get(n)
        if mask is None:
            mask = paged_block_mask(self.block_table, self.end_pos - n, n, self.num_blocks, self.block_size)
            self._masks[n] = mask
        return paged_attention(q, k_pool, v_pool, mask, self.block_size)


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_mask: BlockMask, block_size: int
) -> torch.Tensor:
    """``flex_attention`` of q ``[n, H, D]`` over one pool layer ``[num_blocks * block_size, H_kv, D]`` under a
    :func:`paged_block_mask` -> ``[n, H * D]`` in q's dtype.  K/V are read in place (a transposed view, no copy).
    Compiled on CUDA, eager elsewhere."""
    n = q.shape[0]
    query = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    key = k_pool.transpose(0, 1).unsqueeze(0)  # [1, H_kv, slots, D], a view of the pool
    value = v_pool.transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k_pool.shape[1]
    if q.device.type == "cuda":
        block_n = next(b for b in _BLOCK_N_CHOICES if block_size % b == 0)
        options = {"BLOCK_N": block_n, "BLOCK_M": min(64, Q_BLOCK_SIZE)}
        out = _compiled_flex()(query, key, value, block_mask=block_mask, enable_gqa=gqa, kernel_options=options)
    else:
        out = _eager_flex(query, key, value, block_mask, gqa)
    return out[0].transpose(0, 1).reshape(n, -1)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=True)


def _eager_flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: BlockMask, gqa: bool):
    import warnings

    with warnings.catch_warnings():
        # The eager warning says what the module docstring says: on the CPU this is the unfused reference.
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(query, key, value, block_mask=mask, enable_gqa=gqa)
