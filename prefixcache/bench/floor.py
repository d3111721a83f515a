"""The floor under ``bench engine``'s figures: how far a decode step and a prefill of each model stand above what
this machine can read and compute.

Absolute times do not travel between machines (nor between two runs on a shared one); a ratio to a floor measured in
the same process does.  The machine's rates are :mod:`prefixcache.bench.floor_machine`'s (read bandwidth, GEMM
throughput), at the rows' thread count; for each model (the HF adapter and the embedded model, on the Qwen2.5-0.5B
shape cut to 4 and 24 layers), the decode floor is :func:`~prefixcache.bench.floor_shape.decode_step_bytes` over the
bandwidth and the prefill floor :func:`~prefixcache.bench.floor_shape.prefill_flops` over the GEMM throughput.  The
rows are printed by :func:`~prefixcache.bench.floor_table.floor_table`.

Each model runs at every precision asked for (``bench engine --precision``, :mod:`prefixcache.bench.precision`:
float32 by default; bfloat16, weight-only int8 and int4), so the decode floor follows the bytes a step reads at that
precision (:func:`~prefixcache.bench.floor_shape.weight_bytes`: int8 1 byte a weight and a scale a row, int4 half a
byte and a scale and offset a group, the LM head int8); the prefill floor stays the FLOPs over the float32 GEMM rate
(a quantized prefill multiplies by float32 weights dequantized a slice at a time, past the kernels' rows).

``decode / floor`` and ``prefill / floor`` are the goals (within 1.25x and 1.3x).  Each timed run is held against
the rates measured just before and just after it (:class:`~prefixcache.bench.floor_machine.RateProbe`; the higher of
the two, the stricter floor) and a row gives its best run's ratio: on a shared host the bandwidth left to us drifts
by a quarter within minutes, and a floor read once at the start put the same code at 1.04 in one run and 1.51 in the
next.  Decode is timed as it runs by default and, in the same run, interleaved, with the opt-in oneDNN one-row
products (:func:`~prefixcache.models.linear.one_row_onednn`).  Clock: :func:`~prefixcache.bench.device_clock.clock`,
so wall time at :data:`THREADS` torch threads, as a user runs it, and a busy machine shows in both the rows and the
floor; with one thread (``threads=1``), the thread's CPU time, as ``bench engine``'s other rows (other processes' time
slices left out).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.bench.device_clock import clock, torch_threads
from prefixcache.bench.floor_machine import RateProbe, measure_machine
from prefixcache.bench.floor_shape import ModelShape, decode_step_bytes, embedded_config, prefill_flops
from prefixcache.bench.precision import Precision
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.models.linear import one_row_onednn

__all__ = ["BLOCK_SIZE", "QUICK_FLOOR", "THREADS", "FloorSetup", "build_embedded", "measure_floor", "measure_model"]

THREADS = 2
"""Torch threads of the floor rows and of the floor itself (2 threads: the cores of this project's machines)."""
BLOCK_SIZE = 16


def _decode_seconds(runner: PrefixCachingRunner, prompt: list[int], steps: int) -> tuple[float, tuple[int, ...]]:
    """:func:`clock` seconds per decode step (between the first and the last of ``steps + 1`` tokens) and the
    tokens."""
    stamps: list[float] = []
    params = SamplingParams(max_new_tokens=steps + 1)
    stream = runner.stream(prompt, params, on_token=lambda _token: stamps.append(clock()))
    try:
        while True:
            next(stream)
    except StopIteration as done:
        result = done.value
    return (stamps[-1] - stamps[0]) / steps, tuple(result.token_ids)


def measure_model(
    model, context: int, prefill_tokens: int, steps: int, repeats: int, prefill_repeats: int, probe: RateProbe
) -> dict:
    """One model's rows: cold prefill of ``prefill_tokens`` (best of ``prefill_repeats``, a fresh cache each) and
    decode at ``context`` keys (best of ``repeats`` runs of ``steps`` steps) by default and with the oneDNN one-row
    products, interleaved; with the bytes and FLOPs of their floors.

    ``probe`` measures the rates just before and just after every timed run; each run's ratio is its time over the
    floor at the higher of the two (the stricter floor), and a row's ratio is its best run's (``decode_ratio``,
    ``decode_onednn_ratio``, ``prefill_ratio``).  Raises AssertionError when the two decode ways give other greedy
    tokens."""
    shape = ModelShape.of(model)
    step_bytes = decode_step_bytes(shape, context + 1)
    flops = prefill_flops(shape, prefill_tokens)
    gen = torch.Generator().manual_seed(30)
    prompt = torch.randint(0, model.vocab_size, (context,), generator=gen).tolist()
    prefill, prefill_ratios = [], []
    for rep in range(prefill_repeats):
        runner = PrefixCachingRunner(model, cache_tokens=prefill_tokens + 2 * BLOCK_SIZE, block_size=BLOCK_SIZE)
        before = probe.gemm_flops_per_s()
        start = clock()
        runner.prefill(prompt[rep : rep + prefill_tokens])
        prefill.append(clock() - start)
        prefill_ratios.append(prefill[-1] * max(before, probe.gemm_flops_per_s()) / flops)
    runner = PrefixCachingRunner(model, cache_tokens=context + 4 * (steps + 1 + BLOCK_SIZE), block_size=BLOCK_SIZE)
    runner.prefill(prompt[:-1])
    decode: dict[bool, float] = {}
    ratios: dict[bool, float] = {}
    tokens: dict[bool, tuple[int, ...]] = {}
    before_setting = one_row_onednn()
    try:
        for rep in range(repeats):
            for on in (False, True) if rep % 2 == 0 else (True, False):
                one_row_onednn(on)
                before = probe.read_bytes_per_s()
                seconds, tokens[on] = _decode_seconds(runner, prompt, steps)
                ratio = seconds * max(before, probe.read_bytes_per_s()) / step_bytes
                decode[on] = min(decode.get(on, float("inf")), seconds)
                ratios[on] = min(ratios.get(on, float("inf")), ratio)
    finally:
        one_row_onednn(before_setting)
    if tokens[True] != tokens[False]:
        raise AssertionError(f"{shape.name}: oneDNN one-row products changed the greedy tokens")
    return {
        "model": shape.name,
        "precision": _precision_name(shape),
        "layers": shape.layers,
        "context": context,
        "steps": steps,
        "decode_s": decode[False],
        "decode_onednn_s": decode[True],
        "decode_ratio": ratios[False],
        "decode_onednn_ratio": ratios[True],
        "decode_bytes": step_bytes,
        "prefill_tokens": prefill_tokens,
        "prefill_s": min(prefill),
        "prefill_ratio": min(prefill_ratios),
        "prefill_flops": flops,
    }


def _precision_name(shape: ModelShape) -> str:
    """The shape's precision as ``--precision`` names it (``"float32"``, ``"bfloat16+int8"``, ...)."""
    dtype = {4: "float32", 2: "bfloat16"}.get(shape.element_size, f"{shape.element_size}-byte")
    return Precision(dtype, shape.quantize).name


@dataclass(frozen=True, slots=True)
class FloorSetup:
    """Sizes of the floor rows: layer counts of the Qwen2.5-0.5B shape, decode context (keys), decode steps, prefill
    tokens, repeats (decode; prefill per layer count, best of: a model's first prefill also pays its first-touch
    costs, pages of the heap and the weights' first reads: of four 24-layer prefills, the first took 3.6 s, the next
    three 3.0-3.2)."""

    layers: tuple[int, ...] = (4, 24)
    context: int = 2048
    steps: int = 8
    prefill_tokens: int = 1024
    repeats: int = 4
    prefill_repeats: tuple[int, ...] = (2, 3)


PROBE_REPEATS = 2
"""Repeats of each rate measured next to a timed run (best of, after one untimed call)."""

QUICK_FLOOR = FloorSetup(layers=(2,), context=256, steps=4, prefill_tokens=128, repeats=2, prefill_repeats=(1,))


def build_embedded(quick: bool, layers: int, config_path: str | Path, dtype: torch.dtype = torch.float32):
    """The embedded model of the floor rows on the CPU in ``dtype``: the shape in ``config_path`` cut to ``layers``
    layers, or (``quick``) the ``tiny`` preset."""
    from prefixcache.models.llama import LlamaModel, build_model

    if quick:
        return build_model("tiny", dtype=dtype, device="cpu")
    return LlamaModel(embedded_config(config_path, layers), dtype=dtype, device="cpu")


def measure_floor(
    quick: bool,
    build_hf: Callable[[int, torch.dtype], object],
    config_path: str | Path,
    threads: int = THREADS,
    precisions: tuple[Precision, ...] = (Precision("float32"),),
) -> dict:
    """The machine's rates and every model's rows at every one of ``precisions``, at ``threads`` torch threads
    (restored after).

    ``build_hf(layers, dtype)`` makes the HF model, :func:`build_embedded` the embedded one of the same shape from
    ``config_path``; each is quantized by :meth:`Precision.apply`; one at a time, each freed after its rows (the
    24-layer fp32 models are 2-2.5 GB each).  The rates are measured before and after the rows and the higher kept
    (:meth:`MachineFloor.best`): on a shared machine a rate measured in a busy second put the floor above the rows'
    own times.
    """
    setup = QUICK_FLOOR if quick else FloorSetup()
    with torch_threads(threads):
        machine = measure_machine(quick)
        probe = RateProbe(machine.buffer_bytes, machine.gemm_size, PROBE_REPEATS)
        rows = []
        builders = (build_hf, lambda n, dtype: build_embedded(quick, n, config_path, dtype))
        for layers, prefill_repeats in zip(setup.layers, setup.prefill_repeats, strict=True):
            for precision, build in ((p, b) for p in precisions for b in builders):
                model = precision.apply(build(layers, precision.torch_dtype))
                rows.append(
                    measure_model(
                        model, setup.context, setup.prefill_tokens, setup.steps, setup.repeats, prefill_repeats, probe
                    )
                )
                del model
                gc.collect()
        after = measure_machine(quick)
        machine = machine.best(after)
        for row in rows:
            row["decode_floor_s"] = row["decode_bytes"] / machine.read_bytes_per_s
            row["prefill_floor_s"] = row["prefill_flops"] / machine.gemm_flops_per_s
    return {"machine": machine.as_dict(), "rows": rows, "setup": dataclasses.asdict(setup)}
