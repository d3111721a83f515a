"""The floor under ``bench engine``'s figures: what this machine can read and compute, and how far a decode step and a
prefill stand above it.

Absolute times do not travel between machines (nor between two runs on a shared one); a ratio to a floor measured in
the same process does.  Two rates are measured with torch at the rows' thread count, best of several repeats:

- memory read bandwidth (bytes/s): the faster of two reads of a float32 tensor many times the last-level cache
  (512 MiB; 64 MiB with ``--quick``), so every byte comes from DRAM, as a decode step's weights do: ``sum()``
  (STREAM's read kernel, in torch) and a matrix-vector product of the same bytes viewed ``[rows, 4096]`` by a
  vector of ones (the BLAS kernel a decode step runs).  Which is faster depends on the CPU: on an AMD EPYC host of
  this project's the sum read 34 GB/s against the product's 18-24; on an Intel Xeon host, with two threads, the sum
  17-20 GB/s and the product 23-30, so a floor from the sum alone sat below what the model's own products reached
  (decode / floor 0.91 on the embedded 4-layer shape) and was no floor;
- float32 matrix throughput (FLOP/s): a square ``2048 x 2048`` product (``2 n^3`` FLOPs).

Then, for each model (the HF adapter and the embedded model, on the Qwen2.5-0.5B shape cut to 4 and 24 layers):

- decode floor = :func:`decode_step_bytes` / bandwidth: a step must read every weight it multiplies by once (layers,
  final norm, the LM head; one embedding row) and the live K/V of its context (llama.cpp's and the roofline's
  argument: one query's products do 2 FLOPs per weight element, far below the machine's FLOPs per byte);
- prefill floor = :func:`prefill_flops` / GEMM throughput: ``2 * tokens`` FLOPs per weight element of the layers,
  causal attention, the LM head on the last position only.

``decode / floor`` and ``prefill / floor`` are what issue 30 moves (goal: within 1.25x and 1.3x).  Each timed run
is held against the rates measured just before and just after it (:class:`RateProbe`; the higher of the two, the
stricter floor) and a row gives its best run's ratio: on a shared host the bandwidth left to us drifts by a quarter
within minutes, and a floor read once at the start put the same code at 1.04 in one run and 1.51 in the next.
Decode is timed as it runs by default and, in the same run, interleaved, with the opt-in oneDNN one-row products
(:func:`~prefixcache.models.linear.one_row_onednn`).  Clock: :func:`~prefixcache.bench.device_clock.clock`, so wall
time at :data:`THREADS` torch threads, as a user runs it, and a busy machine shows in both the rows and the floor; with
one thread (``threads=1``), the thread's CPU time, as ``bench engine``'s other rows (other processes' time slices left
out).
"""

from __future__ import annotations

import dataclasses
import gc
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.bench.common import Table
from prefixcache.bench.device_clock import clock, torch_threads
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.base import ModelConfig
from prefixcache.models.linear import one_row_onednn

THREADS = 2
"""Torch threads of the floor rows and of the floor itself (the issue's setting: 2 threads on a 2-core machine)."""
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes that set a decoder's bytes per step and FLOPs per token; counts, ``element_size`` in bytes.

    ``qkv_bias``: the Q/K/V projections carry a bias (Qwen2).  The LM head is read in full every step whether or not
    it is tied to the embedding; the embedding itself gives one row per token.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    element_size: int
    qkv_bias: bool = False

    @staticmethod
    def of(model) -> ModelShape:
        """The shape of an embedded :class:`~prefixcache.models.llama.LlamaModel` (its ``ModelConfig``) or of an
        :class:`~prefixcache.models.hf.HFCausalLM` of a Llama-like config.  Raises InvalidArgumentError for a config
        without these sizes."""
        config = model.config
        element = torch.empty((), dtype=model.dtype).element_size()
        if isinstance(config, ModelConfig):
            return ModelShape(
                config.name,
                config.num_layers,
                config.hidden_size,
                config.num_heads,
                config.num_kv_heads,
                config.head_dim,
                config.intermediate_size,
                config.vocab_size,
                element,
            )
        try:
            heads = config.num_attention_heads
            return ModelShape(
                model.name,
                config.num_hidden_layers,
                config.hidden_size,
                heads,
                config.num_key_value_heads,
                getattr(config, "head_dim", None) or config.hidden_size // heads,
                config.intermediate_size,
                config.vocab_size,
                element,
                qkv_bias=config.model_type == "qwen2",
            )
        except AttributeError as error:
            raise InvalidArgumentError(f"{model.name}: no Llama-like sizes in its config ({error})") from None

    @property
    def layer_matmul_elements(self) -> int:
        """Weight elements one layer multiplies by: Q/K/V, output, gate/up and down projections."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def layer_elements(self) -> int:
        """Every weight element of one layer: the products', the Q/K/V bias, the two norms."""
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return self.layer_matmul_elements + bias + 2 * self.hidden


