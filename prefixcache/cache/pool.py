"""The KV block pool: one preallocated KV tensor cut into fixed-size blocks, with a reference count per block.

The idea is vLLM's PagedAttention (Kwon et al., SOSP 2023): KV memory is split into blocks of ``block_size``
tokens, a request's KV is addressed through a *block table* (its list of block ids), and blocks are shared
between requests by reference counting instead of copying.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from prefixcache.errors import InvalidArgumentError, LockError, OutOfBlocksError

if TYPE_CHECKING:
    import torch

MAX_BLOCK_SIZE = 256
BLOCK_ID_DTYPE = np.int32

BlockIds = np.ndarray | Sequence[int]


def check_block_size(block_size: object) -> int:
    """Return ``block_size`` if it is an int in 1..``MAX_BLOCK_SIZE`` tokens.

    Raises:
        InvalidArgumentError: anything else (0, 257, a float, a bool).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise InvalidArgumentError(f"block_size must be an int, got {block_size!r}")
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise InvalidArgumentError(f"block_size must be in 1..{MAX_BLOCK_SIZE} tokens, got {block_size}")
    return block_size


def check_count(value: object, name: str) -> int:
    """Return ``value`` as a plain ``int`` if it is a non-negative int (numpy integers included: their fixed width
    would wrap in the cache's block arithmetic, so they do not go further).

    Raises:
        InvalidArgumentError: a bool, a float, a negative number or anything else.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def default_device() -> torch.device:
    """CUDA when a GPU is present, else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class KVBlockPool:
    """A fixed pool of KV blocks, preallocated once, handing out block ids in O(1).

    ``kv`` has shape ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 of the
    second axis holds keys, 1 values); it is allocated in the constructor and never grown, concatenated or
    reallocated.  With ``num_layers == 0`` the pool is *metadata only* (``kv is None``): the cache-only
    replay (``--no-model``) uses it to count blocks without holding any KV, and imports no torch: its ``dtype``
    (``torch.float32`` unless given) and ``device`` (CUDA when present, unless given) are resolved on first use.

    Reference counts live in a numpy array, so releasing the hundreds of blocks of an evicted node is one
    vectorized operation.  A block is on the free list exactly when its count is 0.  Counts are kept by
    :class:`~prefixcache.cache.radix_cache.RadixCache`: one per tree node that holds the block plus one for the request
    that allocated it and has not yet handed it to the tree.

    Not thread-safe on its own; :class:`~prefixcache.cache.radix_cache.RadixCache` serializes access.

    Raises:
        InvalidArgumentError: ``num_blocks < 1``, ``block_size`` outside 1..256, negative shape values.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        num_layers: int = 0,
        num_kv_heads: int = 0,
        head_dim: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        check_block_size(block_size)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise InvalidArgumentError(f"num_blocks must be an int, got {num_blocks!r}")
        if num_blocks < 1:
            raise InvalidArgumentError(f"num_blocks must be at least 1, got {num_blocks}")
        if min(num_layers, num_kv_heads, head_dim) < 0:
            raise InvalidArgumentError("num_layers, num_kv_heads and head_dim must be non-negative")
        if num_layers > 0 and (num_kv_heads < 1 or head_dim < 1):
            raise InvalidArgumentError("a pool with layers needs num_kv_heads >= 1 and head_dim >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._dtype = dtype
        self._device_given = device
        self._device: torch.device | None = None
        self.kv: torch.Tensor | None = None
        if num_layers > 0:
            shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
            self.kv = zeroed(shape, self.dtype, self.device)
        self._ref = np.zeros(num_blocks, dtype=np.int32)
        # A stack of free block ids: the top is _free[_num_free - 1]; pops hand out low ids first.
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=BLOCK_ID_DTYPE)
        self._num_free = num_blocks

    @property
    def dtype(self) -> torch.dtype:
        """The K/V element type (``torch.float32`` unless one was given)."""
        if self._dtype is None:
            import torch

            self._dtype = torch.float32
        return self._dtype

    @property
    def device(self) -> torch.device:
        """The K/V's device: the one given, else CUDA when a GPU is present, else the CPU."""
        if self._device is None:
            import torch

            given = self._device_given
            self._device = torch.device(given) if given is not None else default_device()
        return self._device

    @classmethod
    def from_memory_budget(
        cls,
        budget_bytes: int,
        block_size: int = 16,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVBlockPool:
        """Size the pool to the most whole blocks whose KV fits in ``budget_bytes``.

        Raises:
            InvalidArgumentError: the budget holds less than one block, or the shape is not positive.
        """
        check_block_size(block_size)
        if num_layers < 1 or num_kv_heads < 1 or head_dim < 1:
            raise InvalidArgumentError("from_memory_budget needs num_layers, num_kv_heads, head_dim >= 1")
        if dtype is None:
            import torch

            dtype = torch.float32
        per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
        num_blocks = int(budget_bytes) // (per_token * block_size)
        if num_blocks < 1:
            raise InvalidArgumentError(
                f"a budget of {budget_bytes} bytes holds no block of {block_size} tokens at {per_token} bytes per token"
            )
        return cls(
            num_blocks,
            block_size,
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token: ``2 * num_layers * num_kv_heads * head_dim * element_size`` (0 if metadata-only)."""
        if self.kv is None:
            return 0
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated KV tensor."""
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool holds when every block is full: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks to hold ``num_tokens`` tokens starting at a block boundary: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        """Current reference count of one block (0 means free)."""
        return self._ref.item(block_id)

    def ref_counts(self) -> np.ndarray:
        """A copy of all reference counts, shape ``[num_blocks]``."""
        return self._ref.copy()

    def free_block_ids(self) -> np.ndarray:
        """A copy of the free list, shape ``[num_free_blocks]``."""
        return self._free[: self._num_free].copy()

    def allocate(self, num_blocks: int) -> np.ndarray:
        """Take ``num_blocks`` free blocks, each with reference count 1. O(1) plus a copy of the ids.

        Returns an int32 array of block ids.  Does not evict: :meth:`RadixCache.allocate` does that first.

        Raises:
            OutOfBlocksError: fewer than ``num_blocks`` blocks are free (nothing is taken).
        """
        if num_blocks < 0:
            raise InvalidArgumentError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > self._num_free:
            raise OutOfBlocksError(f"asked for {num_blocks} blocks, only {self._num_free} of {self.num_blocks} free")
        top = self._num_free
        taken = self._free[top - num_blocks : top].copy()
        self._num_free = top - num_blocks
        self._ref[_as_index(taken)] = 1
        return taken

    def incref(self, block_ids: BlockIds) -> None:
        """Add one holder to each block (ids must be distinct and currently in use).

        Raises:
            LockError: a block is free (count 0): sharing a free block would be a use-after-free.
        """
        ids = _as_index(block_ids)
        if ids.size:
            counts = self._ref[ids]
            if counts[counts.argmin()] <= 0:
                raise LockError("incref of a free block")
            self._ref[ids] = counts + 1

    def release(self, block_ids: BlockIds) -> int:
        """:meth:`decref` for holds that must go even when interrupted: an interrupted first attempt (decref changes
        nothing when it raises) is repeated once before the error goes through, so no block leaks.  Returns the
        number of blocks freed."""
        try:
            return self.decref(block_ids)
        except BaseException:
            self.decref(block_ids)
            raise

    def decref(self, block_ids: BlockIds) -> int:
        """Drop one holder from each block; blocks whose count reaches 0 go back on the free list.

        Ids must be distinct.  Returns the number of blocks freed.

        Raises:
            LockError: a block is already free (double release); nothing is changed.
        """
        ids = _as_index(block_ids)
        if ids.size == 0:
            return 0
        counts = self._ref[ids]
        if counts[counts.argmin()] <= 0:
            raise LockError(f"double release of block(s) {ids[counts <= 0][:8].tolist()}")
        counts -= 1
        self._ref[ids] = counts
        num_freed = ids.size - int(np.count_nonzero(counts))
        if num_freed:
            # Usually every block is freed (a leaf's blocks have one holder): push them without a mask.
            freed = ids if num_freed == ids.size else ids[counts == 0]
            top = self._num_free
            self._free[top : top + num_freed] = freed
            self._num_free = top + num_freed
        return num_freed

    def free_exclusive(self, block_ids: np.ndarray) -> int:
        """Free blocks whose only holder is the caller; returns how many.

        :meth:`decref` without its checks (two numpy calls instead of eight): the caller guarantees that every
        count is exactly 1 and the ids are distinct, as :class:`~prefixcache.RadixCache` has verified for
        blocks a request allocated and still owns.  ``block_ids`` must be an intp array.
        """
        num_freed = block_ids.size
        if num_freed:
            self._ref[block_ids] = 0
            top = self._num_free
            self._free[top : top + num_freed] = block_ids
            self._num_free = top + num_freed
        return num_freed

    def copy_rows(self, src_block: int, dst_block: int, num_rows: int) -> None:
        """Copy the first ``num_rows`` token rows of K and V of every layer from one block to another.

        Copy-on-write for a match that ends inside a block: the shared block is read, never written.
        One device-side copy; no-op for a metadata-only pool.
        """
        if self.kv is not None and num_rows > 0:
            self.kv[:, :, dst_block, :num_rows] = self.kv[:, :, src_block, :num_rows]

    def block_table_tensor(self, block_ids: BlockIds) -> torch.Tensor:
        """The block table as an int64 tensor on the pool's device, shape ``[len(block_ids)]`` (one transfer)."""
        import torch

        ids = np.asarray(block_ids, dtype=np.int64)
        return torch.from_numpy(ids).to(self.device, non_blocking=True)

    def check_invariants(self) -> None:
        """Assert the pool's own bookkeeping: the free list holds exactly the blocks of count 0, once each.

        Raises:
            AssertionError: with what is wrong.
        """
        free = self._free[: self._num_free]
        if np.unique(free).size != free.size:
            raise AssertionError("a block is on the free list twice")
        zero = np.flatnonzero(self._ref == 0)
        if not np.array_equal(np.sort(free), zero):
            raise AssertionError("free list differs from the blocks whose reference count is 0")
        if (self._ref < 0).any():
            raise AssertionError("negative reference count")


def _as_index(block_ids: BlockIds) -> np.ndarray:
    """Block ids as an intp array.

    numpy converts int32 indices to intp inside every fancy-indexing call, which costs several times the
    indexing itself on the short arrays of a request; converting once per operation is cheaper.  Small-array
    checks below use ``argmin`` and ``count_nonzero`` instead of ufunc reductions for the same reason.
    """
    return np.asarray(block_ids, dtype=np.intp)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of ``shape`` whose host memory is committed as it is written, not at allocation.

    ``torch.zeros`` on the CPU writes every byte, so a pool sized for 32 full-context sessions is resident from the
    start.  A private anonymous ``mmap`` gives fresh zero pages mapped on first touch, and unmaps them when the pool
    goes: resident memory follows the blocks written, as a CPU user expects of a preallocated pool.  (Not ``calloc``:
    with the program's allocator settings, :mod:`prefixcache.host_allocator`, a pool below the mmap threshold came
    from freed heap memory, which ``calloc`` zeroes by writing it, so the whole pool was resident at once.)  Where
    ``mmap`` has no private anonymous mappings, numpy's ``zeros`` (``calloc``); other devices use ``torch.zeros``.

    Raises:
        MemoryError: more bytes than the machine's physical memory (a lazily committed pool would be killed only when
            its blocks filled).
    """
    import torch

    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    if physical is not None and num_bytes > physical:  # committed lazily, it would be killed only when it fills
        raise MemoryError(f"cannot allocate {num_bytes:,} bytes of K/V: more than the machine's {physical:,}")
    if num_bytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # unmapped with the last view
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8)).view(dtype).view(shape)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """``2 * num_layers * num_kv_heads * head_dim * element_size`` bytes: the K and V of one token."""
    import torch

    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * element_size
