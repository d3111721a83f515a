"""Specification of weight-only int8 and int4 (:mod:`prefixcache.models.quantize`) on the embedded presets.

A quantized weight's product is the bfloat16-rounded input times the dequantized weight, by the kernel for a few rows
and by the dequantized weight for more, equal to float rounding; shapes the kernels cannot take are refused, and a
model leaves those layers dense and says so.  With the same quantized weights, a warm cache, a cold runner and the
batching engine write the same greedy tokens (up to a near tie the bfloat16 logits decide), and the logits after a
cached prefix are within a few bfloat16 steps of the unsplit forward's.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.cli.options import QUANTIZE_CHOICES
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.results import GenerationResult
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.linear import linear, project
from prefixcache.models.llama import LlamaModel, build_model
from prefixcache.models.loading import load_model
from prefixcache.models.quantize import (
    KERNEL_ROWS,
    QUANTIZE_MODES,
    QuantizedWeight,
    parse_quantize,
    quantize_weight,
    unquantizable,
)
from prefixcache.testing import assert_quiescent

# Logits after a quantized LM head are bfloat16: of magnitude 4-8 (the presets'), 0.03125 apart.  Measured: cached
# against unsplit 0.03125 (small), 0.0078 (tiny int4), 0 (tiny int8).
LOGIT_TOL = 0.0625
# Two runs' greedy picks may differ where the top two are this close (seen: an exact tie in one run, 0.0625 apart in
# the other).
TIE = 0.125
NEW_TOKENS = 12


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["int8", "int4"])
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module", params=["tiny", "small"])
def quantized(request: pytest.FixtureRequest, mode: str) -> LlamaModel:
    model = build_model(request.param, device="cpu")
    model.quantize(mode)
    return model


def test_int8_stores_a_byte_a_weight_and_a_bfloat16_scale_a_row() -> None:
    weight = _weight(96, 64)
    q = quantize_weight(weight, "int8")
    assert (q.codes.dtype, q.codes.shape, q.scales.dtype, q.scales.shape) == (
        torch.int8,
        (96, 64),
        torch.bfloat16,
        (96,),
    )
    assert q.nbytes == 96 * 64 + 96 * 2
    step = q.scales.float()[:, None]
    assert bool(((q.dequantize() - weight).abs() <= step / 2 + 1e-7).all())  # round to nearest, no code clipped
    assert int(q.codes.abs().max()) <= 127


def test_int4_stores_half_a_byte_a_weight_and_a_scale_and_offset_per_group() -> None:
    weight = _weight(96, 128)
    q = quantize_weight(weight, "int4")
    assert q.group_size == 32
    assert (q.codes.dtype, q.codes.shape) == (torch.uint8, (96, 64))
    assert (q.scales.dtype, q.scales.shape) == (torch.bfloat16, (4, 96, 2))
    assert q.nbytes == 96 * 64 + 4 * 96 * 2 * 2
    step = q.scales[..., 0].float().t().repeat_interleave(32, dim=1)  # [N, K]: each weight's group scale
    assert bool(((q.dequantize() - weight).abs() <= step * 0.51).all())


@pytest.mark.parametrize("shape", [(48, 64), (96, 96), (32, 128)])
def test_rows_read_back_the_packed_int4_codes_of_any_row(shape: tuple[int, int]) -> None:
    """Rows looked up one by one (a tied embedding's) equal the whole dequantized weight's rows, in the kernel's
    blocks of 32 rows and in a last block of 16."""
    q = quantize_weight(_weight(*shape), "int4")
    ids = torch.tensor([shape[0] - 1, 0, 17, shape[0] // 2, shape[0] - 16])
    assert torch.equal(q.rows(ids), q.dequantize()[ids])
    assert torch.equal(q.dequantize(16, 32), q.dequantize()[16:32])


@pytest.mark.parametrize("rows", [1, 3, "kernel", "dequantized"])
def test_a_product_is_the_bfloat16_input_times_the_dequantized_weight(mode: str, rows: int | str) -> None:
    """Through the kernel (up to KERNEL_ROWS rows) or the dequantized weight (more), the product is ``x`` rounded to
    bfloat16 times the dequantized weight, rounded to bfloat16: equal up to one bfloat16 step (float32 summation
    order), in the input's dtype, with the bias added after."""
    rows = {"kernel": KERNEL_ROWS[mode], "dequantized": KERNEL_ROWS[mode] + 1}.get(rows, rows)
    q = quantize_weight(_weight(160, 192), mode)
    x, bias = torch.randn(rows, 192, generator=torch.Generator().manual_seed(1)), torch.randn(160)
    expected = torch.nn.functional.linear(x.bfloat16().float(), q.dequantize()).bfloat16().float() + bias
    for product in (q.linear(x, bias), linear(x, q, bias), project(x, q, bias)):
        assert product.dtype == torch.float32 and product.shape == (rows, 160)
        torch.testing.assert_close(product, expected, rtol=2**-7, atol=1e-3)
    assert q.linear(x.bfloat16()).dtype == torch.bfloat16
    assert q.linear(x.view(1, rows, 192)).shape == (1, rows, 160)
    assert q.linear(x[:0]).shape == (0, 160)


@pytest.mark.parametrize(
    ("shape", "mode", "reason"),
    [
        ((64, 12), "int8", "K = 12 is not a multiple of 8"),
        ((40, 64), "int4", "N = 40 is not a multiple of 16"),
        ((64, 80), "int4", "K = 80 is a multiple of no group size of the kernel up to 32"),
    ],
)
def test_shapes_the_kernels_cannot_take_are_refused(shape: tuple[int, int], mode: str, reason: str) -> None:
    weight = _weight(*shape)
    assert reason in unquantizable(weight, mode)
    with pytest.raises(InvalidArgumentError, match=reason):
        quantize_weight(weight, mode)


def test_unknown_modes_and_group_sizes_are_refused() -> None:
    assert parse_quantize(None) == "none" and parse_quantize("int4") == "int4"
    with pytest.raises(InvalidArgumentError, match="unknown quantization 'int2'"):
        parse_quantize("int2")
    with pytest.raises(InvalidArgumentError, match="int8' or 'int4'"):
        quantize_weight(_weight(32, 64), "none")
    with pytest.raises(InvalidArgumentError, match="group_size must be one of"):
        quantize_weight(_weight(32, 64), "int4", group_size=16)
    with pytest.raises(InvalidArgumentError, match="unknown quantization"):
        load_model("tiny", quantize="fp8")


def test_the_cli_offers_the_modes_the_module_knows() -> None:
    assert QUANTIZE_CHOICES == QUANTIZE_MODES


def test_a_model_quantizes_its_projections_and_head_and_names_the_layers_left_dense() -> None:
    """int8 takes every weight of ``tiny``; int4 (groups of 32) leaves the down projections dense (K = 176 is no
    multiple of 32) and keeps the head in int8.  The embedding stays dense."""
    int8 = load_model("tiny", quantize="int8")
    assert int8.quantization.describe() == "int8 (per channel)"
    assert len(int8.quantization.quantized) == 9 and not int8.quantization.dense
    assert isinstance(int8.lm_head, QuantizedWeight) and isinstance(int8.embed, torch.Tensor)
    int4 = load_model("tiny", quantize="int4")
    assert int4.quantization.describe() == "int4 (groups of 32, LM head int8, 2 layers dense)"
    reason = "K = 176 is a multiple of no group size of the kernel up to 32"
    assert int4.quantization.dense == tuple(f"layers.{i}.down: {reason}" for i in range(2))
    assert int4.lm_head.mode == "int8" and int4.layers[0].qkv.mode == "int4"
    assert isinstance(int4.layers[0].down, torch.Tensor)
    assert int4.quantization.quantized_bytes < int4.quantization.dense_bytes / 3
    assert int4.parameter_count() == build_model("tiny").parameter_count()
    with pytest.raises(InvalidArgumentError, match="already quantized"):
        int4.quantize("int8")


def test_fingerprints_differ_by_quantization_and_repeat_across_builds() -> None:
    prints = {mode: load_model("tiny", quantize=mode).fingerprint() for mode in QUANTIZE_MODES}
    assert len(set(prints.values())) == 3
    assert load_model("tiny", quantize="int4").fingerprint() == prints["int4"]


def _same_greedy(ours: GenerationResult, theirs: GenerationResult) -> None:
    """Equal tokens, or equal up to a step where, in both runs, the two tokens chosen are the top two within TIE."""
    for step, (mine, other) in enumerate(zip(ours.token_ids, theirs.token_ids, strict=True)):
        if mine != other:
            for run in (ours, theirs):
                (first, best), (second, runner_up) = run.logprobs[step].top
                assert {first, second} == {mine, other} and best - runner_up <= TIE, (step, run.logprobs[step].top)
            return


def _greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=2)