def decode_step_bytes(shape: ModelShape, context: int) -> int:
    """Bytes one decode step of one row must read, attending ``context`` keys (its own included): every layer's
    weights, the final norm, the whole LM head, one embedding row, and K and V of ``context`` positions in every
    layer.  Raises InvalidArgumentError for ``context < 1``."""
    if context < 1:
        raise InvalidArgumentError(f"context must be >= 1, got {context}")
    weights = shape.layers * shape.layer_elements + shape.vocab * shape.hidden + 2 * shape.hidden
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * context
    return (weights + kv) * shape.element_size


def prefill_flops(shape: ModelShape, tokens: int) -> int:
    """FLOPs of a cold prefill of ``tokens`` positions that keeps the last position's logits: ``2 * tokens`` per
    layer weight element, causal attention (scores and weighted values: ``4 * heads * head_dim`` per query-key pair,
    ``tokens * (tokens + 1) / 2`` pairs a layer), and the LM head for one position.  Norms, rotary and softmax are
    left out (O(tokens * hidden), under 1% here).  Raises InvalidArgumentError for ``tokens < 1``."""
    if tokens < 1:
        raise InvalidArgumentError(f"tokens must be >= 1, got {tokens}")
    products = 2 * tokens * shape.layers * shape.layer_matmul_elements
    attention = shape.layers * 4 * shape.heads * shape.head_dim * (tokens * (tokens + 1) // 2)
    return products + attention + 2 * shape.vocab * shape.hidden


@dataclass(frozen=True, slots=True)
class MachineFloor:
    """This machine's measured rates: read bandwidth (bytes/s) over ``buffer_bytes`` by ``torch.sum`` and by
    ``torch.mv`` (:func:`measure_read_bandwidth`), float32 GEMM (FLOP/s) of ``gemm_size``-square matrices, best of
    ``repeats``, at ``threads`` torch threads."""

    sum_read_bytes_per_s: float
    gemv_read_bytes_per_s: float
    gemm_flops_per_s: float
    threads: int
    buffer_bytes: int
    gemm_size: int
    repeats: int

    @property
    def read_bytes_per_s(self) -> float:
        """The floor's read bandwidth: the faster of the two reads."""
        return max(self.sum_read_bytes_per_s, self.gemv_read_bytes_per_s)

    def as_dict(self) -> dict:
        """The fields and :attr:`read_bytes_per_s`, as ``measure_floor`` returns them."""
        return {**dataclasses.asdict(self), "read_bytes_per_s": self.read_bytes_per_s}

    def best(self, other: MachineFloor) -> MachineFloor:
        """The higher of each rate of two measurements of the same sizes (a busy moment only lowers a rate)."""
        return dataclasses.replace(
            self,
            sum_read_bytes_per_s=max(self.sum_read_bytes_per_s, other.sum_read_bytes_per_s),
            gemv_read_bytes_per_s=max(self.gemv_read_bytes_per_s, other.gemv_read_bytes_per_s),
            gemm_flops_per_s=max(self.gemm_flops_per_s, other.gemm_flops_per_s),
            repeats=self.repeats + other.repeats,
        )


def _best(fn: Callable[[], object], repeats: int) -> float:
    """Fewest :func:`clock` seconds of ``repeats`` calls of ``fn`` after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


GEMV_COLUMNS = 4096
"""Columns of the matrix view of the read buffer in :func:`measure_read_bandwidth`'s product (16 KiB rows)."""


def measure_read_bandwidth(num_bytes: int, repeats: int) -> tuple[float, float]:
    """Bytes per second reading a float32 tensor of ``num_bytes`` (rounded down to whole rows of
    :data:`GEMV_COLUMNS`), best of ``repeats`` each: ``(torch.sum, torch.mv of [rows, GEMV_COLUMNS] by ones)``.
    The vector and the output (a few KiB) are left out of the bytes.  Raises InvalidArgumentError below one row."""
    return RateProbe(num_bytes, None, repeats).read_rates()


def measure_gemm(size: int, repeats: int) -> float:
    """FLOP/s of a float32 ``size x size`` by ``size x size`` product (``2 * size**3`` FLOPs, best of ``repeats``)."""
    return RateProbe(None, size, repeats).gemm_flops_per_s()


class RateProbe:
    """The machine's two rates measured on demand, its buffers allocated once: the reads of
    :func:`measure_read_bandwidth` over ``read_bytes`` and the GEMM of :func:`measure_gemm` of ``gemm_size``-square
    matrices, best of ``repeats`` after one untimed call (None: that rate is not measured, and asking for it raises
    InvalidArgumentError).

    :func:`measure_model` reads both next to every timed run: on a shared machine the memory bandwidth left to us
    drifts over seconds (on this project's Intel host, 24-31 GB/s from one minute to the next), so a run is held
    against the rate of its own moment, not of the start of a minutes-long benchmark.  A probe takes 0.2-0.5 s (best of
    2 after an untimed call: six reads of 512 MiB, or three 2048-square products).  Raises InvalidArgumentError for
    a read buffer under one row of :data:`GEMV_COLUMNS`.
    """

    def __init__(self, read_bytes: int | None, gemm_size: int | None, repeats: int) -> None:
        self.repeats = repeats
        self._data = self._matrix = self._ones = self._out = None
        if read_bytes is not None:
            rows = read_bytes // (4 * GEMV_COLUMNS)
            if rows < 1:
                raise InvalidArgumentError(
                    f"the read buffer must hold at least {4 * GEMV_COLUMNS} bytes, got {read_bytes}"
                )
            self._data = torch.ones(rows * GEMV_COLUMNS, dtype=torch.float32)
            self._matrix, self._ones = self._data.view(rows, GEMV_COLUMNS), torch.ones(GEMV_COLUMNS)
            self._out = torch.empty(rows)
        self._gemm = None
        if gemm_size is not None:
            gen = torch.Generator().manual_seed(0)
            a, b = torch.randn(gemm_size, gemm_size, generator=gen), torch.randn(gemm_size, gemm_size, generator=gen)
            self._gemm = (a, b, torch.empty(gemm_size, gemm_size))

    def read_rates(self) -> tuple[float, float]:
        """``(torch.sum, torch.mv)`` bytes per second over the buffer."""
        if self._data is None:
            raise InvalidArgumentError("this probe measures no read (read_bytes None)")
        size = self._data.numel() * 4
        by_sum = size / _best(self._data.sum, self.repeats)
        return by_sum, size / _best(lambda: torch.mv(self._matrix, self._ones, out=self._out), self.repeats)

    def read_bytes_per_s(self) -> float:
        """The faster of the two reads (the floor's bandwidth)."""
        return max(self.read_rates())

    def gemm_flops_per_s(self) -> float:
        """FLOP/s of the square product (``2 * size**3`` FLOPs)."""
        if self._gemm is None:
            raise InvalidArgumentError("this probe measures no GEMM (gemm_size None)")
        a, b, out = self._gemm
        return 2 * a.shape[0] ** 3 / _best(lambda: torch.mm(a, b, out=out), self.repeats)


def measure_machine(quick: bool, repeats: int = 5) -> MachineFloor:
    """Both rates at the current torch thread count (512 MiB read, 2048-square GEMM; quick: 64 MiB, 512); the read
    bandwidth is the faster of :func:`measure_read_bandwidth`'s two reads."""
    buffer_bytes, size = (64 << 20, 512) if quick else (512 << 20, 2048)
    by_sum, by_gemv = measure_read_bandwidth(buffer_bytes, repeats)
    return MachineFloor(
        by_sum, by_gemv, measure_gemm(size, repeats), torch.get_num_threads(), buffer_bytes, size, repeats
    )


def embedded_config(config_path: str | Path, layers: int, name: str = "qwen2.5-0.5b-shape") -> ModelConfig:
    """An embedded-model config of the sizes in a Hugging Face Llama-like ``config.json`` (or its folder), cut to
    ``layers`` layers; seeded random weights as every embedded preset.  Raises InvalidArgumentError when unreadable."""
    path = Path(config_path)
    path = path / "config.json" if path.is_dir() else path
    try:
        c = json.loads(path.read_text())
        heads = c["num_attention_heads"]
        return ModelConfig(
            name=f"{name}({layers} layers)",
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate_size=c["intermediate_size"],
            max_position=c["max_position_embeddings"],
            rope_theta=float(c.get("rope_theta", 10000.0)),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        )
    except (OSError, ValueError, KeyError) as error:
        raise InvalidArgumentError(f"cannot read a model config from {str(path)!r}: {error}") from None


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


def build_embedded(quick: bool, layers: int, config_path: str | Path):
    """The embedded model of the floor rows on the CPU: the shape in ``config_path`` cut to ``layers`` layers, or
    (``quick``) the ``tiny`` preset."""
    from prefixcache.models.llama import LlamaModel, build_model

    if quick:
        return build_model("tiny", device="cpu")
    return LlamaModel(embedded_config(config_path, layers), device="cpu")


def measure_floor(
    quick: bool, build_hf: Callable[[int], object], config_path: str | Path, threads: int = THREADS
) -> dict:
    """The machine's rates and every model's rows, at ``threads`` torch threads (restored after).

    ``build_hf(layers)`` makes the HF model, :func:`build_embedded` the embedded one of the same shape from
    ``config_path``; one at a time, each freed after its rows (the 24-layer fp32 models are 2-2.5 GB each).  The rates
    are measured before and after the rows and the higher kept (:meth:`MachineFloor.best`): on a shared machine a
    rate measured in a busy second put the floor above the rows' own times.
    """
    setup = QUICK_FLOOR if quick else FloorSetup()
    with torch_threads(threads):
        machine = measure_machine(quick)
        probe = RateProbe(machine.buffer_bytes, machine.gemm_size, PROBE_REPEATS)
        rows = []
        for layers, prefill_repeats in zip(setup.layers, setup.prefill_repeats, strict=True):
            for build in (build_hf, lambda n: build_embedded(quick, n, config_path)):
                model = build(layers)
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


def _figure(value: float) -> str:
    """``value`` to three significant digits, or to the unit from 100 up, with thousands separators (270.1 ->
    "270", 0.04213 -> "0.0421", 12345.6 -> "12,346"): a quick run's tiny model moves well under a megabyte a step."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def floor_table(floor: dict) -> Table:
    """The printed table of :func:`measure_floor`'s result."""
    m = floor["machine"]
    clock_name = "thread CPU time" if m["threads"] == 1 else "wall time"
    rows = []
    for r in floor["rows"]:
        rows.append(
            (
                r["model"],
                f"decode at {r['context']:,} (ms/token)",
                _figure(r["decode_s"] * 1e3),
                f"{_figure(r['decode_floor_s'] * 1e3)} ({_figure(r['decode_bytes'] / 1e6)} MB)",
                f"{r['decode_ratio']:.2f}",
                f"{r['decode_onednn_ratio']:.2f}",
            )
        )
        rows.append(
            (
                r["model"],
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
            f"(weights + live K/V) / bandwidth (the faster of torch.sum and torch.mv by ones over "
            f"{m['buffer_bytes'] >> 20} MiB); prefill floor = FLOPs / GEMM "
            f"({m['gemm_size']}-square fp32 torch.mm); 'ours / floor': each timed run against the rates measured "
            "just before and after it (the higher), best run; the ms columns: best run and the title's rates",
            "'opt-in oneDNN rows': the same decode steps, same run, interleaved, with one_row_onednn(True) (greedy "
            "tokens checked equal); goals (issue 30): decode <= 1.25, prefill <= 1.3",
        ),
    )
