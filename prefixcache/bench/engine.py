"""The ``engine`` benchmark: the runner's prefill and decode path against the model's own transformers calls.

On a random-weight Qwen2 from the shared config (``../shared/data/tokenizers/qwen2.5-0.5b-instruct``) cut to a few
layers, measured side by side in one process, repeats interleaved, medians:

- cold TTFT (empty cache) over the model's own forward of the whole prompt with ``logits_to_keep=1``;
- warm TTFT (prefix cached) over the model's own forward of only the uncached suffix on a ``DynamicCache`` that
  already holds the prefix;
- decode time per token over ``model.generate`` continuing its own ``DynamicCache``, and, to show what live K/V
  removed, the old path that gathered the whole prefix out of the pool at every step;
- continuous batching: 8 sessions behind one system prompt served together by ``runner.generate_many`` (one batched
  forward per step) against the same sessions served one at a time, in aggregate generated tokens per second; on the
  embedded ``small`` model (one packed forward) and on the HF model above (one padded batch per step).
- prefix-aware scheduling: the same sessions arriving together behind the system prompt *uncached*, through one
  :class:`~prefixcache.engine.batching.BatchEngine` with ``policy="lpm"`` (the system prompt prefilled once) and with
  ``policy="fcfs"`` (every session prefills it): prefilled tokens and wall time.

- a hybrid model's warm TTFT, resumed from its recurrent-state snapshot (:mod:`prefixcache.bench.hybrid`); a JSON
  schema's cost per batched decode step (:mod:`prefixcache.bench.grammar`).

- paged attention (:mod:`prefixcache.models.paged_attention`) on the embedded model: decode time per token reading
  the pool through the block table against the gather of the prefix out of the pool, logits checked equal.

Clock: on the CPU, the calling thread's CPU time with torch held to one intra-op thread (as in ``bench runner``): on a
small shared machine a second thread makes every op wait for a descheduled peer, and wall time counts other processes'
time slices; all paths run the same way.  With ``device="cuda"`` (``--device cuda``) every model and pool lives on
the GPU and the clock is wall time after a device synchronize.  ``--quick`` (CI) runs a 2-layer, hidden-64 Qwen2 at
short lengths: it checks the code path, its figures mean little.

This module runs the rows and lays out the table; the rows are measured in :mod:`prefixcache.bench.engine_request`
(TTFT, decode), :mod:`prefixcache.bench.engine_batching`, :mod:`prefixcache.bench.engine_paged`, on the clock of
:mod:`prefixcache.bench.device_clock`, with the sizes of :mod:`prefixcache.bench.engine_setup`.
"""

from __future__ import annotations

from prefixcache.bench.common import BenchResult, Table, ms_cells, spread_text
from prefixcache.bench.device_clock import TORCH_THREADS, check_device, device_clock, torch_threads
from prefixcache.bench.engine_batching import measure_batching, measure_shared_prefill
from prefixcache.bench.engine_paged import measure_paged
from prefixcache.bench.engine_request import measure_cold, measure_decode, measure_warm
from prefixcache.bench.engine_setup import BLOCK_SIZE, FULL, QUICK, QWEN_DIR, build_bench_model, setup_dict
from prefixcache.bench.floor import measure_floor
from prefixcache.bench.floor_table import floor_table
from prefixcache.bench.grammar import grammar_rows, measure_grammar
from prefixcache.bench.hybrid import hybrid_note, hybrid_rows, measure_hybrid
from prefixcache.bench.precision import parse_precision

__all__ = ["run"]


