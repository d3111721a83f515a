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
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.bench.common import BenchResult, Table, ms_cells, ratio_spread, spread_text
from prefixcache.bench.floor import floor_table, measure_floor
from prefixcache.bench.grammar import grammar_rows, measure_grammar
from prefixcache.bench.hybrid import hybrid_note, hybrid_rows, measure_hybrid, own_forward
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.errors import InvalidArgumentError, install_command
from prefixcache.models.paged_attention import paged_attention_supported

QWEN_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tokenizers" / "qwen2.5-0.5b-instruct"
"""The Qwen2.5-0.5B-Instruct tokenizer and config folder beside the repository."""

BLOCK_SIZE = 16
WARM_SUFFIX_TOKENS = 64
TORCH_THREADS = 1
clock: Callable[[], float] = time.thread_time
"""The clock of every figure here: seconds of CPU time of the calling thread, or GPU wall time inside
:func:`device_clock` for CUDA (see the module docstring)."""
DEVICES = ("cpu", "cuda")


def check_device(device: str) -> torch.device:
    """``device`` as a torch device when this machine has it.

    Raises:
        InvalidArgumentError: not one of :data:`DEVICES`, or ``cuda`` without a CUDA device.
    """
    if device not in DEVICES:
        raise InvalidArgumentError(f"device must be one of {list(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    return torch.device(device)


def _cuda_wall_clock() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def device_clock(device: torch.device) -> Iterator[None]:
    """Make :data:`clock` the device's clock inside the block: wall time after a synchronize on CUDA (the CPU only
    launches kernels there, so its CPU time would miss the work); the thread's CPU time otherwise."""
    global clock
    before = clock
    clock = _cuda_wall_clock if device.type == "cuda" else time.thread_time
    try:
        yield
    finally:
        clock = before


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Hold torch to ``TORCH_THREADS`` intra-op threads inside the block (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def timed_runner_call(runner: PrefixCachingRunner, prompt: list[int], params: SamplingParams):
    """``(ttft_s, total_s, result)`` of one runner request on :data:`clock`; the first token's time is taken when
    the runner yields it."""
    first: list[float] = []
    start = clock()
    steps = runner.stream(prompt, params, on_token=lambda _token: first.append(clock()) if not first else None)
    try:
        while True:
            next(steps)
    except StopIteration as done:
        result = done.value
    total = clock() - start
    return (first[0] - start if first else total), total, result


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """Sizes of one run: model layers, prompt lengths (tokens) for TTFT and decode, decode steps, repeats, the
    batching case (embedded preset, sessions, system prompt and question tokens, tokens generated per session), and
    the interleaved repeats of the cold TTFT (one count per TTFT length: the short prompt's ratio scatters most and
    costs least) and batching cases, whose ratios scatter most on a shared machine."""

    layers: int
    ttft_lengths: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int
    repeats: int
    quick: bool
    batch_preset: str = "small"
    batch_sessions: int = 8
    batch_system_tokens: int = 2000
    batch_question_tokens: int = 32
    batch_new_tokens: int = 32
    cold_repeats: tuple[int, ...] = (2, 2)
    batch_repeats: int = 2
    hybrid_tokens: int = 2048


FULL = EngineSetup(
    layers=4,
    ttft_lengths=(1024, 4096),
    decode_contexts=(2048, 8192),
    decode_steps=16,
    repeats=2,
    quick=False,
    cold_repeats=(12, 6),
    batch_repeats=3,
)
QUICK = EngineSetup(
    layers=2,
    ttft_lengths=(128, 256),
    decode_contexts=(256,),
    decode_steps=8,
    repeats=2,
    quick=True,
    batch_preset="tiny",
    batch_system_tokens=200,
    batch_new_tokens=8,
    hybrid_tokens=256,
)


def build_bench_model(quick: bool, layers: int, device: torch.device | str = "cpu"):
    """The HF model under test on ``device``: the shared Qwen2.5-0.5B config cut to ``layers`` layers, or (``quick``)
    a tiny Qwen2.

    Raises InvalidArgumentError when transformers (extra ``hf``) is missing or the shared config is absent.
    """
    try:
        import transformers  # noqa: F401 - only to say which extra is missing
    except ImportError:
        raise InvalidArgumentError(f"this benchmark needs transformers: {install_command('hf')}") from None
    from prefixcache.models.hf import random_model_from_config
    from prefixcache.models.hf_tiny import tiny_random_model

    if not quick:
        if not (QWEN_DIR / "config.json").is_file():
            raise InvalidArgumentError(f"the Qwen config is missing at {QWEN_DIR}; run with --quick or fetch ../shared")
        return random_model_from_config(QWEN_DIR, layers=layers, seed=0, device=device)
    return tiny_random_model("qwen2", vocab_size=2048, layers=layers, max_positions=4096, device=device)


def _ids(model, n: int, seed: int) -> list[int]:
    return torch.randint(0, model.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _timed(fn) -> tuple[float, object]:
    start = clock()
    value = fn()
    return clock() - start, value


@torch.inference_mode()
def _own_forward(hf, ids: list[int], cache=None) -> tuple[float, int]:
    """:func:`~prefixcache.bench.hybrid.own_forward` on ``cache``, a fresh ``DynamicCache`` by default."""
    from transformers import DynamicCache

    return own_forward(hf, ids, DynamicCache(config=hf.config) if cache is None else cache)


def _runner(model, tokens: int) -> PrefixCachingRunner:
    return PrefixCachingRunner(model, cache_tokens=tokens + 4 * BLOCK_SIZE, block_size=BLOCK_SIZE)


def measure_cold(model, length: int, repeats: int) -> dict:
    """Cold TTFT through the runner (fresh cache) vs the model's own full forward: medians in seconds, and the median,
    lowest and highest of the per-repeat ratios (each repeat runs both sides on the same prompt, one after the other,
    the side that runs first alternating)."""
    ours, theirs = [], []
    for rep in range(repeats):
        prompt = _ids(model, length, seed=rep)
        runner = _runner(model, length + 1)
        # Which side runs first alternates: the second run of a repeat finds warmed caches and allocator.
        if rep % 2:
            seconds, token = _own_forward(model, prompt)
        ttft, _, result = timed_runner_call(runner, prompt, SamplingParams(max_new_tokens=1))
        if not rep % 2:
            seconds, token = _own_forward(model, prompt)
        ours.append(ttft)
        theirs.append(seconds)
        if token != result.token_ids[0]:
            raise AssertionError(f"cold prefill of {length} tokens: runner token {result.token_ids[0]} != {token}")
    return {
        "tokens": length,
        "repeats": repeats,
        "ours_s": statistics.median(ours),
        "model_s": statistics.median(theirs),
        **ratio_spread([a / b for a, b in zip(ours, theirs, strict=True)]),
    }


@torch.inference_mode()
def measure_warm(model, length: int, repeats: int) -> dict:
    """Warm TTFT (``length - WARM_SUFFIX_TOKENS`` cached) vs the model's own forward of the suffix on a prefilled
    cache."""
    from transformers import DynamicCache

    prefix = _ids(model, length - WARM_SUFFIX_TOKENS, seed=100)
    runner = _runner(model, length + repeats * WARM_SUFFIX_TOKENS)
    runner.prefill(prefix)
    prefilled = DynamicCache(config=model.config)
    _own_forward(model, prefix, prefilled)
    ours, theirs = [], []
    for rep in range(repeats):
        suffix = _ids(model, WARM_SUFFIX_TOKENS, seed=200 + rep)
        cache = copy.deepcopy(prefilled)  # outside the timed region: the baseline's cache is already warm
        if rep % 2:  # alternate which side runs first, as in measure_cold
            seconds, token = _own_forward(model, suffix, cache)
        ttft, _, result = timed_runner_call(runner, prefix + suffix, SamplingParams(max_new_tokens=1))
        if not rep % 2:
            seconds, token = _own_forward(model, suffix, cache)
        if result.usage.cached_tokens != len(prefix):
            raise AssertionError(f"warm run found {result.usage.cached_tokens} cached tokens, expected {len(prefix)}")
        ours.append(ttft)
        theirs.append(seconds)
        if token != result.token_ids[0]:
            raise AssertionError(f"warm prefill: runner token {result.token_ids[0]} != model's {token}")
    return {
        "tokens": length,
        "suffix": WARM_SUFFIX_TOKENS,
        "ours_s": statistics.median(ours),
        "model_s": statistics.median(theirs),
    }


@torch.inference_mode()
def measure_decode(model, context: int, steps: int, repeats: int) -> dict:
    """Seconds per generated token at ``context`` tokens: runner (live K/V), ``model.generate`` on its own prefilled
    ``DynamicCache``, and the gather-every-step path (``forward_cached`` without live K/V)."""
    from transformers import DynamicCache

    prompt = _ids(model, context, seed=300)
    prefilled = DynamicCache(config=model.config)
    _own_forward(model, prompt[:-1], prefilled)
    runner = _runner(model, context + 3 * steps)  # room for the gather path's private blocks
    runner.prefill(prompt[:-1])
    params = SamplingParams(max_new_tokens=steps)
    ours, theirs, gather = [], [], []
    for _ in range(repeats):
        # Per token: the last prompt token's forward plus steps - 1 decode steps, as for generate below.
        _, total, result = timed_runner_call(runner, prompt, params)
        ours.append(total / steps)
        cache = copy.deepcopy(prefilled)
        seconds, out = _timed(
            lambda cache=cache: model.model.generate(
                torch.tensor([prompt], device=model.device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
                **{model.cache_kwarg: cache},
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                pad_token_id=0,
            )
        )
        theirs.append(seconds / steps)
        if out[0, len(prompt) :].tolist() != list(result.token_ids):
            raise AssertionError(f"decode at {context}: runner tokens differ from model.generate's")
        gather.append(_gather_decode(runner, prompt, list(result.token_ids)))
    return {
        "context": context,
        "steps": steps,
        "ours_s": statistics.median(ours),
        "generate_s": statistics.median(theirs),
        "gather_s": statistics.median(gather),
    }


def _gather_decode(runner: PrefixCachingRunner, prompt: list[int], tokens: list[int]) -> float:
    """Seconds per token of the pre-live-K/V decode: every step gathers the whole prefix out of the pool.

    Runs on private blocks after the cached ``prompt[:-1]`` (a lease whose last token differs from the prompt's, so
    that nothing shared is written), then releases them.
    """
    model = runner.model
    other = (prompt[-1] + 1) % model.vocab_size
    lease = runner.cache.acquire([*prompt[:-1], other], runner.namespace_key(None))
    try:
        runner.cache.reserve(lease, len(prompt) + len(tokens))
        table = runner.pool.block_table_tensor(lease.block_table)
        sequence = prompt + tokens
        start = clock()
        for position in range(len(prompt) - 1, len(sequence) - 1):
            step = torch.tensor([sequence[position]], device=model.device)
            model.forward_cached(step, position, runner.pool.kv, table)
        return (clock() - start) / len(tokens)
    finally:
        runner.cache.release(lease)


def measure_batching(setup: EngineSetup, model=None, device: torch.device | str = "cpu") -> dict:
    """Aggregate generated tokens/s of ``batch_sessions`` sessions served together over the same sessions one at a
    time, both behind a cached system prompt, on ``model`` (default: the embedded ``batch_preset`` on ``device``).

    Both sides do the same work: each session's uncached question (``batch_question_tokens``) is prefilled and
    ``batch_new_tokens`` tokens are decoded, on a fresh runner whose cache holds the system prompt alone; the batched
    tokens are checked equal to the serial ones.  ``batch_repeats`` interleaved repeats (the side that runs first
    alternates); tokens/s from the median seconds of each side, and the median, lowest and highest per-repeat ratio.
    One untimed batched call of two sessions comes first: one-time costs of batched decode (on the CPU the oneDNN
    copy of the weights, :class:`~prefixcache.models.linear.WeightPacks`) are paid before timing, as loading is.
    """
    from prefixcache.models.llama import build_model

    name = getattr(model, "name", setup.batch_preset)
    model = build_model(setup.batch_preset, device=device) if model is None else model
    system = torch.randint(0, 259, (setup.batch_system_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    questions = [_ids_below(259, setup.batch_question_tokens, seed=500 + i) for i in range(setup.batch_sessions)]
    prompts = [system + q for q in questions]
    params = SamplingParams(max_new_tokens=setup.batch_new_tokens)
    per_session = setup.batch_question_tokens + 2 * setup.batch_new_tokens
    tokens = setup.batch_system_tokens + setup.batch_sessions * per_session

    def timed(together: bool) -> tuple[float, list]:
        runner = PrefixCachingRunner(model, cache_tokens=tokens, block_size=BLOCK_SIZE)
        runner.prefill(system)  # outside the timed region
        start = clock()
        results = runner.generate_many(prompts, params) if together else [runner.generate(p, params) for p in prompts]
        return clock() - start, results

    PrefixCachingRunner(model, cache_tokens=tokens, block_size=BLOCK_SIZE).generate_many(prompts[:2], params)
    serial_s, batched_s = [], []
    for rep in range(setup.batch_repeats):
        runs = {together: timed(together) for together in ((False, True) if rep % 2 == 0 else (True, False))}
        (s_seconds, s_results), (b_seconds, b_results) = runs[False], runs[True]
        if [r.token_ids for r in b_results] != [r.token_ids for r in s_results]:
            raise AssertionError("batched tokens differ from serial tokens")
        serial_s.append(s_seconds)
        batched_s.append(b_seconds)
    generated = sum(len(r.token_ids) for r in b_results)
    return {
        "model": name,
        "sessions": setup.batch_sessions,
        "system_tokens": setup.batch_system_tokens,
        "generated_tokens": generated,
        "repeats": setup.batch_repeats,
        "serial_tokens_per_s": generated / statistics.median(serial_s),
        "batched_tokens_per_s": generated / statistics.median(batched_s),
        **ratio_spread([s / b for s, b in zip(serial_s, batched_s, strict=True)]),
    }


def measure_shared_prefill(setup: EngineSetup) -> dict:
    """``batch_sessions`` sessions behind one uncached ``batch_system_tokens`` system prompt, submitted together to a
    :class:`~prefixcache.engine.batching.BatchEngine` with prefix-aware scheduling (``"lpm"``) and without
    (``"fcfs"``), each on a fresh cache: prefilled tokens, wall seconds (``time.perf_counter``) and thread CPU
    seconds (:data:`clock`) of each.  Raises AssertionError when the two disagree on any session's tokens."""
    from prefixcache.engine.batching import BatchEngine
    from prefixcache.models.llama import build_model

    model = build_model(setup.batch_preset, device="cpu")
    system = _ids_below(259, setup.batch_system_tokens, seed=2)
    prompts = [system + _ids_below(259, setup.batch_question_tokens, seed=600 + i) for i in range(setup.batch_sessions)]
    params = SamplingParams(max_new_tokens=setup.batch_new_tokens)
    tokens = setup.batch_sessions * (len(prompts[0]) + setup.batch_new_tokens) + setup.batch_system_tokens
    out: dict = {"model": setup.batch_preset, "sessions": setup.batch_sessions, "system_tokens": len(system)}
    outputs = {}
    for policy in ("lpm", "fcfs"):
        engine = BatchEngine(PrefixCachingRunner(model, cache_tokens=tokens, block_size=BLOCK_SIZE), policy=policy)
        wall, cpu = time.perf_counter(), clock()
        handles = [engine.submit(prompt, params) for prompt in prompts]
        engine.run_until_idle()
        results = [handle.result() for handle in handles]
        out[policy] = {
            "prefilled_tokens": sum(r.usage.prefilled_tokens for r in results),
            "wall_s": time.perf_counter() - wall,
            "cpu_s": clock() - cpu,
            "steps": engine.steps,
        }
        outputs[policy] = [r.token_ids for r in results]
    if outputs["lpm"] != outputs["fcfs"]:
        raise AssertionError("prefix-aware scheduling changed a session's tokens")
    return out


@torch.inference_mode()
def measure_paged(setup: EngineSetup, context: int, device: torch.device, atol: float = 1e-4) -> dict:
    """Seconds per decode token at ``context`` tokens on the embedded ``batch_preset`` model: attention through the
    block table (``paged_attention``) against the gather of the prefix out of the pool; every step's logits are
    checked equal between the two (float32, within ``atol``).  The block table is shuffled, so the request's blocks
    are scattered over the pool as they are after evictions."""
    from prefixcache.models.llama import build_model

    model = build_model(setup.batch_preset, device=device)
    steps = setup.decode_steps
    num_blocks = -(-(context + steps) // BLOCK_SIZE)
    if not paged_attention_supported(device, BLOCK_SIZE):
        raise InvalidArgumentError(f"paged attention does not run on {device} with blocks of {BLOCK_SIZE} tokens")
    shape = (model.num_layers, 2, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    kv = torch.zeros(shape, dtype=model.dtype, device=device)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7))
    table = order.to(device)
    ids = torch.tensor(_ids_below(model.vocab_size, context + steps, seed=600), device=device)
    model.forward_cached(ids[:context], 0, kv, table)
    seconds = {True: 0.0, False: 0.0}
    for position in range(context, context + steps):
        logits = {}
        for paged in (True, False):
            model.paged_attention = paged
            start = clock()
            logits[paged] = model.forward_cached(ids[position : position + 1], position, kv, table)
            seconds[paged] += clock() - start
        diff = float((logits[True] - logits[False]).abs().max())
        if diff > atol:
            raise AssertionError(f"paged attention at {position}: logits differ from the gather path's by {diff:.3g}")
    return {
        "model": setup.batch_preset,
        "context": context,
        "steps": steps,
        "paged_s": seconds[True] / steps,
        "gather_s": seconds[False] / steps,
    }


def _ids_below(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(quick: bool = False, device: str = "cpu") -> BenchResult:
    """Measure and tabulate on ``device`` (``"cpu"`` or ``"cuda"``).

    Raises InvalidArgumentError without transformers, (full run) without the shared config, or for a device this
    machine lacks (see :func:`check_device`).
    """
    where = check_device(device)
    setup = QUICK if quick else FULL
    model = build_bench_model(quick, setup.layers, where)
    threads = TORCH_THREADS
    with one_torch_thread(), device_clock(where):
        cold = [measure_cold(model, n, r) for n, r in zip(setup.ttft_lengths, setup.cold_repeats, strict=True)]
        warm = [measure_warm(model, n, setup.repeats) for n in setup.ttft_lengths]
        decode = [measure_decode(model, c, setup.decode_steps, setup.repeats) for c in setup.decode_contexts]
        batching = [measure_batching(setup, device=where), measure_batching(setup, model)]
        shared = measure_shared_prefill(setup)
        paged = [measure_paged(setup, c, where) for c in setup.decode_contexts]
        hybrid = measure_hybrid(setup.hybrid_tokens, setup.repeats, setup.quick, where)
        grammar = measure_grammar(setup.quick, setup.repeats, where)
    # The floor rows (bench.floor) run at their own thread count, on the CPU only (the floor is the CPU's).
    floor = measure_floor(quick, lambda n: build_bench_model(quick, n), QWEN_DIR) if where.type == "cpu" else None
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
        "setup": _setup_dict(setup),
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


def _setup_dict(setup: EngineSetup) -> dict:
    return {name: getattr(setup, name) for name in EngineSetup.__slots__}
