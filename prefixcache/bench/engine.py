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

Clock: the calling thread's CPU time with torch held to one intra-op thread (as in ``bench runner``): on a small
shared machine a second thread makes every op wait for a descheduled peer, and wall time counts other processes'
time slices; all three paths run the same way.  ``--quick`` (CI) runs a 2-layer, hidden-64 Qwen2 at short lengths:
it checks the code path, its figures mean little.
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

from prefixcache.bench.common import BenchResult, Table
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.errors import InvalidArgumentError

QWEN_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tokenizers" / "qwen2.5-0.5b-instruct"
"""The Qwen2.5-0.5B-Instruct tokenizer and config folder beside the repository."""

BLOCK_SIZE = 16
WARM_SUFFIX_TOKENS = 64
TORCH_THREADS = 1
clock: Callable[[], float] = time.thread_time
"""Seconds of CPU time of the calling thread: the clock of every figure here (see the module docstring)."""


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
    """Sizes of one run: model layers, prompt lengths (tokens) for TTFT and decode, decode steps, repeats, and the
    batching case (embedded preset, sessions, system prompt and question tokens, tokens generated per session)."""

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


FULL = EngineSetup(
    layers=4, ttft_lengths=(1024, 4096), decode_contexts=(2048, 8192), decode_steps=16, repeats=2, quick=False
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
)


def build_bench_model(quick: bool, layers: int):
    """The HF model under test: the shared Qwen2.5-0.5B config cut to ``layers`` layers, or (``quick``) a tiny Qwen2.

    Raises InvalidArgumentError when transformers (extra ``hf``) is missing or the shared config is absent.
    """
    try:
        import transformers  # noqa: F401 - only to say which extra is missing
    except ImportError:
        raise InvalidArgumentError("this benchmark needs transformers: pip install 'prefixcache[hf]'") from None
    from prefixcache.models.hf import random_model_from_config, tiny_random_model

    if not quick:
        if not (QWEN_DIR / "config.json").is_file():
            raise InvalidArgumentError(f"the Qwen config is missing at {QWEN_DIR}; run with --quick or fetch ../shared")
        return random_model_from_config(QWEN_DIR, layers=layers, seed=0, device="cpu")
    return tiny_random_model("qwen2", vocab_size=2048, layers=layers, max_positions=4096)


