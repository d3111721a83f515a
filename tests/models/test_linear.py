"""Tall-skinny linear products for few rows: equal to F.linear up to rounding, scoped to our own forwards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from prefixcache.models.linear import (
    TALL_SKINNY_ROWS,
    WeightPacks,
    large_cpu_linears,
    linear,
    one_row_layout,
    project,
    tall_skinny_linears,
)


@pytest.fixture(autouse=True)
def _large_from_1000_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers of at least 1,000 weights count as large here, so that small test layers exercise the selection."""
    monkeypatch.setattr("prefixcache.models.linear.LARGE_WEIGHT", 1000)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, TALL_SKINNY_ROWS + 8),
    shape=st.sampled_from([(1, 1), (7, 5), (64, 32), (300, 96)]),
    bias=st.booleans(),
    lead=st.sampled_from([(), (1,), (2,)]),
)
def test_project_equals_f_linear(rows: int, shape: tuple[int, int], bias: bool, lead: tuple[int, ...]) -> None:
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(rows * 31 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    if lead and rows % lead[0]:
        rows += lead[0] - rows % lead[0]
    hidden = torch.randn(*lead, rows // (lead[0] if lead else 1), in_features, generator=gen)

    got = project(hidden, weight, b)

    want = torch.nn.functional.linear(hidden, weight, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32, bias=False), nn.ReLU(), nn.Linear(32, 8))


def test_linears_route_through_project_only_inside_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    layers = large_cpu_linears(model)
    calls = []
    real = project

    def counting(hidden, weight, bias):
        calls.append(hidden.shape)
        return real(hidden, weight, bias)

    monkeypatch.setattr("prefixcache.models.linear.project", counting)
    x = torch.randn(4, 16)
    plain = model(x)

    with tall_skinny_linears(layers, rows=4):
        inside = model(x)
    after = model(x)

    assert len(layers) == 2
    assert calls == [torch.Size([4, 16]), torch.Size([4, 64])]
    torch.testing.assert_close(inside, plain, rtol=1e-5, atol=1e-6)
    assert torch.equal(after, plain)
    assert all("forward" not in layer.__dict__ for layer in layers)


@pytest.mark.parametrize("rows", [1, TALL_SKINNY_ROWS + 1])
def test_one_row_and_many_rows_keep_the_layers_own_forward(rows: int) -> None:
    # One row: F.linear streams the weight as fast as W @ x.T, without the routing's Python per call.
    model = _model()
    layers = large_cpu_linears(model)

    with tall_skinny_linears(layers, rows=rows):
        assert all("forward" not in layer.__dict__ for layer in layers)


def test_layers_are_restored_when_the_forward_raises() -> None:
    model = _model()
    layers = large_cpu_linears(model)

    with pytest.raises(RuntimeError), tall_skinny_linears(layers, rows=2):
        assert all("forward" in layer.__dict__ for layer in layers)
        model(torch.randn(2, 3))  # wrong width: the first layer's product fails

    assert all("forward" not in layer.__dict__ for layer in layers)
    assert model(torch.randn(2, 16)).shape == (2, 8)


def test_only_plain_large_linears_are_routed() -> None:
    class Scaled(nn.Linear):
        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(hidden)

    model = nn.Sequential(nn.Linear(40, 40), Scaled(40, 40), nn.Linear(10, 10), nn.Linear(50, 20))

    assert large_cpu_linears(model) == [model[0], model[3]]  # a subclass and a layer of under 1,000 weights excluded


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, TALL_SKINNY_ROWS + 8),
    shape=st.sampled_from([(1, 1), (7, 5), (64, 32), (300, 96)]),
    bias=st.booleans(),
    lead=st.sampled_from([(), (2,)]),
    through=st.sampled_from([linear, project]),
)
def test_packed_products_equal_f_linear(
    rows: int, shape: tuple[int, int], bias: bool, lead: tuple[int, ...], through
) -> None:
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(rows * 17 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    rows += (-rows) % lead[0] if lead else 0
    hidden = torch.randn(*lead, rows // (lead[0] if lead else 1), in_features, generator=gen)
    packs = WeightPacks()

    got = through(hidden, weight, b, packs=packs)

    torch.testing.assert_close(got, torch.nn.functional.linear(hidden, weight, b), rtol=1e-5, atol=1e-5)
    assert len(packs) == (1 if 1 < rows <= TALL_SKINNY_ROWS and not packs._broken else 0)


def test_a_pack_is_made_once_and_again_after_a_write_or_a_rebinding() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 24, generator=gen)
    hidden = torch.randn(4, 24, generator=gen)
    packs = WeightPacks()
    if packs.get(weight) is None:
        pytest.skip("this torch has no oneDNN linear packing")
    first = packs.get(weight)
    assert packs.get(weight) is first

    weight.mul_(-2.0)  # in place: the version counter moves
    after_write = linear(hidden, weight, packs=packs)
    assert packs.get(weight) is not first
    torch.testing.assert_close(after_write, torch.nn.functional.linear(hidden, weight), rtol=1e-5, atol=1e-5)

    rebound = torch.randn(40, 24, generator=gen)
    torch.testing.assert_close(
        linear(hidden, rebound, packs=packs), torch.nn.functional.linear(hidden, rebound), rtol=1e-5, atol=1e-5
    )
    assert len(packs) == 2  # one copy per weight tensor; the packs hold no reference to either weight


def test_one_row_another_dtype_or_a_failed_packing_take_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(30, 16, generator=gen)
    packs = WeightPacks()

    one_row = torch.randn(1, 16, generator=gen)
    assert torch.equal(linear(one_row, weight, packs=packs), torch.nn.functional.linear(one_row, weight))
    double = weight.double()
    rows = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    assert packs.get(double) is None
    assert torch.equal(linear(rows, double, packs=packs), torch.nn.functional.linear(rows, double))
    assert len(packs) == 0

    def unsupported(weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr("prefixcache.models.linear._reorder", unsupported)
    hidden = torch.randn(6, 16, generator=gen)
    assert torch.equal(linear(hidden, weight, packs=packs), torch.nn.functional.linear(hidden, weight))
    assert packs.get(weight) is None and len(packs) == 0  # not tried again


def _packs_or_skip() -> WeightPacks:
    packs = WeightPacks()
    if packs.get(torch.ones(2, 2)) is None:
        pytest.skip("this torch has no oneDNN linear packing")
    return WeightPacks()


def test_the_copy_of_a_weight_is_dropped_with_the_weight() -> None:
    """Rebinding a weight again and again (a new ``nn.Parameter`` each time) must not keep every old copy: each is
    the weight's size (544 MB for Qwen2.5-0.5B's LM head)."""
    import gc

    packs = _packs_or_skip()
    hidden = torch.randn(4, 24)
    kept = torch.randn(40, 24)
    linear(hidden, kept, packs=packs)
    for seed in range(5):
        rebound = torch.randn(40, 24, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(
            linear(hidden, rebound, packs=packs), torch.nn.functional.linear(hidden, rebound), rtol=1e-5, atol=1e-5
        )
        del rebound
    gc.collect()
    assert len(packs) == 1  # only the live weight's copy
    del kept
    gc.collect()
    assert len(packs) == 0


def test_clear_drops_every_copy_and_the_next_product_sees_an_unversioned_write() -> None:
    packs = _packs_or_skip()
    weight = torch.randn(40, 24)
    hidden = torch.randn(4, 24)
    linear(hidden, weight, packs=packs)
    weight.data.mul_(-1.0)  # a write through .data moves no version counter

    packs.clear()

    assert len(packs) == 0
    torch.testing.assert_close(
        linear(hidden, weight, packs=packs), torch.nn.functional.linear(hidden, weight), rtol=1e-5, atol=1e-5
    )


def test_an_inference_mode_weight_takes_f_linear() -> None:
    """Tensors made under ``torch.inference_mode()`` (a model built or loaded there) keep no version counter, so a
    copy could not follow their writes: they are not packed, and the product still works."""
    packs = WeightPacks()
    with torch.inference_mode():
        weight = torch.randn(40, 24)
    hidden = torch.randn(4, 24)

    got = linear(hidden, weight, packs=packs)

    torch.testing.assert_close(got, torch.nn.functional.linear(hidden, weight), rtol=1e-5, atol=1e-5)
    assert len(packs) == 0


@pytest.mark.parametrize("through", [linear, project])
def test_a_strided_bias_is_added_as_f_linear_adds_it(through) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 24, generator=gen)
    bias = torch.randn(40, 3, generator=gen)[:, 1]  # a column: stride 3
    hidden = torch.randn(6, 24, generator=gen)

    got = through(hidden, weight, bias, packs=WeightPacks())

    torch.testing.assert_close(got, torch.nn.functional.linear(hidden, weight, bias), rtol=1e-5, atol=1e-5)


def test_copies_and_pickles_start_empty() -> None:
    """oneDNN's packed tensors cannot be copied or pickled; a copied model (``copy.deepcopy``) must still copy."""
    import copy
    import pickle

    packs = _packs_or_skip()
    weight = torch.randn(40, 24)
    linear(torch.randn(4, 24), weight, packs=packs)

    for twin in (copy.deepcopy(packs), copy.copy(packs), pickle.loads(pickle.dumps(packs))):
        assert isinstance(twin, WeightPacks) and len(twin) == 0
        assert twin.get(weight) is not None
    assert len(packs) == 1


def test_one_row_onednn_is_off_by_default_and_returns_the_setting_before() -> None:
    from prefixcache.models.linear import one_row_onednn

    assert one_row_onednn() is False
    assert one_row_onednn(True) is False
    try:
        assert one_row_onednn() is True
    finally:
        assert one_row_onednn(False) is True


def test_one_row_onednn_products_equal_f_linear_up_to_rounding() -> None:
    from prefixcache.models.linear import linear, one_row_onednn, project

    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(300, 64, generator=gen), torch.randn(300, generator=gen)
    row = torch.randn(1, 1, 64, generator=gen)
    expected = torch.nn.functional.linear(row, weight, bias)
    before = one_row_onednn(True)
    try:
        for out in (linear(row, weight, bias), project(row, weight, bias)):
            assert out.shape == (1, 1, 300)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        two = torch.randn(2, 64, generator=gen)  # more than one row: not this path, same numbers as before
        torch.testing.assert_close(linear(two, weight), torch.nn.functional.linear(two, weight))
    finally:
        one_row_onednn(before)


@pytest.mark.parametrize("kind", ["embedded", "qwen2"])
def test_decode_with_one_row_onednn_stays_exact(kind: str) -> None:
    from prefixcache.engine.runner import PrefixCachingRunner
    from prefixcache.engine.sampling import SamplingParams
    from prefixcache.models.linear import one_row_onednn
    from prefixcache.models.llama import build_model

    if kind == "embedded":
        model = build_model("tiny", device="cpu")
    else:
        pytest.importorskip("transformers")
        from prefixcache.models.hf_tiny import tiny_random_model

        model = tiny_random_model(kind)
    prompt = list(range(7, 70))
    params = SamplingParams(max_new_tokens=10)
    plain = PrefixCachingRunner(model).generate(prompt, params).token_ids
    before = one_row_onednn(True)
    try:
        runner = PrefixCachingRunner(model)
        ours = runner.generate(prompt, params).token_ids
        sequence = torch.tensor([*prompt, *ours[:-1]])
        reference = model.forward_reference(sequence, return_logits=True, logits_from=len(prompt) - 1)
        again = runner.generate([*prompt, *ours[:-1]], SamplingParams(max_new_tokens=1), return_logits=True)
    finally:
        one_row_onednn(before)
    assert ours == plain
    assert torch.equal(reference.argmax(-1), torch.tensor(ours))
    torch.testing.assert_close(again.prompt_logits[-1], reference[-1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [(300, 96), (97, 96)])
def test_a_widening_weight_is_laid_out_column_major_with_the_same_values(shape: tuple[int, int]) -> None:
    weight = torch.randn(*shape)

    laid = one_row_layout(weight)

    assert laid.stride() == (1, shape[0]) and torch.equal(laid, weight)
    assert one_row_layout(laid) is laid  # already column-major: kept
    for rows in (1, 3, 200):
        x = torch.randn(rows, shape[1])
        assert torch.allclose(linear(x, laid), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "weight",
    [torch.randn(96, 300), torch.randn(96, 96), torch.randn(300, 96, dtype=torch.float64), torch.randn(3, 4, 5)],
    ids=["narrowing", "square", "float64", "3-d"],
)
def test_other_weights_keep_their_layout(weight: torch.Tensor) -> None:
    assert one_row_layout(weight) is weight


def test_the_embedded_model_keeps_its_widening_weights_column_major(tiny) -> None:
    layer = tiny.layers[0]
    for weight in (tiny.lm_head, layer.qkv, layer.gate_up):
        assert weight.stride() == (1, weight.shape[0])
    assert layer.down.is_contiguous() and tiny.embed.is_contiguous()
