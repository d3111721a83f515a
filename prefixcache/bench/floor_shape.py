"""What a model must move at the least, by its shape: the bytes a decode step reads and the FLOPs a prefill computes
(the numerators of ``bench engine``'s floor, :mod:`prefixcache.bench.floor`).

- decode: :func:`decode_step_bytes`, every weight a step multiplies by, read once (layers, final norm, the LM head;
  one embedding row), and the live K/V of its context (llama.cpp's and the roofline's argument: one query's products
  do 2 FLOPs per weight element, far below the machine's FLOPs per byte);
- prefill: :func:`prefill_flops`, ``2 * tokens`` FLOPs per weight element of the layers, causal attention, the LM
  head on the last position only.

:func:`embedded_config` gives the embedded model a Hugging Face config's sizes, so both model kinds of the floor rows
have one shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.errors import InvalidArgumentError
from prefixcache.models.base import ModelConfig

__all__ = ["ModelShape", "decode_step_bytes", "embedded_config", "prefill_flops"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes that set a decoder's bytes per step and FLOPs per token; counts, ``element_size`` in bytes.

    ``qkv_bias``: the Q/K/V projections carry a bias (Qwen2).  The LM head is read in full every step whether or not
    it is tied to the embedding; the embedding itself gives one row per token.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    element_size: int
    qkv_bias: bool = False

    @staticmethod
    def of(model) -> ModelShape:
        """The shape of an embedded :class:`~prefixcache.models.llama.LlamaModel` (its ``ModelConfig``) or of an
        :class:`~prefixcache.models.hf.HFCausalLM` of a Llama-like config.  Raises InvalidArgumentError for a config
        without these sizes."""
        config = model.config
        element = torch.empty((), dtype=model.dtype).element_size()
        if isinstance(config, ModelConfig):
            return ModelShape(
                config.name,
                config.num_layers,
                config.hidden_size,
                config.num_heads,
                config.num_kv_heads,
                config.head_dim,
                config.intermediate_size,
                config.vocab_size,
                element,
            )
        try:
            heads = config.num_attention_heads
            return ModelShape(
                model.name,
                config.num_hidden_layers,
                config.hidden_size,
                heads,
                config.num_key_value_heads,
                getattr(config, "head_dim", None) or config.hidden_size // heads,
                config.intermediate_size,
                config.vocab_size,
                element,
                qkv_bias=config.model_type == "qwen2",
            )
        except AttributeError as error:
            raise InvalidArgumentError(f"{model.name}: no Llama-like sizes in its config ({error})") from None

    @property
    def layer_matmul_elements(self) -> int:
        """Weight elements one layer multiplies by: Q/K/V, output, gate/up and down projections."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def layer_elements(self) -> int:
        """Every weight element of one layer: the products', the Q/K/V bias, the two norms."""
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return self.layer_matmul_elements + bias + 2 * self.hidden


def decode_step_bytes(shape: ModelShape, context: int) -> int:
    """Bytes one decode step of one row must read, attending ``context`` keys (its own included): every layer's
    weights, the final norm, the whole LM head, one embedding row, and K and V of ``context`` positions in every
    layer.  Raises InvalidArgumentError for ``context < 1``."""
    if context < 1:
        raise InvalidArgumentError(f"context must be >= 1, got {context}")
    weights = shape.layers * shape.layer_elements + shape.vocab * shape.hidden + 2 * shape.hidden
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * context
    return (weights + kv) * shape.element_size


def prefill_flops(shape: ModelShape, tokens: int) -> int:
    """FLOPs of a cold prefill of ``tokens`` positions that keeps the last position's logits: ``2 * tokens`` per
    layer weight element, causal attention (scores and weighted values: ``4 * heads * head_dim`` per query-key pair,
    ``tokens * (tokens + 1) / 2`` pairs a layer), and the LM head for one position.  Norms, rotary and softmax are
    left out (O(tokens * hidden), under 1% here).  Raises InvalidArgumentError for ``tokens < 1``."""
    if tokens < 1:
        raise InvalidArgumentError(f"tokens must be >= 1, got {tokens}")
    products = 2 * tokens * shape.layers * shape.layer_matmul_elements
    attention = shape.layers * 4 * shape.heads * shape.head_dim * (tokens * (tokens + 1) // 2)
    return products + attention + 2 * shape.vocab * shape.hidden


def embedded_config(config_path: str | Path, layers: int, name: str = "qwen2.5-0.5b-shape") -> ModelConfig:
    """An embedded-model config of the sizes in a Hugging Face Llama-like ``config.json`` (or its folder), cut to
    ``layers`` layers; seeded random weights as every embedded preset.  Raises InvalidArgumentError when unreadable."""
    path = Path(config_path)
    path = path / "config.json" if path.is_dir() else path
    try:
        c = json.loads(path.read_text())
        heads = c["num_attention_heads"]
        return ModelConfig(
            name=f"{name}({layers} layers)",
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate_size=c["intermediate_size"],
            max_position=c["max_position_embeddings"],
            rope_theta=float(c.get("rope_theta", 10000.0)),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        )
    except (OSError, ValueError, KeyError) as error:
        raise InvalidArgumentError(f"cannot read a model config from {str(path)!r}: {error}") from None
