"""The hybrid-model rows of ``prefixcache bench engine``: warm TTFT of a model with recurrent layers, resuming the
cached prefix from its state snapshot, against the model's own transformers calls.

The model has Qwen3-Next's layout (Gated DeltaNet layers beside softmax attention, three to one, MoE feed-forward),
random weights, sized down to run on a CPU; ``quick`` uses the tiny test config.  Baselines, in one process, repeats
interleaved, medians: the model's own forward of the whole prompt with no cache (what serving it without prefix reuse
costs) and its own forward of only the suffix on a copy of a transformers cache that holds the prefix.  Clock:
:mod:`prefixcache.bench.device_clock`'s, as in :mod:`prefixcache.bench.engine`.
"""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch

from prefixcache.bench.common import ms_cells
from prefixcache.bench.device_clock import clock, device_clock
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams

__all__ = ["QWEN3_NEXT_LAYOUT", "hybrid_note", "hybrid_rows", "measure_hybrid", "own_forward"]

QWEN3_NEXT_LAYOUT: dict[str, Any] = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "linear_num_value_heads": 8,
    "linear_num_key_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
}
"""The full run's sizes over :data:`~prefixcache.models.hf_tiny.TINY_CONFIGS` ``["qwen3_next"]``."""

SUFFIX_TOKENS = 64
BLOCK_SIZE = 16


@torch.inference_mode()
def own_forward(model: Any, ids: list[int], cache: Any) -> tuple[float, int]:
    """Seconds of the HF adapter ``model``'s own forward of ``ids`` after ``cache``'s positions (a transformers cache,
    appended to) with ``logits_to_keep=1``, and its greedy token; on :func:`~prefixcache.bench.device_clock.clock`
    (the caller's :func:`~prefixcache.bench.device_clock.device_clock` for CUDA)."""
    start = cache.get_seq_length()
    began = clock()
    out = model.model(
        input_ids=torch.tensor([ids], device=model.device),
        position_ids=torch.arange(start, start + len(ids), device=model.device)[None],
        use_cache=True,
        logits_to_keep=1,
        **{model.cache_kwarg: cache},
    )
    token = int(out.logits[0, -1].argmax())
    return clock() - began, token


def measure_hybrid(tokens: int, repeats: int, quick: bool, device: torch.device | str = "cpu") -> dict:
    """Warm TTFT of ``tokens``-token prompts whose first ``tokens - 64`` are cached (the state snapshot kept where
    the prefix ended) through the runner, against the two baselines of the module docstring; seconds, medians of
    ``repeats``.  Raises AssertionError when a greedy token differs from the model's or the prefix was not resumed."""
    from transformers import AutoModelForCausalLM

    from prefixcache.models.hf import HFCausalLM
    from prefixcache.models.hf_tiny import tiny_hf_config

    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = tiny_hf_config("qwen3_next", **({} if quick else QWEN3_NEXT_LAYOUT))
        model = HFCausalLM(AutoModelForCausalLM.from_config(config).eval().to(device))
    generator = torch.Generator().manual_seed(300)
    prefix = torch.randint(0, model.vocab_size, (tokens - SUFFIX_TOKENS,), generator=generator).tolist()
    runner = PrefixCachingRunner(model, cache_tokens=tokens + (repeats + 4) * SUFFIX_TOKENS, block_size=BLOCK_SIZE)
    runner.generate(prefix, SamplingParams(max_new_tokens=0))
    prefilled = model.transfer.new_cache(tokens)
    own_forward(model, prefix, prefilled)
    ours, uncached, suffix_only = [], [], []
    for _ in range(repeats):
        suffix = torch.randint(0, model.vocab_size, (SUFFIX_TOKENS,), generator=generator).tolist()
        cache = copy.deepcopy(prefilled)
        with device_clock(device):
            began = clock()
            result = runner.generate(prefix + suffix, SamplingParams(max_new_tokens=1))
            ours.append(clock() - began)
            seconds, token = own_forward(model, prefix + suffix, model.transfer.new_cache(tokens))
            own_seconds, own_token = own_forward(model, suffix, cache)
        if result.usage.cached_tokens != len(prefix):
            raise AssertionError(f"hybrid warm run resumed {result.usage.cached_tokens} tokens, not {len(prefix)}")
        if not token == own_token == result.token_ids[0]:
            raise AssertionError(f"hybrid warm prefill: runner {result.token_ids[0]}, model {token} / {own_token}")
        uncached.append(seconds)
        suffix_only.append(own_seconds)
    return {
        "model": model.name,
        "tokens": tokens,
        "suffix": SUFFIX_TOKENS,
        "state_bytes": model.state_bytes,
        "kv_bytes_per_token": 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.dtype.itemsize,
        "ours_s": statistics.median(ours),
        "uncached_s": statistics.median(uncached),
        "suffix_s": statistics.median(suffix_only),
    }


def hybrid_rows(hybrid: dict) -> list[tuple[str, ...]]:
    """The two table rows of :func:`measure_hybrid`'s figures (milliseconds and the ratio to each baseline)."""
    tokens = f"{hybrid['tokens']:,} ({hybrid['suffix']} new)"
    baselines = (("uncached_s", "model forward, no cache"), ("suffix_s", "model forward of the suffix"))
    return [
        (
            "hybrid warm TTFT (ms)",
            tokens,
            f"{baseline} ({hybrid['model']}, Qwen3-Next layout)",
            *ms_cells(hybrid["ours_s"], hybrid[key]),
        )
        for key, baseline in baselines
    ]


def hybrid_note(hybrid: dict) -> str:
    """The table note that says what the hybrid rows measure."""
    return (
        f"'hybrid': the prefix resumes from a {hybrid['state_bytes']:,}-byte recurrent-state snapshot kept at its end "
        f"plus {hybrid['kv_bytes_per_token']:,} bytes of K/V per token (attention layers only); the runner's prefill "
        "also stops where it keeps states (every 16 blocks, before the last token); transformers' linear-attention "
        "kernels fall back to PyTorch here"
    )