def run(quick: bool = False, device: str = "cpu", precisions: tuple[str, ...] = ("float32",)) -> BenchResult:
    """Measure and tabulate on ``device`` (``"cpu"`` or ``"cuda"``); the floor rows at each of ``precisions``
    (:data:`~prefixcache.bench.precision.PRECISION_NAMES`; the other rows run float32).

    Raises InvalidArgumentError without transformers, (full run) without the shared config, for a device this
    machine lacks (see :func:`check_device`) or an unknown precision.
    """
    floor_precisions = tuple(parse_precision(name) for name in precisions)
    where = check_device(device)
    setup = QUICK if quick else FULL
    model = build_bench_model(quick, setup.layers, where)
    threads = TORCH_THREADS
    with torch_threads(), device_clock(where):
        cold = [measure_cold(model, n, r) for n, r in zip(setup.ttft_lengths, setup.cold_repeats, strict=True)]
        warm = [measure_warm(model, n, setup.repeats) for n in setup.ttft_lengths]
        decode = [measure_decode(model, c, setup.decode_steps, setup.repeats) for c in setup.decode_contexts]
        batching = [measure_batching(setup, device=where), measure_batching(setup, model)]
        shared = measure_shared_prefill(setup)
        paged = [measure_paged(setup, c, where) for c in setup.decode_contexts]
        hybrid = measure_hybrid(setup.hybrid_tokens, setup.repeats, setup.quick, where)
        grammar = measure_grammar(setup.quick, setup.repeats, where)
    # The floor rows (bench.floor) run at their own thread count, on the CPU only (the floor is the CPU's).
    floor = None
    if where.type == "cpu":
        build_hf = lambda n, dtype: build_bench_model(quick, n, dtype=dtype)  # noqa: E731
        floor = measure_floor(quick, build_hf, QWEN_DIR, precisions=floor_precisions)
    rows = []
    for c in cold:
        rows.append(
            (
                f"cold TTFT (ms, {c['repeats']} repeats)",
                f"{c['tokens']:,}",
                "model forward, keep 1 logit",
                *ms_cells(c["ours_s"], c["model_s"])[:2],
                spread_text(c),
            )
        )
    for w in warm:
        rows.append(
            (
                "warm TTFT (ms)",
                f"{w['tokens']:,} ({w['suffix']} new)",
                "model forward of the suffix",
                *ms_cells(w["ours_s"], w["model_s"]),
            )
        )
    for d in decode:
        rows.append(
            (
                "decode (ms/token)",
                f"{d['context']:,}",
                "model.generate, own DynamicCache",
                *ms_cells(d["ours_s"], d["generate_s"]),
            )
        )
        rows.append(
            (
                "  old: gather (ms/token)",
                f"{d['context']:,}",
                "model.generate, own DynamicCache",
                *ms_cells(d["gather_s"], d["generate_s"]),
            )
        )
    for b in batching:
        rows.append(
            (
                f"{b['sessions']} sessions (tok/s, {b['repeats']} repeats)",
                f"{b['system_tokens']:,} shared",
                f"one session at a time ({b['model']})",
                f"{b['batched_tokens_per_s']:.1f}",
                f"{b['serial_tokens_per_s']:.1f}",
                spread_text(b),
            )
        )
    lpm, fcfs = shared["lpm"], shared["fcfs"]
    sessions = f"{shared['sessions']} new sessions"
    behind = f"{shared['system_tokens']:,} shared, uncached"
    baseline = f"arrival order (fcfs, {shared['model']})"
    ours, base = lpm["prefilled_tokens"], fcfs["prefilled_tokens"]
    rows.append((f"{sessions}, prefilled tokens", behind, baseline, f"{ours:,}", f"{base:,}", f"{ours / base:.2f}"))
    ours, base = lpm["wall_s"], fcfs["wall_s"]
    rows.append((f"{sessions}, wall time (s)", behind, baseline, f"{ours:.2f}", f"{base:.2f}", f"{ours / base:.2f}"))
    for p in paged:
        rows.append(
            (
                "paged attention (ms/token)",
                f"{p['context']:,}",
                f"gather from the pool ({p['model']}, embedded)",
                *ms_cells(p["paged_s"], p["gather_s"]),
            )
        )
    rows += hybrid_rows(hybrid) + grammar_rows(grammar)
    shape = f"{model.name}, hidden {model.config.hidden_size}, vocab {model.vocab_size:,}"
    table = Table(
        title=(
            f"engine: runner vs the model's own transformers calls ({shape}, {'quick' if quick else 'full'}, "
            f"{where.type})"
        ),
        headers=("measure", "tokens", "baseline is", "ours", "baseline", "ours / baseline"),
        rows=tuple(rows),
        notes=(
            f"{'GPU wall time' if where.type == 'cuda' else 'thread CPU time'}, medians of {setup.repeats} interleaved "
            f"repeats (cold TTFT and sessions: as stated), one process, {threads} torch thread(s), "
            f"block_size {BLOCK_SIZE}; greedy tokens checked equal to the baseline's",
            "'old: gather' is forward_cached without live K/V: each step copies the prefix out of the pool",
            "cold TTFT and sessions: ratio is the median of the per-repeat ratios (lowest-highest in brackets); "
            "sessions: each side prefills every session's question and decodes its tokens behind the cached prompt",
            "new sessions: submitted together to one BatchEngine, prefix-aware (lpm: longest cached prefix first, a "
            "shared uncached prefix prefilled once) vs fcfs; wall time, not thread CPU time",
            "'paged attention': forward_cached reading the pool through the block table (flex_attention; eager, "
            "unfused on the CPU), logits checked equal to the gather path's",
            hybrid_note(hybrid),
        ),
    )
    data = {
        "device": where.type,
        "setup": setup_dict(setup),
        "cold": cold,
        "warm": warm,
        "decode": decode,
        "batching": batching,
        "shared_prefill": shared,
        "paged": paged,
        "hybrid": hybrid,
        "grammar": grammar,
    }
    data["floor"] = floor
    return BenchResult("engine", (table,) if floor is None else (table, floor_table(floor)), data)
