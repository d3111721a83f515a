"""Specification of the models' batched forwards (continuous batching): one ``forward_batch`` over rows of several
requests (prefill chunks and decode rows, different context lengths, grouped-query attention, rows sharing the blocks
of a cached prefix) returns each row's logits as its own uncached reference does (fp32, 1e-4), appends to each row's
live K/V and writes into the pool exactly the rows a serial call writes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.errors import InvalidTokensError
from prefixcache.models.base import BatchRow, LiveKV, kv_pool_shape
from prefixcache.models.llama import PRESETS, LlamaModel, build_model
from prefixcache.models.shared_prefix import plan_shared_prefix_groups, shared_prefix_decode_attention

TOL = 1e-4
BLOCK = 4


def _hf(model_type: str):
    pytest.importorskip("transformers")
    from prefixcache.models.hf_tiny import tiny_random_model

    return tiny_random_model(model_type)


@pytest.fixture(scope="module", params=["embedded", "embedded-gqa4", "qwen2", "llama"])
def model(request):
    if request.param == "embedded":
        return build_model("tiny", device="cpu")  # 4 query heads over 2 KV heads
    if request.param == "embedded-gqa4":
        config = dataclasses.replace(PRESETS["tiny"], name="tiny-gqa4", num_heads=8, num_kv_heads=2)
        return LlamaModel(config, device="cpu")
    return _hf(request.param)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _close(logits: torch.Tensor, model, sequence: list[int]) -> float:
    return float((logits - model.forward_reference(torch.tensor(sequence))).abs().max())


def test_mixed_prefill_chunks_and_decode_rows_equal_their_references(model) -> None:
    """Rows: two decoding behind a shared cached prefix (same pool blocks), one decoding alone at another length, one
    prefill chunk after a live prefix, one cold prefill of the same chunk length, one prefill that gathers its prefix
    from the pool; then every row decodes together for a few steps."""
    system = _ids(12, seed=1)  # three full blocks, cached once and shared
    kv = torch.zeros(kv_pool_shape(model, 64, BLOCK), dtype=model.dtype)
    model.forward_cached(torch.tensor(system), 0, kv, torch.arange(0, 3))
    shared_tables = [torch.cat([torch.arange(0, 3), torch.arange(3 + 8 * i, 11 + 8 * i)]) for i in range(2)]
    tables = [*shared_tables, torch.arange(19, 27), torch.arange(27, 35), torch.arange(35, 43), torch.arange(43, 51)]
    sequences = [system + _ids(3, 2), system + _ids(6, 3), _ids(9, 4), _ids(10, 5), _ids(4, 6), _ids(17, 7)]
    lives = [LiveKV() for _ in sequences]
    # Bring each row to its state before the batched step.
    model.forward_cached(torch.tensor(sequences[0][12:-1]), 12, kv, tables[0], live=lives[0])
    model.forward_cached(torch.tensor(sequences[1][12:-1]), 12, kv, tables[1], live=lives[1])
    model.forward_cached(torch.tensor(sequences[2][:-1]), 0, kv, tables[2], live=lives[2])
    model.forward_cached(torch.tensor(sequences[3][:6]), 0, kv, tables[3], live=lives[3])
    model.forward_cached(torch.tensor(sequences[5][:13]), 0, kv, tables[5])  # pool only: this row gathers
    starts = [len(sequences[0]) - 1, len(sequences[1]) - 1, len(sequences[2]) - 1, 6, 0, 13]
    rows = [
        BatchRow(torch.tensor(seq[start:]), start, table, live)
        for seq, start, table, live in zip(sequences, starts, tables, lives, strict=True)
    ]
    for row_logits, live, sequence in zip(model.forward_batch(rows, kv), lives, sequences, strict=True):
        assert row_logits.shape == (1, model.vocab_size)
        assert _close(row_logits, model, sequence) < TOL
        assert live.num_tokens == len(sequence)
    for step in range(3):
        rows = [
            BatchRow(torch.tensor([seq[-1] % 7 + step]), len(seq), table, live)
            for seq, table, live in zip(sequences, tables, lives, strict=True)
        ]
        sequences = [seq + [int(row.token_ids[0])] for seq, row in zip(sequences, rows, strict=True)]
        for row_logits, live, sequence in zip(model.forward_batch(rows, kv), lives, sequences, strict=True):
            assert _close(row_logits, model, sequence) < TOL
            assert live.num_tokens == len(sequence)
    # The pool holds what serial calls write: a fresh gather-path call reads it back exactly.
    for sequence, table in zip(sequences, tables, strict=True):
        fresh = model.forward_cached(torch.tensor([5]), len(sequence), kv, table)
        assert _close(fresh, model, sequence + [5]) < TOL


def test_bad_row_raises_before_any_row_runs(model) -> None:
    kv = torch.zeros(kv_pool_shape(model, 8, BLOCK), dtype=model.dtype)
    rows = [
        BatchRow(torch.tensor(_ids(3, 1)), 0, torch.arange(0, 4), LiveKV()),
        BatchRow(torch.tensor([model.vocab_size]), 0, torch.arange(4, 8), LiveKV()),
    ]
    with pytest.raises(InvalidTokensError):
        model.forward_batch(rows, kv)
    assert float(kv.abs().max()) == 0.0
    assert all(row.live.num_tokens == 0 for row in rows)


def test_failed_padded_hf_batch_resets_every_rows_live_kv() -> None:
    model = _hf("qwen2")
    kv = torch.zeros(kv_pool_shape(model, 16, BLOCK))
    tables = [torch.arange(0, 8), torch.arange(8, 16)]
    sequences = [_ids(9, 1), _ids(5, 2)]
    lives = [LiveKV(), LiveKV()]
    for seq, table, live in zip(sequences, tables, lives, strict=True):
        model.forward_cached(torch.tensor(seq), 0, kv, table, live=live)
    original = model.model.model.layers[1].forward

    def broken(*args, **kwargs):
        raise RuntimeError("layer 1 failed")

    model.model.model.layers[1].forward = broken
    rows = [BatchRow(torch.tensor([3]), len(s), t, live) for s, t, live in zip(sequences, tables, lives, strict=True)]
    try:
        with pytest.raises(RuntimeError, match="layer 1"):
            model.forward_batch(rows, kv)
    finally:
        model.model.model.layers[1].forward = original
    assert all(live.num_tokens == 0 and live.data is None for live in lives)
    for row_logits, seq in zip(model.forward_batch(rows, kv), sequences, strict=True):
        assert _close(row_logits, model, seq + [3]) < TOL


def _decode_together(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Prefill every sequence but its last token on a fresh pool (8 blocks each, a live K/V per row), then run the
    last tokens as one batched decode step; each row's logits."""
    kv = torch.zeros(kv_pool_shape(model, 8 * len(sequences), BLOCK), dtype=model.dtype)
    tables = [torch.arange(8 * i, 8 * i + 8) for i in range(len(sequences))]
    lives = [LiveKV() for _ in sequences]
    for seq, table, live in zip(sequences, tables, lives, strict=True):
        model.forward_cached(torch.tensor(seq[:-1]), 0, kv, table, live=live)
    rows = [
        BatchRow(torch.tensor(seq[-1:]), len(seq) - 1, table, live)
        for seq, table, live in zip(sequences, tables, lives, strict=True)
    ]
    return model.forward_batch(rows, kv)


