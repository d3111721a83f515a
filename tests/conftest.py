"""Shared fixtures: one torch thread, the tiny model, a cache factory and a helper that caches one sequence."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from prefixcache import InsertResult, KVBlockPool, RadixCache
from prefixcache.models.llama import LlamaModel, build_model


@pytest.fixture(scope="session", autouse=True)
def single_torch_thread() -> Iterator[None]:
    # The tiny model's ops are microseconds long: on a shared 2-core machine a second intra-op thread only
    # spin-waits (seen 15-100x slower).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny() -> LlamaModel:
    """The embedded ``tiny`` model on the CPU, built once."""
    return build_model("tiny", device="cpu")


@pytest.fixture(scope="session")
def model(tiny: LlamaModel) -> LlamaModel:
    """The same ``tiny`` model, under the name the stress tests use."""
    return tiny


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
