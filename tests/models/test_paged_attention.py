"""Specification of attention through the block table (models.paged_attention): it reads the pool in place and gives
what the gather path gives (fp32, within 1e-5), whatever blocks the table names, in any order, shared or not.

On the CPU flex_attention runs eagerly (the unfused reference of the CUDA kernel), which is what these tests
exercise; the CUDA path differs only in compiling the same call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.bench.device_clock import check_device, device_clock
from prefixcache.bench.engine_paged import measure_paged
from prefixcache.bench.engine_setup import QUICK
from prefixcache.cli import main
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.base import LiveKV, kv_pool_shape
from prefixcache.models.llama import build_model
from prefixcache.models.paged_attention import (
    PagedAttention,
    paged_attention_default,
    paged_attention_supported,
    physical_to_logical,
)

TOL = 1e-5
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def gathered_attention(q, k_pool, v_pool, table, block_size, end_pos):
    """The gather path's answer: copy the request's rows out of the pool, then causal SDPA with repeated KV heads."""
    n = q.shape[0]
    positions = torch.arange(end_pos)
    slots = table[positions // block_size] * block_size + positions % block_size
    k = k_pool[slots].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)[None]
    v = v_pool[slots].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)[None]
    mask = positions[None, :] <= torch.arange(end_pos - n, end_pos)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask)
    return out[0].transpose(0, 1).reshape(n, -1)


def random_pool(num_blocks: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V ``[num_blocks * block_size, H_kv, D]`` full of values, so a slot read by mistake shows."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks * block_size, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


@settings(max_examples=15, deadline=None)
@given(
    block_size=st.sampled_from([1, 4, 16]),
    start=st.integers(0, 150),
    num_queries=st.integers(1, 140),
    spare_blocks=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
@torch.inference_mode()
def test_paged_attention_equals_the_gather_path_for_any_scattered_table(
    block_size: int, start: int, num_queries: int, spare_blocks: int, seed: int
) -> None:
    end = start + num_queries
    used = -(-end // block_size)
    num_blocks = used + spare_blocks
    k_pool, v_pool = random_pool(num_blocks, block_size, seed)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:used]
    q = torch.randn(num_queries, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1))

    paged = PagedAttention(table, end, num_blocks, block_size)(q, k_pool, v_pool, torch.arange(start, end))

    expected = gathered_attention(q, k_pool, v_pool, table, block_size, end)
    assert paged.shape == (num_queries, HEADS * HEAD_DIM)
    assert torch.allclose(paged, expected, atol=TOL, rtol=0)


@torch.inference_mode()
def test_two_requests_sharing_prefix_blocks_each_read_only_their_own_blocks() -> None:
    block_size, num_blocks = 4, 12
    k_pool, v_pool = random_pool(num_blocks, block_size, seed=3)
    shared = [9, 2]
    first, second = torch.tensor([*shared, 5, 0]), torch.tensor([*shared, 11, 7])
    q = torch.randn(3, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    outs = []
    for table in (first, second):
        out = PagedAttention(table, 14, num_blocks, block_size)(q, k_pool, v_pool, torch.arange(11, 14))
        assert torch.allclose(out, gathered_attention(q, k_pool, v_pool, table, block_size, 14), atol=TOL, rtol=0)
        outs.append(out)
    # Same prefix blocks, different private blocks: the answers must differ, or the mask read the wrong blocks.
    assert not torch.allclose(outs[0], outs[1])


@torch.inference_mode()
def test_rows_after_the_last_position_in_its_block_are_not_read() -> None:
    block_size, num_blocks = 8, 3
    k_pool, v_pool = random_pool(num_blocks, block_size, seed=5)
    table = torch.tensor([2, 0])
    q = torch.randn(1, HEADS, HEAD_DIM)
    before = PagedAttention(table, 10, num_blocks, block_size)(q, k_pool, v_pool, torch.tensor([9]))
    k_pool[10:16], v_pool[10:16] = 1e3, -1e3  # slots of positions 10..15 in block 0: not yet written

    after = PagedAttention(table, 10, num_blocks, block_size)(q, k_pool, v_pool, torch.tensor([9]))

    assert torch.equal(before, after)


def test_physical_to_logical_marks_blocks_outside_the_table() -> None:
    assert physical_to_logical(torch.tensor([4, 1, 3]), 6).tolist() == [-1, 1, -1, 2, 0, -1]


@torch.inference_mode()
def test_embedded_model_paged_prefill_and_decode_equal_the_gather_path_and_the_reference() -> None:
    model = build_model("tiny", device="cpu")
    block_size, num_blocks = 4, 16
    kv = torch.randn(kv_pool_shape(model, num_blocks, block_size), generator=torch.Generator().manual_seed(6))
    table = torch.tensor([13, 2, 7, 0, 11, 5, 9, 1])
    ids = torch.randint(0, model.vocab_size, (30,), generator=torch.Generator().manual_seed(7))
    reference = model.forward_reference(ids, return_logits=True)
    pools, decodes = {}, {}
    for paged in (False, True):
        model.paged_attention = paged
        pool, live = kv.clone(), LiveKV()
        prefill = model.forward_cached(ids[:21], 0, pool, table, return_logits=True, live=live)
        decode = torch.cat([model.forward_cached(ids[p : p + 1], p, pool, table, live=live) for p in range(21, 30)])
        assert torch.allclose(prefill, reference[:21], atol=1e-4, rtol=0)
        assert torch.allclose(decode, reference[21:], atol=1e-4, rtol=0)
        pools[paged], decodes[paged] = pool, decode
    model.paged_attention = False

    assert torch.allclose(decodes[True], decodes[False], atol=TOL, rtol=0)
    assert torch.allclose(pools[True], pools[False], atol=TOL, rtol=0)  # the same rows written to the same slots
    assert live.data is None  # the paged path reads the pool, not a live copy


def test_paged_attention_is_the_default_on_cuda_only() -> None:
    assert paged_attention_default(torch.device("cuda")) is True
    assert paged_attention_default(torch.device("cpu")) is False
    assert paged_attention_default(torch.device("cuda"), block_size=8) is False
    assert build_model("tiny", device="cpu").paged_attention is False


def test_the_fused_kernel_needs_blocks_of_a_multiple_of_16_tokens() -> None:
    assert paged_attention_supported(torch.device("cuda"), 32)
    assert not paged_attention_supported(torch.device("cuda"), 8)
    assert paged_attention_supported(torch.device("cpu"), 1)


def test_engine_benchmark_paged_decode_checks_its_logits_against_the_gather_path() -> None:
    with device_clock(torch.device("cpu")):
        figures = measure_paged(QUICK, 40, torch.device("cpu"))

    assert figures["context"] == 40 and figures["steps"] == QUICK.decode_steps
    assert figures["paged_s"] > 0 and figures["gather_s"] > 0


def test_engine_benchmark_refuses_an_unknown_device() -> None:
    with pytest.raises(InvalidArgumentError, match="one of"):
        check_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without CUDA gives")
def test_bench_engine_on_cuda_without_cuda_is_a_one_line_error(capsys) -> None:
    assert main(["bench", "engine", "--quick", "--device", "cuda"]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "no CUDA device" in err


def test_runner_tokens_with_paged_attention_equal_those_of_the_gather_path() -> None:
    from prefixcache.engine.runner import PrefixCachingRunner
    from prefixcache.engine.sampling import SamplingParams

    model = build_model("tiny", device="cpu")
    system = list(range(40, 77))
    prompts = [system + [5, 6, 7], system + [9, 8]]  # the second hits the first's blocks
    params = SamplingParams(max_new_tokens=4)
    tokens = {}
    for paged in (False, True):
        model.paged_attention = paged
        runner = PrefixCachingRunner(model, cache_tokens=256, block_size=16)
        assert runner.pool.kv.device == model.device  # the pool lives on the model's device
        results = [runner.generate(p, params) for p in prompts]
        assert results[1].usage.cached_tokens >= 32
        tokens[paged] = [r.token_ids for r in results]

    assert tokens[True] == tokens[False]
