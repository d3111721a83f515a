"""The ``snapshot`` benchmark: how long a snapshot save makes a stream wait, with a cache of a million tokens.

The tiny model's cache is filled to ``num_tokens`` (random prompts inserted with random K/V: what a save costs does not
depend on how the K/V were computed), one request streams through a started
:class:`~prefixcache.engine.batching.BatchEngine`, and the cache is saved twice each way, interleaved:

- ``engine thread``: the whole save as one :meth:`~prefixcache.engine.batching.BatchEngine.call_soon` function (how
  the server saved before: copy, encode, write and fsync between two steps);
- ``writer thread``: :meth:`~prefixcache.engine.batching.BatchEngine.save_snapshot` (the copy between two steps, the
  files on a writer thread).

Per save: the longest gap between two streamed tokens from the call to the save's end, the engine thread's time in
the save (the whole call, or the copy), and the tokens streamed meanwhile; the baseline gap is measured first, with no
save.  Wall-clock times of one process (another load on the machine shows in them).
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.bench.common import BenchResult, Table
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.models.llama import build_model

NUM_TOKENS = 1 << 20
QUICK_TOKENS = 1 << 14
PROMPT_TOKENS = 4096
BASELINE_S = 1.0
STREAM_PROMPT = list(range(1, 40))
STREAM_TOKENS = 2000
WAYS = ("engine thread", "writer thread")


def filled_runner(num_tokens: int, seed: int = 0) -> PrefixCachingRunner:
    """A tiny-model runner whose cache holds ``num_tokens`` tokens of random prompts with random K/V (512 bytes a
    token), and room for a streaming request."""
    runner = PrefixCachingRunner(build_model("tiny", device="cpu"), cache_tokens=num_tokens + 3 * STREAM_TOKENS)
    cache, namespace = runner.cache, runner.namespace_key(None)
    rng = np.random.default_rng(seed)
    for first in range(0, num_tokens, PROMPT_TOKENS):
        size = min(PROMPT_TOKENS, num_tokens - first)
        cache.insert(rng.integers(1, 500, size).tolist(), cache.allocate(cache.pool.blocks_for_tokens(size)), namespace)
    cache.pool.kv.normal_()
    return runner


def longest_gap_s(stamps: list[float], start: float, end: float) -> float:
    """The longest time between two stamps in ``[start, end]``, or from ``start`` to the first one / from the last
    one to ``end`` (a stall that begins with the window counts whole)."""
    inside = [start, *(t for t in stamps if start <= t <= end), end]
    return float(np.diff(inside).max())


def save_once(engine: BatchEngine, way: str, folder: Path, stamps: list[float]) -> dict[str, Any]:
    """One save ``way`` into ``folder`` while ``stamps`` fills with streamed tokens' times."""
    runner = engine.runner
    engine_s: list[float] = []

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                engine_s.append(time.perf_counter() - start)

        return call

    start = time.perf_counter()
    if way == "engine thread":
        summary = engine.call_soon(timed(lambda: runner.save_snapshot(folder))).result()
    else:
        runner.capture_snapshot = timed(runner.capture_snapshot)  # what the saver calls on the engine thread
        try:
            summary = engine.save_snapshot(folder).result()
        finally:
            del runner.capture_snapshot
    end = time.perf_counter()
    return {
        "way": way,
        "num_tokens": summary.num_tokens,
        "num_blocks": summary.num_blocks,
        "kv_bytes": summary.kv_bytes,
        "save_s": end - start,
        "engine_thread_s": sum(engine_s),
        "longest_gap_s": longest_gap_s(stamps, start, end),
        "tokens_during_save": sum(start <= t <= end for t in stamps),
    }


def measure(num_tokens: int, repeats: int = 2) -> dict[str, Any]:
    """Saves of a ``num_tokens`` cache each way, ``repeats`` times interleaved, beside a streaming request (one
    greedy prompt again and again: after the first, its tokens are cached and nothing new is inserted)."""
    engine = BatchEngine(filled_runner(num_tokens))
    engine.start()
    stamps: list[float] = []
    done = threading.Event()

    def on_token(_: int) -> bool:
        stamps.append(time.perf_counter())
        return done.is_set()

    def stream() -> None:
        while not done.is_set():
            engine.submit(STREAM_PROMPT, SamplingParams(max_new_tokens=STREAM_TOKENS), on_token=on_token).result()

    streamer = threading.Thread(target=stream, name="prefixcache-bench-stream")
    streamer.start()
    saves = []
    try:
        while len(stamps) < 20:
            time.sleep(0.05)
        start = time.perf_counter()
        time.sleep(BASELINE_S)
        baseline_gap_s = longest_gap_s(stamps, start, time.perf_counter())
        with tempfile.TemporaryDirectory(prefix="prefixcache-bench-snapshot-") as folder:
            for _ in range(repeats):
                for way in WAYS:
                    saves.append(save_once(engine, way, Path(folder) / way.replace(" ", "-"), stamps))
    finally:
        done.set()
        streamer.join()
        engine.close()
    return {"num_tokens": num_tokens, "baseline_gap_s": baseline_gap_s, "saves": saves}


def run(quick: bool = False) -> BenchResult:
    """Saves of a 1M-token cache (16k with ``quick``) on the engine thread and on the writer thread."""
    data = measure(QUICK_TOKENS if quick else NUM_TOKENS, repeats=1 if quick else 2)
    rows = tuple(
        (
            save["way"],
            save["num_tokens"],
            save["kv_bytes"] / 2**20,
            save["save_s"],
            1e3 * save["engine_thread_s"],
            1e3 * save["longest_gap_s"],
            1e3 * data["baseline_gap_s"],
            save["tokens_during_save"],
        )
        for save in data["saves"]
    )
    table = Table(
        title=f"snapshot: a save beside a streaming request, {data['num_tokens']:,}-token cache (tiny model)",
        headers=(
            "save on",
            "cached tokens",
            "K/V MiB",
            "save s",
            "engine thread ms",
            "longest token gap ms",
            "gap without a save ms",
            "tokens streamed meanwhile",
        ),
        rows=rows,
    )
    return BenchResult("snapshot", (table,), data)
