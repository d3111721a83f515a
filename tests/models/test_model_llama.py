"""Specification of the embedded Llama model: cached prefill is exact, touches only its own slots, and
rejects bad input with the documented errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.errors import CapacityError, InvalidArgumentError, InvalidTokensError
from prefixcache.models import (
    PRESETS,
    CausalLM,
    LlamaModel,
    build_model,
    kv_pool_shape,
    num_blocks_for,
)

TOL = 1e-4


def _ids(n: int, seed: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _shuffled_table(num_blocks: int, seed: int) -> torch.Tensor:
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))


def _nan_pool(model: LlamaModel, num_blocks: int, block_size: int) -> torch.Tensor:
    # NaN everywhere: reading any slot this request never wrote would poison the logits.
    return torch.full(kv_pool_shape(model, num_blocks, block_size), float("nan"))


def _slots(table: torch.Tensor, positions: range, block_size: int) -> torch.Tensor:
    pos = torch.tensor(list(positions), dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("prefix_len", [37, 32], ids=["prefix_mid_block", "prefix_at_block_boundary"])
def test_cached_suffix_logits_equal_full_recompute(tiny: LlamaModel, block_size: int, prefix_len: int) -> None:
    ids = _ids(prefix_len + 11, seed=block_size)
    num_blocks = num_blocks_for(ids.numel(), block_size) + 5
    kv = _nan_pool(tiny, num_blocks, block_size)
    table = _shuffled_table(num_blocks, seed=prefix_len)

    prefix_logits = tiny.forward_cached(ids[:prefix_len], 0, kv, table, return_logits=True)
    suffix_logits = tiny.forward_cached(ids[prefix_len:], prefix_len, kv, table, return_logits=True)
    reference = tiny.forward_reference(ids, return_logits=True)

    assert suffix_logits.shape == (11, tiny.vocab_size) and suffix_logits.dtype == torch.float32
    assert (prefix_logits - reference[:prefix_len]).abs().max().item() < TOL
    assert (suffix_logits - reference[prefix_len:]).abs().max().item() < TOL


@settings(max_examples=25, deadline=None)
@given(
    block_size=st.integers(1, 32),
    prefix_len=st.integers(0, 40),
    suffix_len=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_any_split_of_any_sequence_is_exact(
    tiny: LlamaModel, block_size: int, prefix_len: int, suffix_len: int, seed: int
) -> None:
    ids = _ids(prefix_len + suffix_len, seed=seed)
    num_blocks = num_blocks_for(ids.numel(), block_size) + 3
    kv = _nan_pool(tiny, num_blocks, block_size)
    table = _shuffled_table(num_blocks, seed=seed)
    if prefix_len:
        tiny.forward_cached(ids[:prefix_len], 0, kv, table)
    suffix_logits = tiny.forward_cached(ids[prefix_len:], prefix_len, kv, table, return_logits=True)
    assert (suffix_logits - tiny.forward_reference(ids, return_logits=True)[prefix_len:]).abs().max().item() < TOL


def test_incremental_greedy_decode_equals_reference(tiny: LlamaModel) -> None:
    prompt, steps, block_size = _ids(9, seed=7), 12, 4
    kv = _nan_pool(tiny, 8, block_size)
    table = _shuffled_table(8, seed=3)

    logits = tiny.forward_cached(prompt, 0, kv, table, return_logits=True)
    rows, seq = [logits[-1]], prompt.tolist()
    for _ in range(steps):
        seq.append(int(rows[-1].argmax()))
        rows.append(tiny.forward_cached(torch.tensor(seq[-1:]), len(seq) - 1, kv, table)[0])

    reference_seq = prompt.tolist()
    for _ in range(steps):
        reference_seq.append(int(tiny.forward_reference(torch.tensor(reference_seq))[-1].argmax()))
    assert seq == reference_seq
    assert len(set(seq[len(prompt) :])) > 1, "greedy decoding should not be constant"
    reference = tiny.forward_reference(torch.tensor(seq), return_logits=True)
    assert (torch.stack(rows) - reference[len(prompt) - 1 :]).abs().max().item() < TOL


@pytest.mark.parametrize("prefix_len", [10, 12])
def test_writes_only_the_new_tokens_slots(tiny: LlamaModel, prefix_len: int) -> None:
    block_size, num_blocks, new = 4, 12, 5
    kv = torch.randn(kv_pool_shape(tiny, num_blocks, block_size), generator=torch.Generator().manual_seed(0))
    table = _shuffled_table(num_blocks, seed=1)[:6]
    ids = _ids(prefix_len + new, seed=2)
    tiny.forward_cached(ids[:prefix_len], 0, kv, table)
    before = kv.clone()

    tiny.forward_cached(ids[prefix_len:], prefix_len, kv, table)

    flat_before = before.view(tiny.num_layers, 2, -1, tiny.num_kv_heads, tiny.head_dim)
    flat_after = kv.view_as(flat_before)
    written = torch.zeros(flat_before.shape[2], dtype=torch.bool)
    written[_slots(table, range(prefix_len, prefix_len + new), block_size)] = True
    assert torch.equal(flat_after[:, :, ~written], flat_before[:, :, ~written])
    assert not torch.isclose(flat_after[:, :, written], flat_before[:, :, written]).any()


def test_requests_sharing_prefix_blocks_stay_exact(tiny: LlamaModel) -> None:
    block_size, prefix_len = 4, 8
    kv = _nan_pool(tiny, 10, block_size)
    prefix, suffix_a, suffix_b = _ids(prefix_len, seed=4), _ids(6, seed=5), _ids(3, seed=6)
    table_a = torch.tensor([7, 2, 5, 0])
    table_b = torch.tensor([7, 2, 9])
    tiny.forward_cached(prefix, 0, kv, table_a)

    logits_a = tiny.forward_cached(suffix_a, prefix_len, kv, table_a, return_logits=True)
    logits_b = tiny.forward_cached(suffix_b, prefix_len, kv, table_b, return_logits=True)

    assert (
        logits_a - tiny.forward_reference(torch.cat([prefix, suffix_a]), return_logits=True)[prefix_len:]
    ).abs().max() < TOL
    assert (
        logits_b - tiny.forward_reference(torch.cat([prefix, suffix_b]), return_logits=True)[prefix_len:]
    ).abs().max() < TOL


def test_start_pos_decides_how_much_prefix_is_attended(tiny: LlamaModel) -> None:
    block_size, ids, suffix = 4, _ids(16, seed=8), _ids(5, seed=9)
    kv = _nan_pool(tiny, 8, block_size)
    table = _shuffled_table(8, seed=10)
    tiny.forward_cached(ids, 0, kv, table)

    at_16 = tiny.forward_cached(suffix, 16, kv.clone(), table, return_logits=True)
    at_12 = tiny.forward_cached(suffix, 12, kv.clone(), table, return_logits=True)

    assert (at_16 - at_12).abs().max().item() > 1e-2
    assert (
        at_12 - tiny.forward_reference(torch.cat([ids[:12], suffix]), return_logits=True)[12:]
    ).abs().max().item() < TOL


def test_rotary_positions_make_token_order_matter(tiny: LlamaModel) -> None:
    ids = _ids(12, seed=11)
    swapped = ids.clone()
    swapped[[2, 5]] = ids[[5, 2]]
    assert ids[2] != ids[5]
    # Without position information attention is a weighted set, blind to the order of earlier tokens.
    diff = (tiny.forward_reference(ids)[-1] - tiny.forward_reference(swapped)[-1]).abs().max().item()
    assert diff > 1e-3


def test_bf16_cached_path_is_as_close_to_float32_as_the_uncached_bf16_path(tiny: LlamaModel) -> None:
    # The bound is bf16's own rounding, measured on the uncached path (about 0.04 here), not a fraction of the
    # logits: prefilling the suffix one position early or late moves the logits by 0.5 or more, and must fail.
    model = build_model("tiny", dtype=torch.bfloat16, device="cpu")
    ids, block_size = _ids(30, seed=12), 8
    kv = torch.zeros(kv_pool_shape(model, 6, block_size), dtype=torch.bfloat16)
    table = _shuffled_table(6, seed=13)
    model.forward_cached(ids[:20], 0, kv, table)
    cached = model.forward_cached(ids[20:], 20, kv, table, return_logits=True)
    exact = tiny.forward_reference(ids, return_logits=True)[20:]
    rounding = (model.forward_reference(ids, return_logits=True)[20:].float() - exact).abs().max().item()

    assert cached.dtype == torch.float32
    assert 0 < rounding < 0.1
    assert (cached - exact).abs().max().item() <= 2 * rounding


@pytest.mark.parametrize(
    ("token_ids", "match"),
    [
        (torch.tensor([1, 512, 3]), r"\[0, 512\)"),
        (torch.tensor([1, -1, 3]), r"\[0, 512\)"),
        (torch.tensor([[1, 2], [3, 4]]), "1-D"),
        (torch.tensor([], dtype=torch.long), "non-empty"),
        (torch.tensor([1.0, 2.0]), "integer"),
        ([1, 2, 3], "integer"),
    ],
    ids=["beyond_vocab", "negative", "two_dimensional", "empty", "float", "list"],
)
def test_bad_token_ids_raise_invalid_tokens(tiny: LlamaModel, token_ids: object, match: str) -> None:
    kv = torch.zeros(kv_pool_shape(tiny, 4, 4))
    with pytest.raises(InvalidTokensError, match=match):
        tiny.forward_cached(token_ids, 0, kv, torch.arange(4))  # type: ignore[arg-type]
    with pytest.raises(InvalidTokensError, match=match):
        tiny.forward_reference(token_ids)  # type: ignore[arg-type]


def test_too_short_block_table_raises_and_leaves_pool_untouched(tiny: LlamaModel) -> None:
    kv = torch.randn(kv_pool_shape(tiny, 4, 4))
    before = kv.clone()
    with pytest.raises(InvalidArgumentError, match="need 3"):
        tiny.forward_cached(_ids(3, seed=0), 6, kv, torch.tensor([0, 1]))
    assert torch.equal(kv, before)


@pytest.mark.parametrize(
    ("start_pos", "kv_shape", "table", "match"),
    [
        (-1, (2, 2, 4, 4, 2, 16), [0, 1], "start_pos"),
        (0, (2, 2, 4, 4, 2, 8), [0, 1], "shape"),
        (0, (3, 2, 4, 4, 2, 16), [0, 1], "shape"),
        (0, (2, 2, 4, 4, 2, 16), [0, 4], r"block 4.*\[0, 4\)"),
        (0, (2, 2, 4, 4, 2, 16), [[0, 1]], "1-D"),
    ],
    ids=["negative_start_pos", "wrong_head_dim", "wrong_layers", "block_id_outside_pool", "two_dimensional_table"],
)
def test_bad_pool_arguments_raise_invalid_argument(
    tiny: LlamaModel, start_pos: int, kv_shape: tuple[int, ...], table: list, match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        tiny.forward_cached(_ids(5, seed=0), start_pos, torch.zeros(kv_shape), torch.tensor(table))


def test_non_contiguous_or_wrong_dtype_pool_is_rejected(tiny: LlamaModel) -> None:
    strided = torch.zeros(2, 2, 4, 2, 4, 16).transpose(3, 4)
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        tiny.forward_cached(_ids(3, seed=0), 0, strided, torch.arange(4))
    with pytest.raises(InvalidArgumentError, match="float64"):
        tiny.forward_cached(
            _ids(3, seed=0), 0, torch.zeros(kv_pool_shape(tiny, 4, 4), dtype=torch.float64), torch.arange(4)
        )


def test_positions_beyond_max_position_raise_capacity_error(tiny: LlamaModel) -> None:
    kv = torch.zeros(kv_pool_shape(tiny, 4, 4))
    with pytest.raises(CapacityError, match="max_position"):
        tiny.forward_cached(_ids(3, seed=0), tiny.max_position - 2, kv, torch.arange(4))
    with pytest.raises(CapacityError, match="max_position"):
        tiny.forward_reference(torch.zeros(tiny.max_position + 1, dtype=torch.long))


def test_last_position_is_usable(tiny: LlamaModel) -> None:
    block_size = 256
    num_blocks = num_blocks_for(tiny.max_position, block_size)
    kv = torch.zeros(kv_pool_shape(tiny, num_blocks, block_size))
    logits = tiny.forward_cached(_ids(1, seed=0), tiny.max_position - 1, kv, torch.arange(num_blocks))
    assert torch.isfinite(logits).all()


def test_fingerprint_is_stable_per_preset_and_distinct_across_presets_and_dtypes() -> None:
    tiny_a, tiny_b = build_model("tiny", device="cpu"), build_model("tiny", device="cpu")
    small = build_model("small", device="cpu")
    assert tiny_a.fingerprint() == tiny_b.fingerprint()
    assert tiny_a.fingerprint() != small.fingerprint()
    assert tiny_a.fingerprint() != build_model("tiny", dtype=torch.bfloat16, device="cpu").fingerprint()
    assert torch.equal(tiny_a.lm_head, tiny_b.lm_head), "same preset must give the same weights"
    assert 10_000_000 <= small.parameter_count() < 100_000_000


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(InvalidArgumentError, match="tiny"):
        build_model("huge")


def test_model_satisfies_protocol_and_reports_kv_size(tiny: LlamaModel) -> None:
    assert isinstance(tiny, CausalLM)
    assert set(PRESETS) >= {"tiny", "small"}
    # 2 (K and V) * 2 layers * 2 KV heads * 16 dims * 4 bytes
    assert tiny.config.kv_bytes_per_token(4) == 512


def test_long_prefill_split_into_query_chunks_stays_exact(tiny: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("prefixcache.models.llama._QUERY_CHUNK", 4)
    ids, block_size = _ids(23, seed=14), 4
    kv = _nan_pool(tiny, 8, block_size)
    table = _shuffled_table(8, seed=15)
    tiny.forward_cached(ids[:6], 0, kv, table)
    cached = tiny.forward_cached(ids[6:], 6, kv, table, return_logits=True)
    assert (cached - tiny.forward_reference(ids, return_logits=True)[6:]).abs().max().item() < TOL