def test_warm_cold_and_batched_greedy_tokens_agree_with_the_same_quantized_weights(quantized: LlamaModel) -> None:
    """Three prompts sharing a 40-token prefix: served after the prefix by a warm runner (cached prefix), by a runner
    that has seen nothing, and together by the batching engine (chunks of 32 tokens beside decode rows)."""
    shared = _ids(40, 7)
    prompts = [shared + _ids(n, seed) for n, seed in ((9, 1), (30, 2), (3, 3))]
    warm = PrefixCachingRunner(quantized, cache_tokens=2048)
    warm.generate(shared, SamplingParams(max_new_tokens=2))
    warm_results = [warm.generate(ids, _greedy()) for ids in prompts]
    assert [r.usage.cached_tokens for r in warm_results] == [40, 40, 40]
    engine = BatchEngine(PrefixCachingRunner(quantized, cache_tokens=2048), max_batch_tokens=32)
    handles = [engine.submit(ids, _greedy()) for ids in prompts]
    engine.run_until_idle()
    for ids, result, handle in zip(prompts, warm_results, handles, strict=True):
        cold = PrefixCachingRunner(quantized, cache_tokens=512).generate(ids, _greedy())
        assert cold.usage.cached_tokens == 0
        _same_greedy(result, cold)
        _same_greedy(result, handle.result())
    assert_quiescent(warm.cache)
    assert_quiescent(engine.runner.cache)


