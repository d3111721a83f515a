"""What a model must move at the least, by its shape: the bytes a decode step reads and the FLOPs a prefill computes
(the numerators of ``bench engine``'s floor, :mod:`prefixcache.bench.floor`).

- decode: :func:`decode_step_bytes`, every weight a step multiplies by, read once (layers, final norm, the LM head;
  one embedding row), and the live K/V of its context (llama.cpp's and the roofline's argument: one query's products
  do 2 FLOPs per weight element, far below the machine's FLOPs per byte), at the model's precision: its dtype's
  bytes, or for a model quantized by :mod:`prefixcache.models.quantize` its codes and scales
  (:func:`matrix_bytes`: int8 1 byte a weight + a bfloat16 scale a row, int4 half a byte + a bfloat16 scale and
  offset a group, the LM head int8 as :data:`~prefixcache.models.quantize.HEAD_MODES` says, a matrix the kernel
  cannot take at its dtype's bytes);
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
from prefixcache.models.quantize import HEAD_MODES, int4_group_size, unquantizable

__all__ = ["ModelShape", "decode_step_bytes", "embedded_config", "matrix_bytes", "prefill_flops", "weight_bytes"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes that set a decoder's bytes per step and FLOPs per token; counts, ``element_size`` in bytes.

    ``qkv_bias``: the Q/K/V projections carry a bias (Qwen2).  The LM head is read in full every step whether or not
    it is tied to the embedding (``tied``); the embedding itself gives one row per token.  ``fused``: the layer's
    products are the embedded model's fused Q/K/V and gate/up matrices (else Q, K, V, gate and up apart, as Hugging
    Face's).  ``quantize``: ``"none"``, or the mode the model's linear layers were quantized to, ``group_size`` the
    int4 group size asked for (None: the default); ``element_size`` stays the dtype's (norms, biases, K/V).
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
    fused: bool = False
    tied: bool = False
    quantize: str = "none"
    group_size: int | None = None

    @staticmethod
    def of(model) -> ModelShape:
        """The shape of an embedded :class:`~prefixcache.models.llama.LlamaModel` (its ``ModelConfig``) or of an
        :class:`~prefixcache.models.hf.HFCausalLM` of a Llama-like config.  Raises InvalidArgumentError for a config
        without these sizes."""
        config = model.config
        element = torch.empty((), dtype=model.dtype).element_size()
        summary = getattr(model, "quantization", None)
        quantized = {} if summary is None else {"quantize": summary.mode, "group_size": summary.group_size}
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
                fused=True,
                **quantized,
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
                tied=bool(getattr(config, "tie_word_embeddings", False)),
                **quantized,
            )
        except AttributeError as error:
            raise InvalidArgumentError(f"{model.name}: no Llama-like sizes in its config ({error})") from None

    @property
    def layer_matrices(self) -> tuple[tuple[int, int], ...]:
        """``(N, K)`` (output, input features) of each matrix one layer multiplies by: Q/K/V, output, gate/up and
        down, fused or apart as ``fused`` says."""
        q, kv, hidden, inner = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        if self.fused:
            return ((q + 2 * kv, hidden), (hidden, q), (2 * inner, hidden), (hidden, inner))
        return ((q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inner, hidden), (inner, hidden), (hidden, inner))

    @property
    def layer_matmul_elements(self) -> int:
        """Weight elements one layer multiplies by: Q/K/V, output, gate/up and down projections."""
        return sum(n * k for n, k in self.layer_matrices)

    @property
    def layer_elements(self) -> int:
        """Every weight element of one layer: the products', the Q/K/V bias, the two norms."""
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return self.layer_matmul_elements + bias + 2 * self.hidden


def matrix_bytes(n: int, k: int, mode: str, element_size: int, group_size: int | None = None) -> int:
    """Bytes a weight ``[N, K]`` holds quantized to ``mode`` (:mod:`prefixcache.models.quantize`'s layout): ``"int8"``
    ``N * K`` codes and ``N`` bfloat16 scales; ``"int4"`` ``N * K / 2`` codes and a bfloat16 scale and offset for each
    group of K (:func:`~prefixcache.models.quantize.int4_group_size`) of each row; ``"none"``, or a shape the kernel
    cannot take (:func:`~prefixcache.models.quantize.unquantizable`, so the layer stays dense), ``N * K *
    element_size``.  O(1)."""
    # A stride-0 view stands for the weight: the kernel's rules look at its shape, dtype and device only.
    if mode == "none" or unquantizable(torch.zeros(1).expand(n, k), mode, group_size) is not None:
        return n * k * element_size
    if mode == "int8":
        return n * k + 2 * n
    group = int4_group_size(k, group_size)
    return n * k // 2 + k // group * n * 2 * 2


def weight_bytes(shape: ModelShape) -> int:
    """Bytes of the weights one decode step reads in full, at the shape's precision: every layer's products
    (:func:`matrix_bytes`), Q/K/V bias and norms, the final norm and the whole LM head (in
    :data:`~prefixcache.models.quantize.HEAD_MODES`' mode when quantized); the embedding is left out (a step reads
    one row of it).  Equals the bytes of the tensors a model of that shape keeps for them (a test sums them)."""
    dense = shape.layer_elements - shape.layer_matmul_elements
    size, group = shape.element_size, shape.group_size
    layer = sum(matrix_bytes(n, k, shape.quantize, size, group) for n, k in shape.layer_matrices) + dense * size
    head_mode = HEAD_MODES.get(shape.quantize, "none")
    return shape.layers * layer + shape.hidden * size + matrix_bytes(shape.vocab, shape.hidden, head_mode, size)


def _embedding_row_bytes(shape: ModelShape) -> int:
    """Bytes of one embedding row: the quantized head's codes and scale where the embedding is tied to a quantized
    head (:class:`~prefixcache.models.quantize.QuantizedEmbedding`), else ``hidden`` elements of the dtype."""
    head_mode = HEAD_MODES.get(shape.quantize, "none")
    head_row = matrix_bytes(1, shape.hidden, head_mode, shape.element_size)
    quantized_head = head_row != shape.hidden * shape.element_size
    return head_row if shape.tied and quantized_head else shape.hidden * shape.element_size


def decode_step_bytes(shape: ModelShape, context: int) -> int:
    """Bytes one decode step of one row must read, attending ``context`` keys (its own included): every layer's
    weights, the final norm, the whole LM head (:func:`weight_bytes`, at the shape's precision), one embedding row,
    and K and V of ``context`` positions in every layer (in the dtype: the pool's).  Raises InvalidArgumentError for
    ``context < 1``."""
    if context < 1:
        raise InvalidArgumentError(f"context must be >= 1, got {context}")
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * context * shape.element_size
    return weight_bytes(shape) + _embedding_row_bytes(shape) + kv


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
