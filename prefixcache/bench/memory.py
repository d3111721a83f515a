"""The ``memory`` benchmark: bytes of bookkeeping per cached token, and bytes of KV per token in a real pool.

The pool's KV bytes per token are measured as the growth of the process's resident memory (``/proc/self/statm``)
while a pool of at least 64 MiB is created and every block written (a CPU pool's pages are committed as blocks are
written, not at creation: what creating it alone adds is reported too), and set beside the size torch reports for the
tensor's storage and the formula ``2 * layers * kv_heads * head_dim * element_size``.

Tree metadata is what ``tracemalloc`` sees allocated while the standard workload is inserted (token arrays,
block-id arrays, nodes, child dicts, eviction keys), divided by the tokens the tree then caches.  The pool's
own per-block bookkeeping (reference counts, free stack, ownership flags) is allocated once with the pool and
is reported apart, per token of pool capacity.
"""

from __future__ import annotations

import os
import tracemalloc

import torch

from prefixcache.bench.common import QUICK_NOT_JUDGED, BenchResult, Table, progress, standard_workload, verdict
from prefixcache.cache.pool import KVBlockPool, kv_bytes_per_token
from prefixcache.cache.radix_cache import RadixCache

BLOCK_SIZES = (16, 1)
GOAL_BYTES_PER_TOKEN = 16

# (name, num_layers, num_kv_heads, head_dim, dtype): the shapes of real models' KV caches.
POOL_SHAPES = (
    ("Llama-3.1-8B", 32, 8, 128, torch.bfloat16),
    ("Qwen2.5-0.5B", 24, 2, 64, torch.bfloat16),
    ("prefixcache small preset", 8, 2, 64, torch.float32),
)
POOL_MEASURE_BYTES = 64 * 2**20
"""Each measured pool is at least this big: far above glibc's largest mmap threshold (32 MiB), so it is mapped
fresh rather than carved from freed heap, and far above the noise of other allocations."""
POOL_BLOCK_SIZE = 16
RSS_TOLERANCE = 0.05


