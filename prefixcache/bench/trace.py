"""The ``trace`` benchmark: LRU token hit rate on the Mooncake production traces, by cache capacity, and the
request rate of the ``--no-model`` replay.

Each trace is read once, lazily (:func:`prefixcache.replay.scenarios.iter_mooncake`: hash id ``h`` becomes the 512 token
ids ``h*512 ..``), and every request goes through one cache per capacity in lockstep, so the ~145M tokens of the
conversation trace are expanded once and never held together.  Each cache is a metadata-only pool with our default
block size of 16 (the pool allows at most 256, so one 512-token hash block is 32 pool blocks), driven by the same
acquire / reserve / commit calls as ``prefixcache replay --no-model``.  A request longer than a cache cannot run in
it at all and counts as a miss of all its tokens there (column "too long").

Requests per second are of those cache calls alone; expanding the trace is timed apart, since a single
``prefixcache replay --format mooncake --no-model`` run pays both.
"""

from __future__ import annotations

import json
import os
import time
from array import array
from pathlib import Path

from prefixcache.bench.common import BenchResult, Table, progress
from prefixcache.bench.policy import DATA_DIR
from prefixcache.cache.host import make_host_pool
from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.errors import OutOfBlocksError
from prefixcache.replay.scenarios import MOONCAKE_BLOCK_TOKENS, iter_mooncake

TRACE_DIR = DATA_DIR / "mooncake"
assert array(TOKEN_TYPECODE).itemsize == array("i").itemsize, "trace ids are reinterpreted as stored token ids"
TRACES = ("conversation_trace.jsonl", "synthetic_trace.jsonl")
CAPACITIES: tuple[int | None, ...] = (
    10_000,
    100_000,
    1_000_000,
    2_000_000,
    4_000_000,
    5_000_000,
    8_000_000,
    10_000_000,
    50_000_000,
    None,
)
"""Cache sizes in tokens; ``None`` is unlimited (sized from the trace so that nothing is evicted)."""
BLOCK_SIZE = 16
GRANULARITY_FRACTIONS = (0.10, 0.25, 0.50)
HOST_TIER_FRACTIONS = (0.10, 0.25)
"""Device pools X of the host-tier table, as fractions of each trace's working set; each is run alone and with a
host tier of 4X."""
HOST_TIER_FACTOR = 4
QUICK_REQUESTS = 300


def _scan(path: Path, limit: int | None) -> tuple[int, int]:
    """``(requests, distinct hash ids)`` of the trace's first ``limit`` lines: a JSON-only pre-pass that sizes the
    unlimited cache and the progress bar."""
    distinct: set[int] = set()
    requests = 0
    with path.open("rb") as f:
        for line in f:
            if limit is not None and requests >= limit:
                break
            if line.strip():
                distinct.update(json.loads(line)["hash_ids"])
                requests += 1
    return requests, len(distinct)


