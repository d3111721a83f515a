"""The floor of ``bench engine`` (``prefixcache.bench.floor`` and its ``floor_shape``, ``floor_machine`` and
``floor_table``): the bytes a decode step must read and the FLOPs a prefill must compute, checked against sums done by
hand for the Qwen2.5-0.5B shape, and the shapes read off both model kinds.  No timings are asserted."""

from __future__ import annotations

import json

import pytest

from prefixcache.bench.floor_machine import MachineFloor, RateProbe, measure_gemm, measure_read_bandwidth
from prefixcache.bench.floor_shape import ModelShape, decode_step_bytes, embedded_config, prefill_flops
from prefixcache.bench.floor_table import floor_table
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import build_model

# Qwen2.5-0.5B cut to 4 layers, fp32: hidden 896, 14 heads over 2 KV heads of 64, MLP 4864, vocab 151,936.
QWEN4 = ModelShape("qwen", 4, 896, 14, 2, 64, 4864, 151_936, 4, qkv_bias=True)


def test_a_layer_multiplies_by_qkv_output_and_mlp_weights() -> None:
    # Q/K/V 896 x 1152, output 896 x 896, gate, up and down 896 x 4864 each.
    assert QWEN4.layer_matmul_elements == 896 * 1152 + 896 * 896 + 3 * 896 * 4864 == 14_909_440
    # plus the Q/K/V bias (1152) and two norms (2 x 896)
    assert QWEN4.layer_elements == 14_909_440 + 1152 + 1792


def test_decode_step_reads_every_weight_the_whole_head_and_the_live_kv() -> None:
    weights = 4 * 14_912_384 + 151_936 * 896 + 2 * 896  # layers, LM head, final norm and one embedding row
    kv = 2 * 4 * 2 * 64 * 2048  # K and V, 4 layers, 2 heads of 64, 2,048 keys
    assert decode_step_bytes(QWEN4, 2048) == (weights + kv) * 4 == 791_532_544


def test_decode_bytes_grow_by_one_token_of_kv_per_key() -> None:
    assert decode_step_bytes(QWEN4, 2049) - decode_step_bytes(QWEN4, 2048) == 2 * 4 * 2 * 64 * 4


