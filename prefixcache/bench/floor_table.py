"""The printed table of ``bench engine``'s floor rows (:func:`~prefixcache.bench.floor.measure_floor`'s result)."""

from __future__ import annotations

from prefixcache.bench.common import Table

__all__ = ["floor_table"]


def _figure(value: float) -> str:
    """``value`` to three significant digits, or to the unit from 100 up, with thousands separators (270.1 ->
    "270", 0.04213 -> "0.0421", 12345.6 -> "12,346"): a quick run's tiny model moves well under a megabyte a step."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def floor_table(floor: dict) -> Table:
    """The printed table of :func:`~prefixcache.bench.floor.measure_floor`'s result."""
    m = floor["machine"]
    clock_name = "thread CPU time" if m["threads"] == 1 else "wall time"
    rows = []
    for r in floor["rows"]:
        model = f"{r['model']}, {r.get('precision', 'float32')}"
        rows.append(
            (
                model,
                f"decode at {r['context']:,} (ms/token)",
                _figure(r["decode_s"] * 1e3),
                f"{_figure(r['decode_floor_s'] * 1e3)} ({_figure(r['decode_bytes'] / 1e6)} MB)",
                f"{r['decode_ratio']:.2f}",
                f"{r['decode_onednn_ratio']:.2f}",
            )
        )
        rows.append(
            (
                model,
                f"cold prefill {r['prefill_tokens']:,} (ms)",
                _figure(r["prefill_s"] * 1e3),
                f"{_figure(r['prefill_floor_s'] * 1e3)} ({_figure(r['prefill_flops'] / 1e9)} GFLOP)",
                f"{r['prefill_ratio']:.2f}",
                "",
            )
        )
    return Table(
        title=(
            f"engine floor: read bandwidth {m['read_bytes_per_s'] / 1e9:.1f} GB/s (sum "
            f"{m['sum_read_bytes_per_s'] / 1e9:.1f}, mv {m['gemv_read_bytes_per_s'] / 1e9:.1f}), fp32 GEMM "
            f"{m['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s ({m['threads']} torch threads, best of {m['repeats']})"
        ),
        headers=("model", "measure", "ours", "floor (what it must move)", "ours / floor", "opt-in oneDNN rows / floor"),
        rows=tuple(rows),
        notes=(
            f"{clock_name}, {m['threads']} torch threads, best of the repeats; decode floor = bytes a step reads "
            "at the row's precision (weights, int8 / int4 codes and scales where quantized, + live K/V) / "
            f"bandwidth (the faster of torch.sum and torch.mv by ones over "
            f"{m['buffer_bytes'] >> 20} MiB); prefill floor = FLOPs / GEMM "
            f"({m['gemm_size']}-square fp32 torch.mm); 'ours / floor': each timed run against the rates measured "
            "just before and after it (the higher), best run; the ms columns: best run and the title's rates",
            "'opt-in oneDNN rows': the same decode steps, same run, interleaved, with one_row_onednn(True) (greedy "
            "tokens checked equal); goals: decode <= 1.25, prefill <= 1.3",
        ),
    )
