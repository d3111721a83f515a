"""The paged-attention rows of ``bench engine``: decode time per token reading the pool through the block table
(:mod:`prefixcache.models.paged_attention`) against the gather of the prefix out of the pool, logits checked equal."""

from __future__ import annotations

import torch

from prefixcache.bench.device_clock import clock
from prefixcache.bench.engine_setup import BLOCK_SIZE, EngineSetup, random_ids
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.paged_attention import paged_attention_supported

__all__ = ["measure_paged"]


@torch.inference_mode()
def measure_paged(setup: EngineSetup, context: int, device: torch.device, atol: float = 1e-4) -> dict:
    """Seconds per decode token at ``context`` tokens on the embedded ``batch_preset`` model: attention through the
    block table (``paged_attention``) against the gather of the prefix out of the pool; every step's logits are
    checked equal between the two (float32, within ``atol``).  The block table is shuffled, so the request's blocks
    are scattered over the pool as they are after evictions."""
    from prefixcache.models.llama import build_model

    model = build_model(setup.batch_preset, device=device)
    steps = setup.decode_steps
    num_blocks = -(-(context + steps) // BLOCK_SIZE)
    if not paged_attention_supported(device, BLOCK_SIZE):
        raise InvalidArgumentError(f"paged attention does not run on {device} with blocks of {BLOCK_SIZE} tokens")
    shape = (model.num_layers, 2, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    kv = torch.zeros(shape, dtype=model.dtype, device=device)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7))
    table = order.to(device)
    ids = torch.tensor(random_ids(model.vocab_size, context + steps, seed=600), device=device)
    model.forward_cached(ids[:context], 0, kv, table)
    seconds = {True: 0.0, False: 0.0}
    for position in range(context, context + steps):
        logits = {}
        for paged in (True, False):
            model.paged_attention = paged
            start = clock()
            logits[paged] = model.forward_cached(ids[position : position + 1], position, kv, table)
            seconds[paged] += clock() - start
        diff = float((logits[True] - logits[False]).abs().max())
        if diff > atol:
            raise AssertionError(f"paged attention at {position}: logits differ from the gather path's by {diff:.3g}")
    return {
        "model": setup.batch_preset,
        "context": context,
        "steps": steps,
        "paged_s": seconds[True] / steps,
        "gather_s": seconds[False] / steps,
    }