def test_logits_after_a_cached_prefix_are_within_bfloat16_steps_of_the_unsplit_forward(quantized: LlamaModel) -> None:
    """The prompt logits computed after a cached prefix (the suffix by the kernel or the dequantized weight) differ
    from one uncached forward of the whole prompt by at most LOGIT_TOL."""
    shared = _ids(40, 7)
    runner = PrefixCachingRunner(quantized, cache_tokens=2048)
    runner.generate(shared, SamplingParams(max_new_tokens=1))
    for n, seed in ((5, 1), (30, 2)):
        ids = shared + _ids(n, seed)
        result = runner.generate(ids, SamplingParams(max_new_tokens=1), return_logits=True)
        reference = quantized.forward_reference(torch.tensor(ids), return_logits=True, logits_from=40)
        assert result.usage.cached_tokens == 40 and result.prompt_logits.shape == reference.shape
        assert float((result.prompt_logits - reference).abs().max()) <= LOGIT_TOL


def test_serve_names_the_quantization_on_its_start_line() -> None:
    from prefixcache.cli.serve import _describe_model
    from prefixcache.models.sources import resolve_model

    model = load_model("tiny", quantize="int8")
    runner = PrefixCachingRunner(model, cache_tokens=64)
    line = _describe_model(resolve_model("tiny"), model, runner.pool)
    assert "weights int8 (per channel) over float32, K/V float32" in line


def test_from_model_quantizes() -> None:
    runner = PrefixCachingRunner.from_model("tiny", quantize="int4", cache_tokens=64)
    assert runner.model.quantization.mode == "int4"
    assert runner.generate(_ids(10, 1), SamplingParams(max_new_tokens=3)).token_ids


def test_serve_and_replay_take_the_option() -> None:
    from prefixcache.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--quantize", "int8"]).quantize == "int8"
    assert parser.parse_args(["replay", "x.jsonl", "--quantize", "int4"]).quantize == "int4"
    assert parser.parse_args(["replay", "x.jsonl"]).quantize == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantize", "int2"])
    assert isinstance(parser, argparse.ArgumentParser)