def measure_trace(path: Path, *, limit: int | None, block_size: int = BLOCK_SIZE, show_progress: bool = True) -> dict:
    """Stream one trace through a cache per capacity; per capacity hit rate, requests per second and counts."""
    num_requests, distinct = _scan(path, limit)
    # Every distinct hash block once, plus the partial blocks at each request's seams.
    unlimited = distinct * -(-MOONCAKE_BLOCK_TOKENS // block_size) + 2 * num_requests + 1
    sizes = [-(-capacity // block_size) if capacity is not None else unlimited for capacity in CAPACITIES]
    caches = [RadixCache(KVBlockPool(num_blocks, block_size)) for num_blocks in sizes]
    hit = [0] * len(caches)
    served = [0] * len(caches)
    too_long = [0] * len(caches)
    seconds = [0.0] * len(caches)
    input_tokens = requests = 0
    expand_s = 0.0
    clock = time.perf_counter
    stream = progress(iter_mooncake(path, limit=limit), f"trace: {path.name}", num_requests, show_progress)
    mark = clock()
    for request in stream:
        # The same ids as array('I'), reinterpreted rather than converted token by token (they are >= 0).
        tokens = array(TOKEN_TYPECODE)
        tokens.frombytes(request.token_ids.tobytes())
        expand_s += clock() - mark
        n = len(tokens)
        input_tokens += n
        requests += 1
        for i, cache in enumerate(caches):
            if -(-n // block_size) > sizes[i]:
                too_long[i] += 1
                continue
            start = clock()
            lease = cache.acquire(tokens)
            try:
                cache.reserve(lease, n)
            except OutOfBlocksError:
                cache.release(lease)
                seconds[i] += clock() - start
                too_long[i] += 1
                continue
            cache.commit(lease, tokens)
            seconds[i] += clock() - start
            hit[i] += lease.num_cached_tokens
            served[i] += 1
        mark = clock()
    rows = []
    for i, capacity in enumerate(CAPACITIES):
        stats = caches[i].stats()
        rows.append(
            {
                "capacity_tokens": capacity,
                "pool_blocks": sizes[i],
                "hit_rate": hit[i] / input_tokens if input_tokens else 0.0,
                "hit_tokens": hit[i],
                "served": served[i],
                "too_long": too_long[i],
                "evictions": stats.evictions,
                "cache_s": seconds[i],
                "requests_per_s": served[i] / seconds[i] if seconds[i] else None,
            }
        )
    assert rows[-1]["evictions"] == 0, "the unlimited cache must never evict"
    working_set = caches[-1].stats().used_blocks
    return {
        "working_set_blocks": working_set,
        "granularity": measure_granularity(path, limit=limit, working_set_blocks=working_set, block_size=block_size),
        "host_tier": measure_host_tier(path, limit=limit, working_set_blocks=working_set, block_size=block_size),
        "unlimited_hit_rate": rows[-1]["hit_rate"],
        "requests": requests,
        "input_tokens": input_tokens,
        "expand_s": expand_s,
        "expand_requests_per_s": requests / expand_s if expand_s else None,
        "capacities": rows,
    }


def measure_granularity(
    path: Path, *, limit: int | None, working_set_blocks: int, block_size: int = BLOCK_SIZE
) -> list[dict]:
    """Stream the trace again through LRU caches of 10/25/50% of its working set (the blocks the unlimited cache
    holds at the end), block-granular and whole-leaf; per size and granularity the token hit rate and the blocks
    eviction freed."""
    sizes = [max(1, round(f * working_set_blocks)) for f in GRANULARITY_FRACTIONS]
    caches = {
        (i, g): RadixCache(KVBlockPool(size, block_size), eviction_granularity=g)
        for i, size in enumerate(sizes)
        for g in ("block", "leaf")
    }
    hit, _, input_tokens = _stream_lockstep(path, limit, caches, sizes, block_size)
    return [
        {
            "fraction": fraction,
            "capacity_tokens": sizes[i] * block_size,
            **{f"{g}_hit_rate": hit[i, g] / input_tokens if input_tokens else 0.0 for g in ("block", "leaf")},
            **{f"{g}_evicted_blocks": caches[i, g].stats().evicted_blocks for g in ("block", "leaf")},
        }
        for i, fraction in enumerate(GRANULARITY_FRACTIONS)
    ]


def measure_host_tier(
    path: Path, *, limit: int | None, working_set_blocks: int, block_size: int = BLOCK_SIZE
) -> list[dict]:
    """Stream the trace through LRU device pools X of 10/25% of its working set, alone and with a host-memory tier of
    ``HOST_TIER_FACTOR`` X (:mod:`prefixcache.cache.host`, metadata only: demotion and promotion move block ids);
    per X the token hit rate alone, and with the tier split into device and host hits."""
    sizes = [max(1, round(f * working_set_blocks)) for f in HOST_TIER_FRACTIONS]
    caches: dict[tuple[int, bool], RadixCache] = {}
    for i, size in enumerate(sizes):
        caches[i, False] = RadixCache(KVBlockPool(size, block_size))
        pool = KVBlockPool(size, block_size)
        caches[i, True] = RadixCache(pool, host_pool=make_host_pool(pool, size * HOST_TIER_FACTOR))
    hit, seconds, input_tokens = _stream_lockstep(path, limit, caches, sizes, block_size)
    rows = []
    for i, fraction in enumerate(HOST_TIER_FRACTIONS):
        tiered = caches[i, True].stats()
        rows.append(
            {
                "fraction": fraction,
                "device_tokens": sizes[i] * block_size,
                "host_tokens": sizes[i] * block_size * HOST_TIER_FACTOR,
                "device_only_hit_rate": hit[i, False] / input_tokens if input_tokens else 0.0,
                "tiered_hit_rate": hit[i, True] / input_tokens if input_tokens else 0.0,
                "tiered_host_hit_rate": tiered.host_hit_tokens / input_tokens if input_tokens else 0.0,
                "demoted_blocks": tiered.demoted_blocks,
                "promoted_blocks": tiered.promoted_blocks,
                "host_dropped_blocks": tiered.host_dropped_blocks,
                "device_only_s": seconds[i, False],
                "tiered_s": seconds[i, True],
            }
        )
    return rows


def _capacity_label(capacity: int | None) -> str:
    if capacity is None:
        return "unlimited"
    mantissa, exponent = f"{capacity:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def run(quick: bool = False) -> BenchResult:
    """Both traces at every capacity (the first 300 requests of each with ``quick``)."""
    limit = QUICK_REQUESTS if quick else None
    results: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    missing = [name for name in TRACES if not (TRACE_DIR / name).is_file()]
    for name in TRACES:
        if name in missing:
            continue
        start = time.perf_counter()
        results[name] = measure_trace(TRACE_DIR / name, limit=limit, show_progress=not quick)
        seconds[name] = time.perf_counter() - start

    headers = ["capacity (tokens)"]
    for name in results:
        short = name.split("_")[0]
        headers += [f"{short} hit %", f"{short} req/s", f"{short} too long"]
    rows = []
    for i, capacity in enumerate(CAPACITIES):
        row: list = [_capacity_label(capacity)]
        for r in results.values():
            c = r["capacities"][i]
            row += [100.0 * c["hit_rate"], c["requests_per_s"], c["too_long"]]
        rows.append(tuple(row))
    notes = [
        f"LRU, block size {BLOCK_SIZE} (one 512-token hash block = {MOONCAKE_BLOCK_TOKENS // BLOCK_SIZE} pool blocks), "
        "token hit rate of all input tokens; req/s = requests served / time in acquire + reserve + commit."
        + (f" First {QUICK_REQUESTS} requests of each trace (--quick)." if quick else ""),
    ]
    for name, r in results.items():
        notes.append(
            f"{name}: {r['requests']:,} requests, {r['input_tokens']:,} input tokens; expanding it "
            f"(iter_mooncake) took {r['expand_s']:.1f} s ({r['expand_requests_per_s']:,.0f} req/s); "
            f"whole benchmark of this trace {seconds[name]:.1f} s."
        )
    notes.append(f"machine load (1-minute average) {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} CPUs.")
    for name in missing:
        notes.append(f"skipped {name}: not found in {TRACE_DIR}")
    table = Table(
        title="trace: Mooncake traces through the --no-model replay, LRU, by cache capacity",
        headers=tuple(headers),
        rows=tuple(rows),
        notes=tuple(notes),
    )
    granularity = Table(
        title="trace: block-granular vs whole-leaf eviction (LRU), caches of 10/25/50% of each trace's working set",
        headers=("trace", "cache", "tokens", "block %", "whole-leaf %", "gain (pts)", "blocks evicted", "leaf evicted"),
        rows=tuple(
            (
                name.split("_")[0],
                f"{g['fraction']:.0%}",
                g["capacity_tokens"],
                100.0 * g["block_hit_rate"],
                100.0 * g["leaf_hit_rate"],
                100.0 * (g["block_hit_rate"] - g["leaf_hit_rate"]),
                g["block_evicted_blocks"],
                g["leaf_evicted_blocks"],
            )
            for name, r in results.items()
            for g in r["granularity"]
        ),
        notes=(
            "Working set: blocks the unlimited cache holds after the whole trace.  Token hit rate of all input "
            "tokens; blocks evicted: total blocks freed by eviction over the trace.",
        ),
    )
    host_tier = Table(
        title=f"trace: host-memory tier, device pool X alone vs X plus a {HOST_TIER_FACTOR}X host tier (LRU)",
        headers=(
            "trace",
            "X",
            "X tokens",
            "X alone %",
            f"X+{HOST_TIER_FACTOR}X %",
            "of which host %",
            "unlimited %",
            "promoted blocks",
            "dropped on host",
            "time ratio",
        ),
        rows=tuple(
            (
                name.split("_")[0],
                f"{h['fraction']:.0%}",
                h["device_tokens"],
                100.0 * h["device_only_hit_rate"],
                100.0 * h["tiered_hit_rate"],
                100.0 * h["tiered_host_hit_rate"],
                100.0 * r["unlimited_hit_rate"],
                h["promoted_blocks"],
                h["host_dropped_blocks"],
                h["tiered_s"] / h["device_only_s"] if h["device_only_s"] else None,
            )
            for name, r in results.items()
            for h in r["host_tier"]
        ),
        notes=(
            "X: fraction of the trace's working set (blocks the unlimited cache holds at the end).  Token hit rate "
            "of all input tokens; 'of which host' were promoted from host memory.  Time ratio: seconds in acquire + "
            "commit with the tier over without it (the --no-model cost of demotion and promotion).",
        ),
    )
    data = {
        "block_size": BLOCK_SIZE,
        "limit_requests": limit,
        "trace_dir": str(TRACE_DIR),
        "skipped": missing,
        "seconds": seconds,
        "traces": results,
    }
    return BenchResult("trace", (table, granularity, host_tier), data)


def _stream_lockstep(
    path: Path, limit: int | None, caches: dict[tuple, RadixCache], sizes: list[int], block_size: int
) -> tuple[dict[tuple, int], dict[tuple, float], int]:
    """Stream the trace once through every cache in lockstep (each request admitted and committed whole; one that
    cannot fit a cache of ``sizes[key[0]]`` blocks is skipped there).  Returns per cache its hit tokens and the
    seconds (``time.perf_counter``) spent in it, and the trace's input tokens."""
    hit = dict.fromkeys(caches, 0)
    seconds = dict.fromkeys(caches, 0.0)
    input_tokens = 0
    clock = time.perf_counter
    for request in iter_mooncake(path, limit=limit):
        tokens = array(TOKEN_TYPECODE)
        tokens.frombytes(request.token_ids.tobytes())
        n = len(tokens)
        input_tokens += n
        for key, cache in caches.items():
            if -(-n // block_size) > sizes[key[0]]:
                continue
            start = clock()
            try:
                lease = cache.acquire(tokens, num_tokens=n)
            except OutOfBlocksError:
                continue
            cache.commit(lease, tokens)
            seconds[key] += clock() - start
            hit[key] += lease.num_cached_tokens
    return hit, seconds, input_tokens