def _ids(model, n: int, seed: int) -> list[int]:
    return torch.randint(0, model.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _timed(fn) -> tuple[float, object]:
    start = clock()
    value = fn()
    return clock() - start, value


@torch.inference_mode()
def _own_forward(hf, ids: list[int], cache=None) -> tuple[float, int]:
    """Seconds of the model's own forward of ``ids`` (after ``cache``'s positions) with ``logits_to_keep=1``, and its
    greedy token."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config) if cache is None else cache
    start = cache.get_seq_length()
    positions = torch.arange(start, start + len(ids)).unsqueeze(0)

    def run():
        out = hf.model(
            input_ids=torch.tensor([ids]),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return int(out.logits[0, -1].argmax())

    return _timed(run)


def _runner(model, tokens: int) -> PrefixCachingRunner:
    return PrefixCachingRunner(model, cache_tokens=tokens + 4 * BLOCK_SIZE, block_size=BLOCK_SIZE)


def measure_cold(model, length: int, repeats: int) -> dict:
    """Cold TTFT through the runner (fresh cache) vs the model's own full forward; medians in seconds."""
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
    return {"tokens": length, "ours_s": statistics.median(ours), "model_s": statistics.median(theirs)}


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
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                past_key_values=cache,
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
            step = torch.tensor([sequence[position]])
            model.forward_cached(step, position, runner.pool.kv, table)
        return (clock() - start) / len(tokens)
    finally:
        runner.cache.release(lease)


def measure_batching(setup: EngineSetup, model=None) -> dict:
    """Aggregate generated tokens/s of ``batch_sessions`` sessions served together over the same sessions one at a
    time, both behind a cached system prompt, on ``model`` (default: the embedded ``batch_preset``); the batched tokens
    are checked equal to the serial ones."""
    from prefixcache.models.llama import build_model

    name = getattr(model, "name", setup.batch_preset)
    model = build_model(setup.batch_preset, device="cpu") if model is None else model
    system = torch.randint(0, 259, (setup.batch_system_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    questions = [_ids_below(259, setup.batch_question_tokens, seed=500 + i) for i in range(setup.batch_sessions)]
    prompts = [system + q for q in questions]
    params = SamplingParams(max_new_tokens=setup.batch_new_tokens)
    per_session = setup.batch_question_tokens + 2 * setup.batch_new_tokens
    tokens = setup.batch_system_tokens + setup.batch_sessions * per_session
    serial_runner = PrefixCachingRunner(model, cache_tokens=tokens, block_size=BLOCK_SIZE)
    batch_runner = PrefixCachingRunner(model, cache_tokens=tokens, block_size=BLOCK_SIZE)
    serial_runner.prefill(system)
    batch_runner.prefill(system)
    start = clock()
    serial = [serial_runner.generate(p, params) for p in prompts]
    serial_s = clock() - start
    start = clock()
    batched = batch_runner.generate_many(prompts, params)
    batched_s = clock() - start
    if [r.token_ids for r in batched] != [r.token_ids for r in serial]:
        raise AssertionError("batched tokens differ from serial tokens")
    generated = sum(len(r.token_ids) for r in batched)
    return {
        "model": name,
        "sessions": setup.batch_sessions,
        "system_tokens": setup.batch_system_tokens,
        "generated_tokens": generated,
        "serial_tokens_per_s": generated / serial_s,
        "batched_tokens_per_s": generated / batched_s,
    }


def _ids_below(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(quick: bool = False) -> BenchResult:
    """Measure and tabulate; raises InvalidArgumentError without transformers or (full run) the shared config."""
    setup = QUICK if quick else FULL
    model = build_bench_model(quick, setup.layers)
    threads = TORCH_THREADS
    with one_torch_thread():
        cold = [measure_cold(model, n, setup.repeats) for n in setup.ttft_lengths]
        warm = [measure_warm(model, n, setup.repeats) for n in setup.ttft_lengths]
        decode = [measure_decode(model, c, setup.decode_steps, setup.repeats) for c in setup.decode_contexts]
        batching = [measure_batching(setup), measure_batching(setup, model)]
    rows = []
    for c in cold:
        rows.append(
            ("cold TTFT (ms)", f"{c['tokens']:,}", "model forward, keep 1 logit", *_cells(c["ours_s"], c["model_s"]))
        )
    for w in warm:
        rows.append(
            (
                "warm TTFT (ms)",
                f"{w['tokens']:,} ({w['suffix']} new)",
                "model forward of the suffix",
                *_cells(w["ours_s"], w["model_s"]),
            )
        )
    for d in decode:
        rows.append(
            (
                "decode (ms/token)",
                f"{d['context']:,}",
                "model.generate, own DynamicCache",
                *_cells(d["ours_s"], d["generate_s"]),
            )
        )
        rows.append(
            (
                "  old: gather (ms/token)",
                f"{d['context']:,}",
                "model.generate, own DynamicCache",
                *_cells(d["gather_s"], d["generate_s"]),
            )
        )
    for b in batching:
        rows.append(
            (
                f"{b['sessions']} sessions (tok/s)",
                f"{b['system_tokens']:,} shared",
                f"one session at a time ({b['model']})",
                f"{b['batched_tokens_per_s']:.1f}",
                f"{b['serial_tokens_per_s']:.1f}",
                f"{b['batched_tokens_per_s'] / b['serial_tokens_per_s']:.2f}",
            )
        )
    shape = f"{model.name}, hidden {model.config.hidden_size}, vocab {model.vocab_size:,}"
    table = Table(
        title=f"engine: runner vs the model's own transformers calls ({shape}, {'quick' if quick else 'full'})",
        headers=("measure", "tokens", "baseline is", "ours", "baseline", "ours / baseline"),
        rows=tuple(rows),
        notes=(
            f"thread CPU time, medians of {setup.repeats} interleaved repeats, one process, {threads} torch thread(s), "
            f"block_size {BLOCK_SIZE}; greedy tokens checked equal to the baseline's",
            "'old: gather' is forward_cached without live K/V: each step copies the prefix out of the pool",
        ),
    )
    data = {"setup": _setup_dict(setup), "cold": cold, "warm": warm, "decode": decode, "batching": batching}
    return BenchResult("engine", (table,), data)


def _setup_dict(setup: EngineSetup) -> dict:
    return {name: getattr(setup, name) for name in EngineSetup.__slots__}


def _cells(ours: float, baseline: float) -> tuple[str, str, str]:
    return f"{ours * 1e3:.1f}", f"{baseline * 1e3:.1f}", f"{ours / baseline:.2f}"
