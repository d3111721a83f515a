"""Tiny configs of the Hugging Face architectures prefixcache serves, for tests and quick benchmarks (extra
``prefixcache[hf]``): hidden size 64, a few layers, a 300-token vocabulary, every layer kind the architecture has
(recurrent beside attention layers for the hybrids), randomly initialised with ``initializer_range`` 0.2 so that logits
differ visibly.  Nothing is downloaded."""

from __future__ import annotations

from typing import Any

import torch

from prefixcache.errors import InvalidArgumentError
from prefixcache.models.hf import HFCausalLM

__all__ = ["HYBRID_MODEL_TYPES", "TINY_CONFIGS", "tiny_hf_config", "tiny_random_model"]

_COMMON: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": 0,
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"num_hidden_layers": 2},
    # Gated DeltaNet layers beside one attention layer, MoE feed-forward.
    "qwen3_next": {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1,
    },
    # Mamba-2, attention and MLP-only layers ("M*M-").
    "nemotron_h": {
        "num_hidden_layers": 4,
        "hybrid_override_pattern": "M*M-",
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 1,
        "head_dim": 16,
        "mamba_d_conv": 4,
        "expand": 1,
        "chunk_size": 16,
    },
    "granitemoehybrid": {
        "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 1,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "mamba_chunk_size": 16,
    },
    # Lightning (linear) attention interleaved with softmax attention, in blocks of 16 tokens.
    "minimax": {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "block_size": 16,
    },
    # Pure Mamba-2: no attention layer, no positions.
    "mamba2": {
        "num_hidden_layers": 2,
        "num_heads": 4,
        "head_dim": 16,
        "state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 1,
        "chunk_size": 16,
        "num_attention_heads": None,
        "num_key_value_heads": None,
        "intermediate_size": None,
        "max_position_embeddings": None,
    },
}
"""Per model type, the fields that differ from the shared tiny sizes (``None``: a field the type does not take)."""

HYBRID_MODEL_TYPES = ("qwen3_next", "nemotron_h", "granitemoehybrid", "minimax", "mamba2")
"""The model types of :data:`TINY_CONFIGS` with recurrent layers (linear attention or SSM)."""


def tiny_hf_config(model_type: str, **overrides: Any) -> Any:
    """The tiny transformers config of ``model_type`` (:data:`TINY_CONFIGS`), with ``overrides`` applied.

    Raises InvalidArgumentError for a model type without a tiny config."""
    from transformers import AutoConfig

    if model_type not in TINY_CONFIGS:
        raise InvalidArgumentError(f"no tiny config for model type {model_type!r}; known: {sorted(TINY_CONFIGS)}")
    values = {**_COMMON, **TINY_CONFIGS[model_type], **overrides}
    return AutoConfig.for_model(model_type, **{k: v for k, v in values.items() if v is not None})


def tiny_random_model(
    model_type: str = "qwen2",
    *,
    vocab_size: int = 300,
    layers: int = 2,
    max_positions: int = 512,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> HFCausalLM:
    """A small randomly initialised Hugging Face model of ``model_type`` for tests and quick benchmarks: hidden size
    64, intermediate 128, 4 query heads over 2 KV heads (grouped-query attention), ``layers`` layers, no BOS/EOS.
    Weights come from the architecture's initialiser (``initializer_range`` 0.2, so that logits differ visibly)
    under ``torch.manual_seed(seed)`` on the CPU, with the global RNG state restored, then moved to ``device``.
    A model type with recurrent layers (:data:`HYBRID_MODEL_TYPES`) is built from its :data:`TINY_CONFIGS` entry
    instead, ``layers`` ignored (its layer pattern needs them all).  Raises UnsupportedModelError as
    :class:`HFCausalLM` does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type in HYBRID_MODEL_TYPES:
        config = tiny_hf_config(model_type, vocab_size=vocab_size, max_position_embeddings=max_positions)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return HFCausalLM(AutoModelForCausalLM.from_config(config).eval().to(device))
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return HFCausalLM(AutoModelForCausalLM.from_config(config).eval().to(device))