def _errors(model, sequences: list[list[int]]) -> list[float]:
    """Per row of :func:`_decode_together`, the largest difference from the uncached reference."""
    logits = _decode_together(model, sequences)
    return [_close(row_logits, model, seq) for row_logits, seq in zip(logits, sequences, strict=True)]


@pytest.mark.parametrize("kind", ["embedded", "qwen2"])
def test_batched_decode_follows_an_in_place_weight_update(kind: str) -> None:
    """Batched decode on the CPU runs the LM head through a packed copy of its weight (models.linear.WeightPacks):
    a write to the weight between two batches must reach the second, as it reaches a one-row forward."""
    model = build_model("tiny", device="cpu") if kind == "embedded" else _hf(kind)
    head = model.lm_head if kind == "embedded" else model.model.lm_head.weight

    assert max(_errors(model, [_ids(6, 1), _ids(9, 2)])) < TOL
    with torch.no_grad():
        head.mul_(-0.5)
    assert max(_errors(model, [_ids(6, 3), _ids(9, 4)])) < TOL


def test_hf_pack_head_off_keeps_no_copy_and_the_same_logits() -> None:
    pytest.importorskip("transformers")
    from prefixcache.models.hf import HFCausalLM

    packed = _hf("qwen2")
    plain = HFCausalLM(packed.model, pack_head=False)
    sequences = [_ids(7, 11), _ids(5, 12), _ids(9, 13)]

    with_copy, without = _decode_together(packed, sequences), _decode_together(plain, sequences)
    assert len(packed.head.head_packs) == 1 and plain.head.head_packs is None
    for a, b, seq in zip(with_copy, without, sequences, strict=True):
        assert float((a - b).abs().max()) < 1e-5
        assert _close(b, plain, seq) < TOL


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 5),
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 4]),
    shared=st.integers(1, 40),
    suffixes=st.lists(st.integers(1, 9), min_size=5, max_size=5),
    seed=st.integers(0, 1000),
)
def test_shared_prefix_attention_equals_one_softmax_over_all_keys(
    rows: int, kv_heads: int, group: int, shared: int, suffixes: list[int], seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    dim, heads, lengths = 8, kv_heads * group, suffixes[:rows]
    q = torch.randn(rows, heads, dim, generator=gen)
    prefix_k, prefix_v = torch.randn(2, shared, kv_heads, dim, generator=gen)
    own_k, own_v = torch.randn(2, sum(lengths), kv_heads, dim, generator=gen) * 3  # packed, row after row
    bounds = [(sum(lengths[:b]), sum(lengths[: b + 1])) for b in range(rows)]
    bias = torch.full((rows, sum(lengths)), float("-inf"))
    for b, (lo, hi) in enumerate(bounds):
        bias[b, lo:hi] = 0.0
    out = shared_prefix_decode_attention(q, prefix_k, prefix_v, own_k, own_v, bias)
    for b, (lo, hi) in enumerate(bounds):
        keys = torch.cat([prefix_k, own_k[lo:hi]]).transpose(0, 1)  # [H_kv, S, D]
        values = torch.cat([prefix_v, own_v[lo:hi]]).transpose(0, 1)
        expected = F.scaled_dot_product_attention(q[b].view(kv_heads, group, dim), keys, values)  # [H_kv, group, D]
        assert float((out[b] - expected.reshape(-1)).abs().max()) < 1e-5


def test_rows_group_by_the_leading_blocks_they_share() -> None:
    tables = [[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 3, 4], [5, 6, 0, 0], [7, 8, 9, 10]]
    ends = [15, 14, 13, 9, 6]  # row 4's new token sits in block 1: only block 0 is wholly before it
    groups = plan_shared_prefix_groups(tables, ends, [0, 1, 2, 3, 4], block_size=4, device=torch.device("cpu"))
    assert [(g.rows, g.shared_tokens) for g in groups] == [((0, 1, 2, 4), 4)]
    group = groups[0]
    # Row 0: positions 4..14 live in blocks 8, 9, 1; then row 1's 4..13, row 2's 4..12 (blocks 8, 3), row 4's 4, 5.
    row0 = [32, 33, 34, 35, 36, 37, 38, 39, 4, 5, 6]
    row1 = [32, 33, 34, 35, 36, 37, 38, 39, 8, 9]
    row2 = [32, 33, 34, 35, 12, 13, 14, 15, 16]
    assert group.suffix_slots.tolist() == row0 + row1 + row2 + [32, 33]
    own = group.suffix_bias == 0
    assert own.sum(dim=1).tolist() == [11, 10, 9, 2]
    assert own[1].nonzero().flatten().tolist() == list(range(11, 21))
    assert bool((group.suffix_bias[~own] == float("-inf")).all())
    # Prefill rows never join a group; a lone row forms none.
    assert plan_shared_prefix_groups(tables, ends, [0, 3], block_size=4, device=torch.device("cpu")) == []


def test_hf_rows_decoding_on_together_keep_one_batch_cache() -> None:
    model = _hf("llama")
    kv = torch.zeros(kv_pool_shape(model, 24, BLOCK))
    tables = [torch.arange(0, 8), torch.arange(8, 16), torch.arange(16, 24)]
    sequences = [_ids(9, 1), _ids(14, 2), _ids(3, 3)]
    lives = [LiveKV() for _ in sequences]
    for seq, table, live in zip(sequences, tables, lives, strict=True):
        model.forward_cached(torch.tensor(seq), 0, kv, table, live=live)
    batches = []
    for step in range(4):
        members = [0, 1, 2] if step < 3 else [0, 2]  # row 1 leaves: the others need a batch of their own
        rows = [BatchRow(torch.tensor([step + 1]), len(sequences[i]), tables[i], lives[i]) for i in members]
        for i in members:
            sequences[i] = sequences[i] + [step + 1]
        for row_logits, i in zip(model.forward_batch(rows, kv), members, strict=True):
            assert _close(row_logits, model, sequences[i]) < TOL
        batches.append(lives[0].data.prefixcache_batch)
    assert batches[0] is batches[1] is batches[2] and batches[3] is not batches[2]
    assert batches[2].cache.get_seq_length() == 14 + 3  # the longest prefix, then one position a step


@pytest.mark.parametrize("kind", ["embedded", "qwen2"])
def test_batched_decode_of_a_model_built_in_inference_mode(kind: str) -> None:
    """A model built (or loaded) under ``torch.inference_mode()`` has inference tensors as weights, which keep no
    version counter: batched decode must still run and equal the references."""
    with torch.inference_mode():
        model = build_model("tiny", device="cpu") if kind == "embedded" else _hf(kind)

    assert max(_errors(model, [_ids(6, 21), _ids(9, 22), _ids(4, 23)])) < TOL


@pytest.mark.parametrize("kind", ["embedded", "qwen2"])
def test_a_model_deep_copied_after_batched_decode_decodes_with_its_own_weights(kind: str) -> None:
    """``copy.deepcopy`` of a model whose batched decode made packed weight copies worked before them: it must still,
    and the copy's batched decode must follow a write to the copy's weights."""
    import copy

    model = build_model("tiny", device="cpu") if kind == "embedded" else _hf(kind)
    sequences = [_ids(6, 31), _ids(9, 32), _ids(4, 33)]

    assert max(_errors(model, sequences)) < TOL
    twin = copy.deepcopy(model)
    with torch.no_grad():
        (twin.lm_head if kind == "embedded" else twin.model.lm_head.weight).mul_(-0.5)
    assert max(_errors(twin, sequences)) < TOL
    assert max(_errors(model, sequences)) < TOL
