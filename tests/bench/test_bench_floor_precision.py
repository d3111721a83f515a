"""The floor's bytes at each precision (:func:`prefixcache.bench.floor_shape.weight_bytes` and
:func:`~prefixcache.bench.floor_shape.decode_step_bytes` for bfloat16, int8 and int4 models): the count from the
shape equals the bytes of the tensors a model quantized by :mod:`prefixcache.models.quantize` keeps, layers the kernel
cannot take included.  No timings."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.bench.floor_shape import ModelShape, decode_step_bytes, matrix_bytes, weight_bytes
from prefixcache.bench.precision import PRECISION_NAMES, Precision, parse_precision
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.base import ModelConfig
from prefixcache.models.llama import LlamaModel

# Qwen2.5-0.5B cut to 4 layers: hidden 896, 14 heads over 2 KV heads of 64, MLP 4864, vocab 151,936, tied head.
QWEN4 = ModelShape("qwen", 4, 896, 14, 2, 64, 4864, 151_936, 4, qkv_bias=True, tied=True)


def _embedded_kept_bytes(model: LlamaModel) -> int:
    """Bytes of every tensor the embedded model keeps but the embedding."""
    return sum(t.nbytes for t in model._weights()) - model.embed.nbytes


@settings(max_examples=12, deadline=None)
@given(
    hidden=st.sampled_from([32, 64, 96]),
    heads=st.sampled_from([(2, 1), (4, 2)]),
    intermediate=st.sampled_from([36, 64, 96, 176]),
    vocab=st.sampled_from([64, 200]),
    mode=st.sampled_from(["none", "int8", "int4"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    group_size=st.sampled_from([None, 64]),
)
def test_the_floor_counts_the_bytes_a_quantized_embedded_model_keeps(
    hidden, heads, intermediate, vocab, mode, dtype, group_size
) -> None:
    config = ModelConfig("t", vocab, hidden, 2, heads[0], heads[1], hidden // heads[0], intermediate, 64)
    model = LlamaModel(config, dtype=dtype, device="cpu")
    if mode != "none":
        model.quantize(mode, group_size=group_size)
    shape = ModelShape.of(model)
    assert (shape.quantize, shape.fused, shape.element_size) == (mode, True, dtype.itemsize)
    assert weight_bytes(shape) == _embedded_kept_bytes(model)
    kv = 2 * 2 * heads[1] * (hidden // heads[0]) * 100 * dtype.itemsize
    assert decode_step_bytes(shape, 100) == weight_bytes(shape) + hidden * dtype.itemsize + kv


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_the_floor_counts_the_bytes_a_quantized_hugging_face_model_keeps(mode: str) -> None:
    pytest.importorskip("transformers")
    from prefixcache.models.hf_tiny import tiny_random_model

    model = tiny_random_model("qwen2", vocab_size=304)
    if mode != "none":
        model.quantize(mode)
    tensors = {t.data_ptr(): (name, t) for name, t in [*model.model.named_parameters(), *model.model.named_buffers()]}
    kept = sum(t.nbytes for name, t in tensors.values() if "embed_tokens" not in name and "rotary" not in name)
    shape = ModelShape.of(model)
    assert (shape.fused, shape.tied, shape.qkv_bias, shape.quantize) == (False, False, True, mode)
    assert weight_bytes(shape) == kept


def test_qwen_shape_bytes_per_precision_by_hand() -> None:
    layer_products = 14_909_440  # Q/K/V, O, gate, up, down
    rows = 896 + 2 * 128 + 896 + 2 * 4864 + 896  # N of the seven products: one int8 scale each
    dense = 1152 + 2 * 896  # Q/K/V bias and two norms, in the dtype
    int8_layer = layer_products + 2 * rows + dense * 4
    # int4: half a byte a weight, a bfloat16 scale and offset per 32 of K: K = 896 for six products, 4864 for down
    groups = (896 // 32) * (896 + 2 * 128 + 896 + 2 * 4864) + (4864 // 32) * 896
    int4_layer = layer_products // 2 + 4 * groups + dense * 4
    head_int8 = 151_936 * 896 + 2 * 151_936
    assert weight_bytes(dataclasses.replace(QWEN4, quantize="int8")) == 4 * int8_layer + 896 * 4 + head_int8
    int4 = dataclasses.replace(QWEN4, quantize="int4")
    assert weight_bytes(int4) == 4 * int4_layer + 896 * 4 + head_int8
    # a tied quantized head: the embedding row is one int8 row and its scale; K/V stay in float32
    assert decode_step_bytes(int4, 2048) == weight_bytes(int4) + 896 + 2 + 2 * 4 * 2 * 64 * 2048 * 4


def test_a_matrix_the_kernel_cannot_take_counts_dense() -> None:
    assert matrix_bytes(64, 36, "int8", 4) == 64 * 36 * 4  # K not a multiple of 8
    assert matrix_bytes(40, 64, "int4", 2) == 40 * 64 * 2  # N not a multiple of 16
    assert matrix_bytes(64, 96, "int4", 4, group_size=64) == 64 * 48 + (96 // 32) * 64 * 4  # 64 does not divide 96


def test_precisions_parse_to_a_dtype_and_a_quantization() -> None:
    assert [parse_precision(name).name for name in PRECISION_NAMES] == list(PRECISION_NAMES)
    assert parse_precision("int8") == Precision("float32", "int8")
    assert parse_precision("bfloat16+int4") == Precision("bfloat16", "int4")
    assert parse_precision("bfloat16").torch_dtype is torch.bfloat16
    for bad in ("int3", "float32+none", "bf16", "int8+bfloat16", ""):
        with pytest.raises(InvalidArgumentError):
            parse_precision(bad)
