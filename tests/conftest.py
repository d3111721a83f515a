"""Fixtures shared by the core cache tests: a cache factory and a helper that caches one sequence."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from prefixcache.pool import KVBlockPool
from prefixcache.radix import InsertResult, RadixCache


@pytest.fixture
def make_cache() -> Callable[..., RadixCache]:
    """``make_cache(num_blocks=16, block_size=4, policy="lru", num_layers=0)``: a fresh cache on the CPU.

    With ``num_layers > 0`` the pool holds a real float32 KV tensor of 2 KV heads of dimension 3.
    """

    def make(num_blocks: int = 16, block_size: int = 4, *, policy: object = "lru", num_layers: int = 0) -> RadixCache:
        heads_and_dim = {"num_kv_heads": 2, "head_dim": 3} if num_layers else {}
        pool = KVBlockPool(
            num_blocks, block_size, num_layers=num_layers, dtype=torch.float32, device="cpu", **heads_and_dim
        )
        return RadixCache(pool, policy=policy)

    return make


@pytest.fixture
def put() -> Callable[..., InsertResult]:
    """``put(cache, tokens, namespace=None)``: allocate fresh blocks for ``tokens`` and insert them."""

    def insert(cache: RadixCache, tokens: Sequence[int], namespace: str | None = None) -> InsertResult:
        blocks = cache.allocate(cache.pool.blocks_for_tokens(len(tokens)))
        return cache.insert(tokens, blocks, namespace)

    return insert
