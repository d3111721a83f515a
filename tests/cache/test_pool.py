"""KVBlockPool: the preallocated KV tensor, its sizes, and the reference-counted free list."""

from __future__ import annotations

import pytest
import torch

from prefixcache import KVBlockPool
from prefixcache.cache.pool import kv_bytes_per_token
from prefixcache.errors import InvalidArgumentError, LockError, OutOfBlocksError


def small_fp16_pool(num_blocks: int = 4, block_size: int = 16) -> KVBlockPool:
    return KVBlockPool(
        num_blocks, block_size, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16, device="cpu"
    )


def test_kv_tensor_has_shape_layers_kv_blocks_block_size_heads_dim() -> None:
    pool = KVBlockPool(5, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16, device="cpu")

    assert pool.kv is not None
    assert tuple(pool.kv.shape) == (3, 2, 5, 4, 2, 8)
    assert pool.kv.dtype == torch.float16


def test_bytes_per_token_is_two_times_layers_heads_head_dim_element_size() -> None:
    assert small_fp16_pool().bytes_per_token == 2 * 2 * 2 * 8 * 2 == 128
    assert kv_bytes_per_token(2, 2, 8, torch.float32) == 256


def test_nbytes_is_the_size_of_the_kv_tensor() -> None:
    assert small_fp16_pool(num_blocks=4, block_size=16).nbytes == 4 * 16 * 128


def test_metadata_only_pool_holds_no_tensor_and_no_bytes() -> None:
    pool = KVBlockPool(7, 16)

    assert pool.kv is None
    assert pool.bytes_per_token == 0
    assert pool.nbytes == 0
    assert pool.capacity_tokens == 7 * 16


def test_from_memory_budget_takes_the_most_whole_blocks_that_fit() -> None:
    block_bytes = 128 * 16
    pool = KVBlockPool.from_memory_budget(
        10 * block_bytes + block_bytes - 1, 16, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16
    )

    assert pool.num_blocks == 10
    assert pool.nbytes == 10 * block_bytes


def test_from_memory_budget_below_one_block_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="holds no block"):
        KVBlockPool.from_memory_budget(128 * 16 - 1, 16, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)


def test_allocate_hands_out_distinct_low_ids_with_count_one() -> None:
    pool = KVBlockPool(6, 4)

    blocks = pool.allocate(3)

    assert blocks.dtype.name == "int32"
    assert sorted(blocks.tolist()) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 0, 0, 0]
    assert pool.num_free_blocks == 3
    assert pool.num_used_blocks == 3
    assert sorted(pool.free_block_ids().tolist()) == [3, 4, 5]


def test_decref_to_zero_returns_a_block_to_the_free_list() -> None:
    pool = KVBlockPool(4, 4)
    blocks = pool.allocate(2)

    freed = pool.decref(blocks[:1])

    assert freed == 1
    assert pool.ref_count(int(blocks[0])) == 0
    assert int(blocks[0]) in pool.free_block_ids().tolist()
    assert pool.num_free_blocks == 3
    pool.check_invariants()


def test_a_freed_block_is_the_next_one_handed_out() -> None:
    pool = KVBlockPool(4, 4)
    blocks = pool.allocate(3)
    pool.decref(blocks[1:2])

    assert pool.allocate(1).tolist() == [int(blocks[1])]


def test_a_shared_block_stays_in_use_until_its_last_holder_lets_go() -> None:
    pool = KVBlockPool(4, 4)
    blocks = pool.allocate(1)
    pool.incref(blocks)

    assert pool.decref(blocks) == 0
    assert pool.ref_count(int(blocks[0])) == 1
    assert pool.num_free_blocks == 3
    assert pool.decref(blocks) == 1
    assert pool.num_free_blocks == 4


def test_double_decref_raises_lock_error_and_changes_nothing() -> None:
    pool = KVBlockPool(4, 4)
    blocks = pool.allocate(2)
    pool.decref(blocks[:1])
    counts, free = pool.ref_counts(), pool.free_block_ids()

    with pytest.raises(LockError, match="double release"):
        pool.decref(blocks)

    assert pool.ref_counts().tolist() == counts.tolist()
    assert pool.free_block_ids().tolist() == free.tolist()
    pool.check_invariants()


