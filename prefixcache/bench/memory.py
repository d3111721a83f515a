"""The ``memory`` benchmark: bytes of bookkeeping per cached token, and bytes of KV per token in a real pool.

Tree metadata is what ``tracemalloc`` sees allocated while the standard workload is inserted (token arrays,
block-id arrays, nodes, child dicts, eviction keys), divided by the tokens the tree then caches.  The pool's
own per-block bookkeeping (reference counts, free stack, ownership flags) is allocated once with the pool and
is reported apart, per token of pool capacity.
"""

from __future__ import annotations

import tracemalloc

import torch

from prefixcache.bench.common import BenchResult, Table, progress, standard_workload
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
POOL_BLOCKS = 8
POOL_BLOCK_SIZE = 16


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


def pool_bytes(name: str, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Measured KV bytes per token of a small CPU pool of a real model's shape, against the formula."""
    pool = KVBlockPool(
        POOL_BLOCKS,
        POOL_BLOCK_SIZE,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device="cpu",
    )
    measured = pool.kv.untyped_storage().nbytes() / pool.capacity_tokens
    formula = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
    return {
        "model": name,
        "shape": list(pool.kv.shape),
        "dtype": str(dtype).removeprefix("torch."),
        "measured_bytes_per_token": measured,
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
                "met" if per_token <= GOAL_BYTES_PER_TOKEN else "not met",
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
        notes=("pool bookkeeping: reference counts, free stack and ownership flags, per token of pool capacity.",),
    )
    pools = [pool_bytes(*shape) for shape in POOL_SHAPES]
    pool_table = Table(
        title=f"memory: KV pool bytes per token ({POOL_BLOCKS} blocks of {POOL_BLOCK_SIZE} tokens on the CPU)",
        headers=("model shape", "kv shape", "dtype", "measured B/token", "2*L*H*D*elem", "match"),
        rows=tuple(
            (
                p["model"],
                "x".join(map(str, p["shape"])),
                p["dtype"],
                p["measured_bytes_per_token"],
                p["formula_bytes_per_token"],
                "yes" if p["measured_bytes_per_token"] == p["formula_bytes_per_token"] else "NO",
            )
            for p in pools
        ),
    )
    data = {"num_seqs": num_seqs, "goal_bytes_per_token": GOAL_BYTES_PER_TOKEN, "trees": trees, "pools": pools}
    return BenchResult("memory", (tree_table, pool_table), data)
