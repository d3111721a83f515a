"""The K/V pool's host memory follows use: allocating a large CPU pool commits no pages until blocks are written."""

from __future__ import annotations

import sys

import pytest
import torch

from prefixcache.cache.pool import KVBlockPool, zeroed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_new_zeroed_tensor_is_zero_and_has_its_shape_and_dtype(dtype: torch.dtype) -> None:
    tensor = zeroed((3, 2, 5, 4, 2, 8), dtype, torch.device("cpu"))
    assert tensor.shape == (3, 2, 5, 4, 2, 8)
    assert tensor.dtype == dtype
    assert tensor.is_contiguous()
    assert torch.count_nonzero(tensor) == 0


def test_a_large_pool_is_not_resident_until_its_blocks_are_written() -> None:
    # 2 layers x 2 x 4,096 blocks x 16 tokens x 8 heads x 64 dims x 4 bytes = 512 MiB of K/V.
    before = resident_mib()
    pool = KVBlockPool(4096, 16, num_layers=2, num_kv_heads=8, head_dim=64, device="cpu")
    assert pool.kv is not None and pool.kv.numel() * 4 == 512 * 1024 * 1024
    allocated = resident_mib() - before
    assert allocated < 64, f"{allocated:.0f} MiB resident right after allocating a 512 MiB pool"
    blocks = pool.allocate(256)  # 1/16 of the pool, every layer's K and V written: 32 MiB
    pool.kv[:, :, torch.as_tensor(blocks, dtype=torch.long)] = 1.0
    written = resident_mib() - before
    assert 24 < written < 96, f"{written:.0f} MiB resident after writing 32 MiB of blocks"
    assert float(pool.kv[0, 0, int(blocks[0])].sum()) == 16 * 8 * 64
    assert torch.count_nonzero(pool.kv[:, :, 300:]) == 0


def test_a_pool_larger_than_the_machines_memory_is_refused_at_creation() -> None:
    import os

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    num_blocks = physical // (2 * 16 * 8 * 64 * 4) + 1  # one layer's K and V, float32: just over the machine
    with pytest.raises(MemoryError, match="more than the machine's"):
        KVBlockPool(num_blocks, 16, num_layers=1, num_kv_heads=8, head_dim=64, device="cpu")
    with pytest.raises(MemoryError):  # a size whose byte count overflows 64 bits is refused the same way
        zeroed((2**40, 2**30, 16), torch.float32, torch.device("cpu"))


_PROGRAM_POOL = """
import json
from prefixcache.host_allocator import keep_freed_host_memory
keep_freed_host_memory()  # as the prefixcache program starts: blocks below 256 MiB come from the heap
import torch
from prefixcache.cache.pool import KVBlockPool
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
scratch = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB freed into the heap, as a prefill's activations are
del scratch
created = []
for _ in range(2):  # the second pool may reuse the first's freed memory
    before = resident_mib()
    pool = KVBlockPool(1024, 16, num_layers=2, num_kv_heads=8, head_dim=64, device="cpu")  # 128 MiB
    created.append(resident_mib() - before)
    del pool
print(json.dumps(created))
"""


def test_a_pool_below_the_programs_mmap_threshold_is_not_resident_either() -> None:
    import json
    import subprocess

    done = subprocess.run([sys.executable, "-c", _PROGRAM_POOL], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    created = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(mib < 16 for mib in created), f"MiB resident right after allocating 128 MiB pools: {created}"