def tree_metadata(block_size: int, num_seqs: int, *, show_progress: bool = True) -> dict[str, float | int]:
    """Insert the standard workload under tracemalloc; bytes per cached token of tree and pool bookkeeping."""
    workload = standard_workload(num_seqs=num_seqs)
    seq_blocks = -(-workload.seq_len // block_size)
    prefix_blocks = workload.prefix_len // block_size
    # The whole tree plus one in-flight sequence: nothing is evicted.
    num_blocks = prefix_blocks + num_seqs * (seq_blocks - prefix_blocks) + seq_blocks
    tracemalloc.start()
    try:
        before_pool, _ = tracemalloc.get_traced_memory()
        pool = KVBlockPool(num_blocks, block_size, device="cpu")
        cache = RadixCache(pool)
        before_tree, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for tokens in progress(workload.token_arrays, f"memory bs={block_size}", num_seqs, show_progress):
            cache.insert(tokens, cache.allocate(seq_blocks))
        after_tree, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    stats = cache.stats()
    return {
        "cached_tokens": stats.cached_tokens,
        "num_nodes": stats.num_nodes,
        "tree_bytes": after_tree - before_tree,
        "tree_bytes_per_token": (after_tree - before_tree) / stats.cached_tokens,
        "tree_peak_bytes": peak - before_tree,
        "pool_bookkeeping_bytes": before_tree - before_pool,
        "pool_bookkeeping_bytes_per_token": (before_tree - before_pool) / pool.capacity_tokens,
    }


def resident_bytes() -> int | None:
    """This process's resident set size in bytes, from ``/proc/self/statm`` (Linux); None where it is absent."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def pool_bytes(name: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict:
    """KV bytes per token of a CPU pool of a real model's shape: resident memory growth while the pool is created and
    every block written (``None`` off Linux), the growth at creation alone, torch's storage size, and the formula."""
    formula = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
    num_blocks = -(-POOL_MEASURE_BYTES // (formula * POOL_BLOCK_SIZE))
    before = resident_bytes()
    pool = KVBlockPool(
        num_blocks,
        POOL_BLOCK_SIZE,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
    )
    created = resident_bytes()
    pool.kv.fill_(1.0)  # every block written, as a full cache holds them
    after = resident_bytes()
    rss = None if before is None or after is None else (after - before) / pool.capacity_tokens
    at_creation = None if before is None or created is None else (created - before) / pool.capacity_tokens
    return {
        "model": name,
        "shape": list(pool.kv.shape),
        "dtype": str(dtype).removeprefix("torch."),
        "pool_bytes": pool.kv.untyped_storage().nbytes(),
        "rss_bytes_per_token": rss,
        "rss_at_creation_bytes_per_token": at_creation,
        "storage_bytes_per_token": pool.kv.untyped_storage().nbytes() / pool.capacity_tokens,
        "formula_bytes_per_token": formula,
        "property_bytes_per_token": pool.bytes_per_token,
    }


def run(quick: bool = False) -> BenchResult:
    """Tree metadata for block sizes 16 and 1 (200 sequences with ``quick``), and the KV of three pool shapes."""
    num_seqs = 200 if quick else 2000
    trees = {f"bs{bs}": tree_metadata(bs, num_seqs, show_progress=not quick) for bs in BLOCK_SIZES}
    tree_rows = []
    for bs in BLOCK_SIZES:
        t = trees[f"bs{bs}"]
        per_token = t["tree_bytes_per_token"]
        tree_rows.append(
            (
                bs,
                t["cached_tokens"],
                t["num_nodes"],
                t["tree_bytes"] / 2**20,
                per_token,
                verdict(per_token <= GOAL_BYTES_PER_TOKEN, quick),
                t["pool_bookkeeping_bytes_per_token"],
            )
        )
    tree_table = Table(
        title=f"memory: tree metadata on the standard workload ({num_seqs:,} sequences), tracemalloc",
        headers=(
            "block size",
            "cached tokens",
            "nodes",
            "tree MiB",
            "tree B/token",
            f"goal (<= {GOAL_BYTES_PER_TOKEN})",
            "pool bookkeeping B/token",
        ),
        rows=tuple(tree_rows),
        notes=(
            "pool bookkeeping: reference counts, free stack and ownership flags, per token of pool capacity.",
            *((QUICK_NOT_JUDGED,) if quick else ()),
        ),
    )
    pools = [pool_bytes(*shape) for shape in POOL_SHAPES]

    def within(p: dict) -> str:
        rss = p["rss_bytes_per_token"]
        if rss is None:
            return "n/a"
        return (
            "yes" if abs(rss - p["formula_bytes_per_token"]) <= RSS_TOLERANCE * p["formula_bytes_per_token"] else "NO"
        )

    pool_table = Table(
        title=f"memory: KV pool bytes per token (pools of >= {POOL_MEASURE_BYTES // 2**20} MiB on the CPU)",
        headers=(
            "model shape",
            "kv shape",
            "dtype",
            "RSS growth B/token",
            "storage B/token",
            "2*L*H*D*elem",
            f"RSS within {RSS_TOLERANCE:.0%}",
        ),
        rows=tuple(
            (
                p["model"],
                "x".join(map(str, p["shape"])),
                p["dtype"],
                p["rss_bytes_per_token"],
                p["storage_bytes_per_token"],
                p["formula_bytes_per_token"],
                within(p),
            )
            for p in pools
        ),
        notes=(
            "RSS growth: the process's resident memory before creating the pool and after writing every block "
            "(/proc/self/statm), per token of capacity; storage: the size torch reports for the tensor's storage.",
        ),
    )
    data = {"num_seqs": num_seqs, "goal_bytes_per_token": GOAL_BYTES_PER_TOKEN, "trees": trees, "pools": pools}
    return BenchResult("memory", (tree_table, pool_table), data)
