"""Specification of last-position logits and decode against live K/V, for the embedded model and the HF adapter.

By default ``forward_cached``/``forward_reference`` run the LM head on the last position only; with
``return_logits=True`` on every new position.  A request's :class:`LiveKV` holds its K/V across calls: logits equal
the uncached reference (fp32, 1e-4), and the pool receives exactly the rows the gather path writes."""

from __future__ import annotations

import pytest
import torch

from prefixcache.errors import InvalidArgumentError
from prefixcache.models.base import LiveKV, kv_pool_shape, num_blocks_for
from prefixcache.models.llama import build_model

TOL = 1e-4


def _tiny_hf(model_type: str):
    pytest.importorskip("transformers")
    from prefixcache.models.hf_tiny import tiny_random_model

    return tiny_random_model(model_type)


@pytest.fixture(scope="module", params=["embedded", "qwen2", "llama"])
def model(request):
    if request.param == "embedded":
        return build_model("tiny", device="cpu")
    return _tiny_hf(request.param)


def _ids(model, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, min(model.vocab_size, 300), (n,), generator=torch.Generator().manual_seed(seed))


def _pool(model, num_tokens: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks = num_blocks_for(num_tokens, block_size)
    kv = torch.zeros(kv_pool_shape(model, num_blocks + 2, block_size), dtype=model.dtype)
    # A scrambled table, so that a position/slot mix-up cannot pass by accident.
    table = torch.randperm(num_blocks + 2, generator=torch.Generator().manual_seed(7))[:num_blocks]
    return kv, table


def test_default_logits_are_the_last_row_of_all_logits(model) -> None:
    ids = _ids(model, 40, seed=1)
    kv, table = _pool(model, 40, 8)
    full = model.forward_cached(ids, 0, kv.clone(), table, return_logits=True)
    last = model.forward_cached(ids, 0, kv.clone(), table)
    assert full.shape == (40, model.vocab_size) and last.shape == (1, model.vocab_size)
    assert (last[0] - full[-1]).abs().max().item() < TOL
    reference_last = model.forward_reference(ids)
    reference_full = model.forward_reference(ids, return_logits=True)
    assert reference_last.shape == (1, model.vocab_size) and reference_full.shape == (40, model.vocab_size)
    assert (reference_last[0] - reference_full[-1]).abs().max().item() < TOL
    assert (last[0] - reference_full[-1]).abs().max().item() < TOL


def test_last_position_prefill_writes_every_new_positions_kv(model) -> None:
    ids = _ids(model, 30, seed=2)
    kv_all, table = _pool(model, 35, 4)
    kv_last = kv_all.clone()
    model.forward_cached(ids, 0, kv_all, table, return_logits=True)
    model.forward_cached(ids, 0, kv_last, table)
    # The skipped LM head must not skip any layer's K/V: a later request reads them all.
    assert (kv_all - kv_last).abs().max().item() < 1e-6
    suffix = _ids(model, 5, seed=3)
    after = model.forward_cached(suffix, 30, kv_last, table, return_logits=True)
    reference = model.forward_reference(torch.cat([ids, suffix]), return_logits=True)[30:]
    assert (after - reference).abs().max().item() < TOL


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_decode_with_live_kv_equals_the_uncached_reference(model, block_size: int) -> None:
    prompt = _ids(model, 23, seed=4)
    steps = 50  # past the embedded model's first live capacity (64) and across many block boundaries
    kv, table = _pool(model, len(prompt) + steps, block_size)
    live = LiveKV()
    logits = model.forward_cached(prompt, 0, kv, table, live=live)
    assert live.num_tokens == len(prompt)
    seq = prompt.tolist()
    for _ in range(steps):
        token = int(logits[-1].argmax())
        seq.append(token)
        reference = model.forward_reference(torch.tensor(seq))
        logits = model.forward_cached(torch.tensor([token]), len(seq) - 1, kv, table, live=live)
        assert live.num_tokens == len(seq)
        assert (logits - reference).abs().max().item() < TOL
    # The pool holds what a gather-path run writes: a later request may hit these blocks.
    kv_gather, _ = _pool(model, len(seq), block_size)
    model.forward_cached(torch.tensor(seq), 0, kv_gather, table)
    used = table.tolist()
    assert (kv[:, :, used] - kv_gather[:, :, used]).abs().max().item() < 1e-5


def test_live_kv_filled_from_a_cached_prefix_reads_the_pool_once_then_itself(model) -> None:
    ids = _ids(model, 60, seed=5)
    kv, table = _pool(model, 60, 8)
    model.forward_cached(ids[:40], 0, kv, table)  # another request cached the prefix
    live = LiveKV()
    model.forward_cached(ids[40:50], 40, kv, table, live=live)
    assert live.num_tokens == 50
    # Poison the pool's prefix rows: a call that re-gathered them would now be wrong, the live K/V is not.
    prefix_blocks = table[: 40 // 8]
    kv[:, :, prefix_blocks] = 1.0e4
    logits = model.forward_cached(ids[50:], 50, kv, table, live=live, return_logits=True)
    reference = model.forward_reference(ids, return_logits=True)[50:]
    assert (logits - reference).abs().max().item() < TOL


def test_live_kv_at_another_start_position_is_refilled_from_the_pool(model) -> None:
    ids = _ids(model, 40, seed=6)
    kv, table = _pool(model, 40, 4)
    live = LiveKV()
    model.forward_cached(ids[:30], 0, kv, table, live=live)
    # Rewind to 20 (e.g. a retry): the live K/V hold 30 positions, so it must not be trusted.
    logits = model.forward_cached(ids[20:], 20, kv, table, live=live, return_logits=True)
    assert live.num_tokens == 40
    assert (logits - model.forward_reference(ids, return_logits=True)[20:]).abs().max().item() < TOL


def test_live_must_be_a_livekv(model) -> None:
    kv, table = _pool(model, 4, 4)
    with pytest.raises(InvalidArgumentError, match="LiveKV"):
        model.forward_cached(_ids(model, 4, seed=0), 0, kv, table, live={"keys": None})


def test_failed_hf_call_resets_live_kv() -> None:
    model = _tiny_hf("qwen2")
    ids = _ids(model, 20, seed=8)
    kv, table = _pool(model, 20, 4)
    live = LiveKV()
    model.forward_cached(ids[:10], 0, kv, table, live=live)
    original = model.model.model.layers[1].forward

    def broken(*args, **kwargs):
        raise RuntimeError("layer 1 failed")

    model.model.model.layers[1].forward = broken
    try:
        with pytest.raises(RuntimeError, match="layer 1"):
            model.forward_cached(ids[10:15], 10, kv, table, live=live)
    finally:
        model.model.model.layers[1].forward = original
    # Layer 0 had already appended rows of the failed call: the live K/V must not be reused as they are.
    assert live.num_tokens == 0 and live.data is None
    logits = model.forward_cached(ids[10:], 10, kv, table, live=live, return_logits=True)
    assert (logits - model.forward_reference(ids, return_logits=True)[10:]).abs().max().item() < TOL