def test_prefill_flops_count_products_causal_attention_and_one_head_row() -> None:
    products = 2 * 1024 * 4 * 14_909_440
    attention = 4 * 4 * 14 * 64 * (1024 * 1025 // 2)
    head = 2 * 151_936 * 896
    assert prefill_flops(QWEN4, 1024) == products + attention + head == 129_933_934_592


@pytest.mark.parametrize("bad", [0, -1])
def test_floor_sizes_below_one_token_are_refused(bad: int) -> None:
    with pytest.raises(InvalidArgumentError):
        decode_step_bytes(QWEN4, bad)
    with pytest.raises(InvalidArgumentError):
        prefill_flops(QWEN4, bad)


def test_embedded_model_shape_comes_from_its_config() -> None:
    shape = ModelShape.of(build_model("tiny", device="cpu"))
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == (2, 64, 4, 2, 16)
    assert (shape.intermediate, shape.vocab, shape.element_size, shape.qkv_bias) == (176, 512, 4, False)


def test_hf_qwen2_shape_has_its_qkv_bias() -> None:
    pytest.importorskip("transformers")
    from prefixcache.models.hf_tiny import tiny_random_model

    model = tiny_random_model("qwen2")
    shape = ModelShape.of(model)
    assert shape.qkv_bias and shape.layers == model.config.num_hidden_layers
    params = sum(p.numel() for name, p in model.model.named_parameters() if "layers." in name)
    assert shape.layers * shape.layer_elements == params


def test_embedded_config_reads_a_hugging_face_config(tmp_path) -> None:
    config = {
        "vocab_size": 1000,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "max_position_embeddings": 512,
        "rope_theta": 1e6,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    c = embedded_config(tmp_path, layers=3)
    assert (c.num_layers, c.head_dim, c.rope_theta, c.vocab_size) == (3, 32, 1e6, 1000)
    with pytest.raises(InvalidArgumentError):
        embedded_config(tmp_path / "missing", layers=3)


def test_rates_are_positive_figures() -> None:
    by_sum, by_gemv = measure_read_bandwidth(1 << 20, repeats=1)
    assert by_sum > 0 and by_gemv > 0
    assert measure_gemm(32, repeats=1) > 0
    with pytest.raises(InvalidArgumentError, match="at least 16384 bytes"):
        measure_read_bandwidth(1000, repeats=1)


def test_the_floor_reads_at_the_faster_of_the_sum_and_the_product(monkeypatch) -> None:
    import prefixcache.bench.floor_machine as floor_machine

    monkeypatch.setattr(floor_machine, "measure_read_bandwidth", lambda size, repeats: (1.5e10, 2.5e10))
    monkeypatch.setattr(floor_machine, "measure_gemm", lambda size, repeats: 1e11)
    machine = floor_machine.measure_machine(quick=True, repeats=1)
    assert (machine.read_bytes_per_s, machine.sum_read_bytes_per_s, machine.gemv_read_bytes_per_s) == (
        2.5e10,
        1.5e10,
        2.5e10,
    )
    table = floor_table({"machine": machine.as_dict(), "rows": []})
    assert "25.0 GB/s (sum 15.0, mv 25.0)" in table.title


def test_floor_table_prints_the_ratio_to_the_floor() -> None:
    row = {
        "model": "m",
        "context": 2048,
        "decode_s": 0.030,
        "decode_onednn_s": 0.045,
        "decode_bytes": 300_000_000,
        "decode_floor_s": 0.015,
        "decode_ratio": 1.9,
        "decode_onednn_ratio": 2.9,
        "prefill_ratio": 1.95,
        "prefill_tokens": 1024,
        "prefill_s": 2.0,
        "prefill_flops": 10**11,
        "prefill_floor_s": 1.0,
    }
    machine = {"read_bytes_per_s": 2e10, "gemm_flops_per_s": 1e11, "threads": 2, "buffer_bytes": 1 << 29}
    machine |= {"sum_read_bytes_per_s": 1.5e10, "gemv_read_bytes_per_s": 2e10}
    table = floor_table({"machine": {**machine, "gemm_size": 2048, "repeats": 5}, "rows": [row]})
    # The ratios are the rows' own (each run against the rates of its moment); the ms columns use the title's.
    assert table.rows[0][2:] == ("30", "15 (300 MB)", "1.90", "2.90") and table.rows[1][2:5] == (
        "2,000",
        "1,000 (100 GFLOP)",
        "1.95",
    )
    assert "20.0 GB/s (sum 15.0, mv 20.0)" in table.title
    # A quick run's tiny model: the floor is a fraction of a millisecond and of a megabyte, and says so.
    tiny = {**row, "decode_s": 4.2e-5, "decode_floor_s": 2.13e-5, "decode_bytes": 431_000, "prefill_flops": 3.2e8}
    tiny_table = floor_table({"machine": {**machine, "gemm_size": 2048, "repeats": 5}, "rows": [tiny]})
    assert tiny_table.rows[0][2:4] == ("0.042", "0.0213 (0.431 MB)")
    assert tiny_table.rows[1][3] == "1,000 (0.32 GFLOP)"


def test_two_measurements_of_the_machine_keep_the_higher_rates() -> None:
    busy = MachineFloor(1e10, 0.8e10, 9e10, 2, 1 << 29, 2048, 5)
    quiet = MachineFloor(2e10, 3e10, 6e10, 2, 1 << 29, 2048, 5)
    best = busy.best(quiet)
    assert (best.read_bytes_per_s, best.gemm_flops_per_s, best.repeats) == (3e10, 9e10, 10)
    assert (best.sum_read_bytes_per_s, best.gemv_read_bytes_per_s) == (2e10, 3e10)


class _Clock:
    """A fake clock that moves only where the test moves it (``now``)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_run_is_held_against_the_rates_measured_next_to_it(monkeypatch) -> None:
    # Four decode runs of equal time (bytes / 10 GB/s), default and oneDNN interleaved (off, on, on, off), each
    # between two probes.  A run's ratio uses the higher probe (the stricter floor): off runs 30 and 25 GB/s -> 3.0
    # and 2.5, on runs 10 and 15 GB/s -> 1.0 and 1.5; a row keeps its best run.  The prefill likewise (GEMM probes).
    import prefixcache.bench.floor as floor

    clock = _Clock()
    reads = iter([20e9, 30e9, 10e9, 10e9, 15e9, 10e9, 10e9, 25e9])
    gemms = iter([1e11, 2e11])
    monkeypatch.setattr(floor, "clock", clock)

    class Probe:
        def read_bytes_per_s(self) -> float:
            return next(reads)

        def gemm_flops_per_s(self) -> float:
            return next(gemms)

    shape = ModelShape.of(build_model("tiny", device="cpu"))
    step_bytes = decode_step_bytes(shape, 33)
    flops = prefill_flops(shape, 16)

    def decode_seconds(runner, prompt, steps):
        return step_bytes / 10e9, (1, 2, 3)

    class Runner:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def prefill(self, prompt) -> None:
            clock.now += flops / 1e11  # 2.0 of the floor at the faster GEMM probe

    monkeypatch.setattr(floor, "_decode_seconds", decode_seconds)
    monkeypatch.setattr(floor, "PrefixCachingRunner", Runner)
    row = floor.measure_model(build_model("tiny", device="cpu"), 32, 16, 2, 2, 1, Probe())
    assert row["decode_ratio"] == pytest.approx(2.5) and row["decode_s"] == pytest.approx(step_bytes / 10e9)
    assert row["decode_onednn_ratio"] == pytest.approx(1.0)
    assert row["prefill_ratio"] == pytest.approx(2.0)


def test_a_rate_probe_measures_positive_rates_and_refuses_a_short_buffer() -> None:
    probe = RateProbe(1 << 20, 32, repeats=1)
    assert probe.read_bytes_per_s() > 0 and min(probe.read_rates()) > 0
    assert probe.gemm_flops_per_s() > 0
    with pytest.raises(InvalidArgumentError, match="at least 16384 bytes"):
        RateProbe(1000, 0, repeats=1)


def test_a_probe_asked_for_a_rate_it_does_not_measure_says_so() -> None:
    with pytest.raises(InvalidArgumentError, match="no GEMM"):
        RateProbe(1 << 20, None, repeats=1).gemm_flops_per_s()
    with pytest.raises(InvalidArgumentError, match="no read"):
        RateProbe(None, 32, repeats=1).read_bytes_per_s()
    with pytest.raises(InvalidArgumentError, match="at least 16384 bytes"):
        measure_read_bandwidth(0, repeats=1)
