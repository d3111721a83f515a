"""The ``policy`` benchmark: how close LRU (and LFU) come to the infinite cache and to Belady's offline optimum.

Workloads are the shared chat transcripts (``../shared/data`` beside the project), rendered with the byte-level
:class:`~prefixcache.chat.tokenizer.ByteTokenizer` and interleaved round-robin, one request per assistant turn
(:func:`prefixcache.replay.load_requests`).  The *working set* of a file is what an unbounded cache holds at the
end: the blocks our radix tree uses when nothing is evicted.  Each file is replayed with caches of 10%, 25%, 50%
and 100% of it, in two ways:

- through our :class:`~prefixcache.RadixCache`, as ``prefixcache replay --no-model`` does (acquire, reserve,
  commit on a metadata-only pool), with LRU and with LFU; hits are token-exact;
- through the block-level model of :mod:`prefixcache.replay.belady` with LRU and with Belady's policy, the same number
  of blocks; hits are whole blocks only, so this is the apples-to-apples comparison with the optimum.

Belady's is the practical upper bound for online policies on the block model (see ``prefixcache/belady.py``);
the gap column says how far LRU is from it.

A second table puts block-granular eviction (our default: blocks cut off the tail of the least recently used leaf)
next to whole-leaf eviction (SGLang's) at 10, 25 and 50%, LRU, through the same replay.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefixcache.bench.common import BenchResult, Table, progress
from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.errors import OutOfBlocksError
from prefixcache.replay.belady import BlockTrace, build_block_trace, simulate
from prefixcache.replay.replayer import ReplayRequest, load_requests

DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"
"""``../shared/data`` relative to the repository root."""
DATASETS = ("tau_bench_airline_gpt4o.jsonl", "mtbench_31models.jsonl", "oasst_en100_tree_paths.jsonl")
FRACTIONS = (0.10, 0.25, 0.50, 1.00)
BLOCK_SIZE = 16
QUICK_CONVERSATIONS = 20


GRANULARITY_FRACTIONS = (0.10, 0.25, 0.50)


def replay_radix(
    requests: list[ReplayRequest], num_blocks: int, policy: str, block_size: int, granularity: str = "block"
) -> dict[str, int]:
    """Replay ``requests`` through a fresh RadixCache of ``num_blocks`` metadata-only blocks, as the ``--no-model``
    replay does; returns token counts, evictions and the blocks in use at the end.

    A request that cannot run at all, longer than the pool or than what is left beside its own locked prefix
    (partial blocks at node seams take a block each), counts as a miss of every prompt token (``too_long``), where
    ``prefixcache replay`` would stop with an error.
    """
    cache = RadixCache(KVBlockPool(num_blocks, block_size), policy, eviction_granularity=granularity)
    hit = prompt = too_long = 0
    for request in requests:
        prompt += len(request.prompt)
        total = len(request.prompt) + len(request.answer)
        if cache.pool.blocks_for_tokens(total) > num_blocks:
            too_long += 1
            continue
        lease = cache.acquire(request.prompt)
        try:
            cache.reserve(lease, total)
        except OutOfBlocksError:
            cache.release(lease)
            too_long += 1
            continue
        cache.commit(lease, request.prompt + request.answer)
        hit += lease.num_cached_tokens
    stats = cache.stats()
    return {
        "hit_tokens": hit,
        "prompt_tokens": prompt,
        "too_long": too_long,
        "evictions": stats.evictions,
        "evicted_blocks": stats.evicted_blocks,
        "used_blocks": stats.used_blocks,
    }


def measure_file(path: Path, *, limit: int | None, block_size: int = BLOCK_SIZE) -> dict:
    """Every figure of one transcript file: working set, and per fraction the four policies' hit rates."""
    requests, _ = load_requests(path, ByteTokenizer(), limit=limit)
    # Enough blocks that nothing is evicted: every request's tokens, plus the partial blocks at its seams.
    unbounded_blocks = sum(-(-(len(r.prompt) + len(r.answer)) // block_size) + 2 for r in requests)
    infinite = replay_radix(requests, unbounded_blocks, "lru", block_size)
    assert infinite["evictions"] == 0, "the unbounded pool must never evict"
    # Every policy is simulated at the unbounded size too, not assumed equal to LRU there.
    infinite_lfu = replay_radix(requests, unbounded_blocks, "lfu", block_size)
    working_set = infinite["used_blocks"]
    trace: BlockTrace = build_block_trace(((r.prompt, r.answer) for r in requests), block_size)
    rows = []
    for fraction in FRACTIONS:
        capacity = max(1, round(fraction * working_set))
        radix = {policy: replay_radix(requests, capacity, policy, block_size) for policy in ("lru", "lfu")}
        sim = {policy: simulate(trace, capacity, policy) for policy in ("lru", "belady")}
        assert sim["belady"].hit_blocks >= sim["lru"].hit_blocks, "Belady's optimum must not lose to LRU"
        rows.append(
            {
                "fraction": fraction,
                "capacity_blocks": capacity,
                "capacity_tokens": capacity * block_size,
                "radix_lru": radix["lru"]["hit_tokens"] / radix["lru"]["prompt_tokens"],
                "radix_lfu": radix["lfu"]["hit_tokens"] / radix["lfu"]["prompt_tokens"],
                "radix_too_long": radix["lru"]["too_long"],
                "sim_lru": sim["lru"].hit_rate,
                "sim_belady": sim["belady"].hit_rate,
                "sim_lru_evictions": sim["lru"].evictions,
                "sim_belady_evictions": sim["belady"].evictions,
            }
        )
    granularity = []
    for fraction in GRANULARITY_FRACTIONS:
        capacity = max(1, round(fraction * working_set))
        by = {g: replay_radix(requests, capacity, "lru", block_size, g) for g in ("block", "leaf")}
        granularity.append(
            {
                "fraction": fraction,
                "capacity_tokens": capacity * block_size,
                **{f"{g}_hit_rate": by[g]["hit_tokens"] / by[g]["prompt_tokens"] for g in by},
                **{f"{g}_evicted_blocks": by[g]["evicted_blocks"] for g in by},
            }
        )
    return {
        "requests": len(requests),
        "prompt_tokens": infinite["prompt_tokens"],
        "granularity": granularity,
        "working_set_blocks": working_set,
        "working_set_tokens": working_set * block_size,
        "sim_distinct_blocks": trace.num_blocks,
        "infinite_radix": infinite["hit_tokens"] / infinite["prompt_tokens"],
        "infinite_radix_lfu": infinite_lfu["hit_tokens"] / infinite_lfu["prompt_tokens"],
        "infinite_sim": simulate(trace, max(trace.num_blocks, 1), "lru").hit_rate,
        "infinite_sim_belady": simulate(trace, max(trace.num_blocks, 1), "belady").hit_rate,
        "capacities": rows,
    }


def _pct(value: float) -> float:
    return 100.0 * value


def run(quick: bool = False) -> BenchResult:
    """Hit rates at 10/25/50/100% of each file's working set (the first 20 conversations of each with ``quick``)."""
    limit = QUICK_CONVERSATIONS if quick else None
    results: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    missing = [name for name in DATASETS if not (DATA_DIR / name).is_file()]
    present = [name for name in DATASETS if name not in missing]
    for name in progress(present, "policy: files", len(present), not quick):
        start = time.perf_counter()
        results[name] = measure_file(DATA_DIR / name, limit=limit)
        seconds[name] = time.perf_counter() - start

    rows = []
    for name, r in results.items():
        label = name.removesuffix(".jsonl")
        for c in r["capacities"]:
            rows.append(
                (
                    label,
                    f"{c['fraction']:.0%}",
                    c["capacity_tokens"],
                    _pct(c["radix_lru"]),
                    _pct(c["radix_lfu"]),
                    _pct(c["sim_lru"]),
                    _pct(c["sim_belady"]),
                    _pct(c["sim_belady"] - c["sim_lru"]),
                    _pct(c["sim_lru"] / c["sim_belady"]) if c["sim_belady"] else None,
                )
            )
        rows.append(
            (
                label,
                "infinite",
                None,
                _pct(r["infinite_radix"]),
                _pct(r["infinite_radix_lfu"]),
                _pct(r["infinite_sim"]),
                _pct(r["infinite_sim_belady"]),
                _pct(r["infinite_sim_belady"] - r["infinite_sim"]),
                _pct(r["infinite_sim"] / r["infinite_sim_belady"]) if r["infinite_sim_belady"] else None,
            )
        )
    notes = [
        f"Token hit rate (%) of all prompt tokens; block size {BLOCK_SIZE}; ByteTokenizer; round-robin order"
        + (f"; first {QUICK_CONVERSATIONS} conversations per file (--quick)." if quick else "."),
        "Cache sizes are fractions of the working set: blocks our radix tree holds at the end with no eviction.",
        "radix: our RadixCache via the --no-model replay path (token-exact hits, partial blocks included).",
        "block sim: prefixcache.replay.belady, same number of blocks, whole-block hits only; "
        "Belady = offline optimum there.",
    ]
    for name, r in results.items():
        too_long = sum(c["radix_too_long"] for c in r["capacities"])
        notes.append(
            f"{name}: {r['requests']:,} requests, {r['prompt_tokens']:,} prompt tokens, working set "
            f"{r['working_set_tokens']:,} tokens ({r['working_set_blocks']:,} radix blocks, "
            f"{r['sim_distinct_blocks']:,} distinct full blocks); {seconds[name]:.1f} s"
            + (f"; {too_long} request(s) longer than a small cache counted as misses" if too_long else "")
        )
    for name in missing:
        notes.append(f"skipped {name}: not found in {DATA_DIR}")
    table = Table(
        title="policy: LRU/LFU (our radix tree) and LRU/Belady (block model) on the shared transcripts",
        headers=(
            "file",
            "cache",
            "tokens",
            "radix LRU %",
            "radix LFU %",
            "block LRU %",
            "Belady %",
            "LRU gap (pts)",
            "LRU/Belady %",
        ),
        rows=tuple(rows),
        notes=tuple(notes),
    )
    granularity = Table(
        title="policy: block-granular vs whole-leaf eviction (LRU, our radix tree)",
        headers=("file", "cache", "tokens", "block %", "whole-leaf %", "gain (pts)", "blocks evicted", "leaf evicted"),
        rows=tuple(
            (
                name.removesuffix(".jsonl"),
                f"{g['fraction']:.0%}",
                g["capacity_tokens"],
                _pct(g["block_hit_rate"]),
                _pct(g["leaf_hit_rate"]),
                _pct(g["block_hit_rate"] - g["leaf_hit_rate"]),
                g["block_evicted_blocks"],
                g["leaf_evicted_blocks"],
            )
            for name, r in results.items()
            for g in r["granularity"]
        ),
        notes=(
            "Token hit rate (%) of all prompt tokens, same replay and cache sizes as above; blocks evicted: total "
            "blocks freed by eviction over the replay (whole-leaf eviction frees more than it needs).",
        ),
    )
    data = {
        "block_size": BLOCK_SIZE,
        "limit_conversations": limit,
        "data_dir": str(DATA_DIR),
        "skipped": missing,
        "seconds": seconds,
        "files": results,
    }
    return BenchResult("policy", (table, granularity), data)