def test_incref_of_a_free_block_raises_lock_error() -> None:
    pool = KVBlockPool(4, 4)

    with pytest.raises(LockError, match="free block"):
        pool.incref([2])

    assert pool.ref_counts().tolist() == [0, 0, 0, 0]


def test_allocating_more_than_is_free_raises_and_takes_nothing() -> None:
    pool = KVBlockPool(4, 4)
    pool.allocate(3)
    free = pool.free_block_ids()

    with pytest.raises(OutOfBlocksError, match="only 1 of 4 free"):
        pool.allocate(2)

    assert pool.num_free_blocks == 1
    assert pool.free_block_ids().tolist() == free.tolist()
    pool.check_invariants()


@pytest.mark.parametrize("block_size", [0, 257, -1])
def test_block_size_outside_1_to_256_is_refused(block_size: int) -> None:
    with pytest.raises(InvalidArgumentError, match="block_size must be in 1..256"):
        KVBlockPool(4, block_size)


@pytest.mark.parametrize("block_size", [1, 256])
def test_block_sizes_1_and_256_are_accepted(block_size: int) -> None:
    pool = KVBlockPool(2, block_size, num_layers=1, num_kv_heads=1, head_dim=1, device="cpu")

    assert pool.block_size == block_size
    assert pool.kv is not None and pool.kv.shape[3] == block_size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 0}, "num_blocks must be at least 1"),
        ({"num_blocks": 2.0}, "num_blocks must be an int"),
        ({"block_size": True}, "block_size must be an int"),
        ({"num_layers": -1}, "non-negative"),
        ({"num_layers": 1, "num_kv_heads": 0, "head_dim": 4}, "needs num_kv_heads >= 1"),
    ],
)
def test_bad_pool_shape_is_refused(kwargs: dict, message: str) -> None:
    args = {"num_blocks": 4, "block_size": 4} | kwargs

    with pytest.raises(InvalidArgumentError, match=message):
        KVBlockPool(args.pop("num_blocks"), args.pop("block_size"), **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is the CPU only without a GPU")
def test_device_none_means_the_cpu_without_a_gpu() -> None:
    pool = KVBlockPool(2, 4, num_layers=1, num_kv_heads=1, head_dim=2)

    assert pool.device == torch.device("cpu")
    assert pool.kv is not None and pool.kv.device.type == "cpu"
    assert pool.block_table_tensor([1, 0]).device.type == "cpu"


def test_copy_rows_copies_the_first_rows_of_every_layer_keys_and_values() -> None:
    pool = KVBlockPool(2, 4, num_layers=2, num_kv_heads=1, head_dim=2, device="cpu")
    assert pool.kv is not None
    pool.kv[:, :, 0] = torch.arange(2 * 2 * 4 * 2, dtype=torch.float32).reshape(2, 2, 4, 1, 2)
    source = pool.kv[:, :, 0].clone()

    pool.copy_rows(0, 1, 3)

    assert torch.equal(pool.kv[:, :, 1, :3], source[:, :, :3])
    assert torch.equal(pool.kv[:, :, 1, 3], torch.zeros(2, 2, 1, 2))
    assert torch.equal(pool.kv[:, :, 0], source)


def test_block_table_tensor_is_int64_in_order() -> None:
    table = KVBlockPool(4, 4).block_table_tensor([3, 1, 2])

    assert table.dtype == torch.int64
    assert table.tolist() == [3, 1, 2]


def test_from_memory_budget_refuses_block_size_0_before_dividing_by_it() -> None:
    with pytest.raises(InvalidArgumentError, match="block_size must be in 1..256 tokens, got 0"):
        KVBlockPool.from_memory_budget(10**6, 0, num_layers=1, num_kv_heads=1, head_dim=4)
