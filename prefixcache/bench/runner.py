"""The ``runner`` benchmark: time to first token behind a shared system prompt, with the cache, without it, and
the ideal; and the cache layer's own share of a request's time.

Workload, per system prompt of 512, 2,048 and 8,192 tokens: the system prompt is prefilled once (a server warming
it), then 64 short questions each arrive as ``system + "<|im_start|>user\\n" + body + "<|im_end|>\\n<|im_start|>
assistant\\n"`` with a random 16-48 byte body whose first byte differs between questions.  So every question
reuses the system prompt and the 6-token user header (a match ending inside a block: one copy-on-write) and
prefills its own body and tail.  Token ids are seeded random bytes of the :class:`ByteTokenizer` vocabulary.

Per question, side by side in one loop:

- cache: ``PrefixCachingRunner.stream`` until the first token comes out (this includes ``acquire``, unlike
  ``Usage.ttft_s``), one greedy token, then the commit;
- ideal (Amdahl): ``forward_cached`` of only the uncached tokens on a scratch pool that already holds the prefix
  KV, plus the argmax: the prefill a cache with no bookkeeping at all would do;
- no cache: ``forward_cached`` of the whole prompt from position 0 plus the argmax, on a sample of the questions
  only (a full 8,192-token prefill takes seconds).

Fraction of the ideal speed-up = (no-cache / cache) / (no-cache / ideal) = ideal / cache: the median over
questions of that ratio, each pair measured back to back so that a busy spell of the machine hits both.  The cache
layer's overhead is timed around its calls: ``RadixCache.acquire`` (match, lock, copy-on-write), ``reserve``
(allocate), the pool's ``block_table_tensor``, and ``commit`` (insert, unlock), in a small subclass and wrapper
installed on the runner; its share is of the wall time of the whole request (median over questions).  Times in
the tables are medians.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from prefixcache.bench.common import QUICK_NOT_JUDGED, BenchResult, Table, progress, verdict
from prefixcache.bench.device_clock import TORCH_THREADS, torch_threads
from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.chat.tokenizer import BYTE_SPECIAL_TOKENS, ByteTokenizer
from prefixcache.engine.runner import PrefixCachingRunner, SamplingParams
from prefixcache.models.llama import build_model

NUM_QUESTIONS = 64
NUM_UNCACHED = {512: 4, 2048: 4, 8192: 2}
"""No-cache prefills timed per system-prompt length: each 8,192-token one takes the small model ~10-20 s here."""
QUESTION_BODY_TOKENS = (16, 48)
BLOCK_SIZE = 16
GOAL_FRACTION_OF_IDEAL = 0.90
GOAL_OVERHEAD_SHARE = 0.05
QUICK = {"model": "tiny", "questions": 8, "uncached": {256: 2, 1024: 2, 4096: 2}}
FULL = {"model": "small", "questions": NUM_QUESTIONS, "uncached": NUM_UNCACHED}
PARTS = ("acquire", "reserve", "block_table", "commit")

_tokenizer = ByteTokenizer()
USER_HEADER = [BYTE_SPECIAL_TOKENS["<|im_start|>"], *_tokenizer.encode("user\n")]
ASSISTANT_TAIL = [
    BYTE_SPECIAL_TOKENS["<|im_end|>"],
    *_tokenizer.encode("\n"),
    BYTE_SPECIAL_TOKENS["<|im_start|>"],
    *_tokenizer.encode("assistant\n"),
]


class TimedCache(RadixCache):
    """A RadixCache that adds the seconds spent in each request-level call to ``seconds[name]``."""

    def __init__(self, pool: KVBlockPool, policy: str = "lru") -> None:
        super().__init__(pool, policy)
        self.seconds = dict.fromkeys(PARTS, 0.0)

    def acquire(self, *args: Any, **kwargs: Any):
        start = time.perf_counter()
        try:
            return super().acquire(*args, **kwargs)
        finally:
            self.seconds["acquire"] += time.perf_counter() - start

    def reserve(self, *args: Any, **kwargs: Any):
        start = time.perf_counter()
        try:
            return super().reserve(*args, **kwargs)
        finally:
            self.seconds["reserve"] += time.perf_counter() - start

    def commit(self, *args: Any, **kwargs: Any):
        start = time.perf_counter()
        try:
            return super().commit(*args, **kwargs)
        finally:
            self.seconds["commit"] += time.perf_counter() - start


def timed_runner(model, num_tokens: int) -> tuple[PrefixCachingRunner, TimedCache]:
    """A runner whose cache is a :class:`TimedCache` and whose pool times ``block_table_tensor`` into it."""
    runner = PrefixCachingRunner(model, _tokenizer, cache_tokens=num_tokens, block_size=BLOCK_SIZE)
    cache = TimedCache(runner.pool)
    runner.cache = cache
    build_table = runner.pool.block_table_tensor

    def block_table_tensor(block_ids):
        start = time.perf_counter()
        try:
            return build_table(block_ids)
        finally:
            cache.seconds["block_table"] += time.perf_counter() - start

    runner.pool.block_table_tensor = block_table_tensor
    return runner, cache


def make_questions(num_questions: int, seed: int) -> list[list[int]]:
    """Question bodies: random bytes, 16-48 of them, each starting with a different byte."""
    rng = np.random.default_rng(seed)
    firsts = rng.permutation(256)[:num_questions]
    lo, hi = QUESTION_BODY_TOKENS
    return [[int(first), *rng.integers(0, 256, int(rng.integers(lo, hi + 1))).tolist()] for first in firsts]


def _greedy_first_token(model, ids: list[int], start_pos: int, kv: torch.Tensor, table: torch.Tensor) -> int:
    logits = model.forward_cached(torch.tensor(ids, dtype=torch.long, device=model.device), start_pos, kv, table)
    return int(torch.argmax(logits[-1]))


def measure_prompt(model, system_tokens: int, num_questions: int, num_uncached: int, seed: int = 0) -> dict:
    """Every figure for one system-prompt length (see the module docstring)."""
    rng = np.random.default_rng(seed + system_tokens)
    system = rng.integers(0, 256, system_tokens).tolist()
    prefix = system + USER_HEADER
    bodies = [body + ASSISTANT_TAIL for body in make_questions(num_questions, seed + system_tokens)]
    longest = len(prefix) + max(len(b) for b in bodies) + 1
    runner, cache = timed_runner(model, len(prefix) + sum(len(b) + 2 * BLOCK_SIZE for b in bodies) + 2 * longest)
    runner.prefill(prefix)

    # The ideal's scratch pool: region 1 holds a copy of the prefix KV and takes each question's new tokens;
    # region 2 takes whole prompts for the no-cache prefill.
    blocks_per_prompt = -(-longest // BLOCK_SIZE)
    scratch = KVBlockPool(
        2 * blocks_per_prompt,
        BLOCK_SIZE,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=model.dtype,
        device=model.device,
    )
    match = cache.match(prefix, runner.namespace_key(None))
    assert match.num_tokens == len(prefix), "the warmed prefix must be cached whole"
    cached_table = torch.from_numpy(match.block_table.astype(np.int64)).to(model.device)
    scratch.kv[:, :, : len(cached_table)] = runner.pool.kv[:, :, cached_table]
    ideal_table = scratch.block_table_tensor(range(blocks_per_prompt))
    uncached_table = scratch.block_table_tensor(range(blocks_per_prompt, 2 * blocks_per_prompt))

    sample = (
        set(np.linspace(0, num_questions - 1, num_uncached).round().astype(int).tolist()) if num_uncached else set()
    )
    cache_ttft, ideal_ttft, uncached_ttft, shares = [], [], [], []
    parts: dict[str, list[float]] = {part: [] for part in PARTS}
    wall: list[float] = []
    greedy = SamplingParams(max_new_tokens=1)
    clock = time.perf_counter
    for i, body in enumerate(progress(bodies, f"runner: {system_tokens}-token system prompt", len(bodies))):
        prompt = prefix + body
        before = dict(cache.seconds)
        start = clock()
        steps = runner.stream(prompt, greedy)
        token = next(steps)
        first = clock()
        try:
            next(steps)
        except StopIteration as done:
            result = done.value
        end = clock()
        assert result.usage.cached_tokens == len(prefix), "each question reuses exactly the system prompt + header"
        cache_ttft.append(first - start)
        wall.append(end - start)
        for part in PARTS:
            parts[part].append(cache.seconds[part] - before[part])
        shares.append(sum(parts[part][-1] for part in PARTS) / wall[-1])

        start = clock()
        ideal_token = _greedy_first_token(model, body, len(prefix), scratch.kv, ideal_table)
        ideal_ttft.append(clock() - start)
        # Same tokens, same positions, bit-identical prefix KV: the two paths must pick the same token.
        assert ideal_token == token, f"question {i}: cache picked {token}, the ideal prefill {ideal_token}"

        if i in sample:
            start = clock()
            _greedy_first_token(model, prompt, 0, scratch.kv, uncached_table)
            uncached_ttft.append(clock() - start)

    median = statistics.median
    cache_ms = 1000 * median(cache_ttft)
    ideal_ms = 1000 * median(ideal_ttft)
    uncached_ms = 1000 * median(uncached_ttft) if uncached_ttft else None
    return {
        "system_tokens": system_tokens,
        "prefix_tokens": len(prefix),
        "questions": num_questions,
        "mean_new_tokens": statistics.fmean(len(b) for b in bodies),
        "uncached_samples": len(uncached_ttft),
        "ttft_ms_cache": cache_ms,
        "ttft_ms_ideal": ideal_ms,
        "ttft_ms_uncached": uncached_ms,
        "speedup": uncached_ms / cache_ms if uncached_ms else None,
        "ideal_speedup": uncached_ms / ideal_ms if uncached_ms else None,
        # Paired per question (measured back to back), so a slow spell of the machine hits both sides.
        "fraction_of_ideal": median(ideal / cached for ideal, cached in zip(ideal_ttft, cache_ttft, strict=True)),
        "overhead_share": median(shares),
        "overhead_us_per_request": {part: 1e6 * median(values) for part, values in parts.items()},
        "request_ms": 1000 * median(wall),
        "raw_s": {"cache": cache_ttft, "ideal": ideal_ttft, "uncached": uncached_ttft, "request": wall},
    }


def run(quick: bool = False) -> BenchResult:
    """The ``small`` model, 64 questions per prompt, no-cache on 4 of them (2 for 8,192 tokens); with ``quick`` the
    ``tiny`` model, system prompts of 256, 1,024 and 4,096 tokens, 8 questions, no-cache on 2."""
    setup = QUICK if quick else FULL
    model = build_model(setup["model"])
    load_before = os.getloadavg()[0]
    with torch_threads():
        results = [measure_prompt(model, n, setup["questions"], samples) for n, samples in setup["uncached"].items()]
    load_after = os.getloadavg()[0]

    rows = []
    for r in results:
        met_fraction = r["fraction_of_ideal"] >= GOAL_FRACTION_OF_IDEAL
        met_overhead = r["overhead_share"] < GOAL_OVERHEAD_SHARE
        rows.append(
            (
                r["system_tokens"],
                r["uncached_samples"],
                r["ttft_ms_uncached"],
                r["ttft_ms_cache"],
                r["ttft_ms_ideal"],
                r["speedup"],
                r["ideal_speedup"],
                100 * r["fraction_of_ideal"],
                verdict(met_fraction, quick),
                100 * r["overhead_share"],
                verdict(met_overhead, quick),
            )
        )
    threads = TORCH_THREADS
    main = Table(
        title=(
            f"runner: {setup['model']} model on {model.device}, {threads} torch thread(s); TTFT (median ms) of "
            f"{setup['questions']} questions behind a shared system prompt"
        ),
        headers=(
            "system tokens",
            "no-cache n",
            "no cache",
            "cache",
            "ideal",
            "speed-up",
            "ideal speed-up",
            "% of ideal",
            f"goal (>= {GOAL_FRACTION_OF_IDEAL:.0%})",
            "cache overhead %",
            f"goal (< {GOAL_OVERHEAD_SHARE:.0%})",
        ),
        rows=tuple(rows),
        notes=(
            "no cache: the full prompt prefilled from position 0, timed on only n evenly spaced questions (each "
            f"no-cache prefill has nearly the same shape); cache and ideal on all {setup['questions']} questions.",
            "cache: runner.stream until the first token (acquire, reserve, block table, forward, argmax); "
            "ideal: forward of only the uncached tokens on a pool already holding the prefix, plus argmax.",
            "% of ideal: median over questions of ideal / cache TTFT, each pair measured back to back.",
            "cache overhead: acquire + reserve + block_table_tensor + commit over the request's wall time (median).",
            "every question's first token is checked equal between the cache and the ideal prefill.",
            f"machine load (1-minute average) {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} "
            f"CPUs; torch held to {TORCH_THREADS} thread(s) while measuring (threads waiting on each other under "
            "load scatter every figure); other work on the machine still inflates the times.",
            *((QUICK_NOT_JUDGED,) if quick else ()),
        ),
    )
    breakdown = Table(
        title="runner: the cache layer's time per request (median us), by call",
        headers=("system tokens", "cached tokens", "new tokens (mean)", *PARTS, "total", "request (ms)"),
        rows=tuple(
            (
                r["system_tokens"],
                r["prefix_tokens"],
                r["mean_new_tokens"],
                *(r["overhead_us_per_request"][p] for p in PARTS),
                sum(r["overhead_us_per_request"].values()),
                r["request_ms"],
            )
            for r in results
        ),
        notes=(
            "acquire = match + lock + copy-on-write of the partly matched block; reserve = allocate; "
            "commit = insert + unlock.",
        ),
    )
    data = {
        "model": setup["model"],
        "device": str(model.device),
        "threads": threads,
        "load_average": [load_before, load_after],
        "cpus": os.cpu_count(),
        "block_size": BLOCK_SIZE,
        "goals": {"fraction_of_ideal": GOAL_FRACTION_OF_IDEAL, "overhead_share": GOAL_OVERHEAD_SHARE},
        "prompts": results,
    }
    return BenchResult("runner", (main, breakdown), data)
