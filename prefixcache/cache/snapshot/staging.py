"""Host memory for a snapshot's copy of the K/V, made ready before the copy so that the copy is only a memcpy.

A fresh host allocation costs a page fault per 4 KiB page on its first write: measured on a 2-core VM, gathering
512 MiB of K/V into new memory took 2.2 s, into memory already written 0.16 s.  A save that must not stall the engine
allocates and touches its buffer on its writer thread first (:func:`staging_for`: the blocks the pools hold now plus
headroom for what may be cached before the copy), then hands it to
:func:`~prefixcache.cache.snapshot.tree.capture` and :func:`~prefixcache.cache.snapshot.host.capture`, which take their
K/V tensors from it (:meth:`StagingBuffer.take`) under the cache's mutex.  On a GPU the buffer is pinned, so the
device-to-host copy runs at full speed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prefixcache.cache.pool import KVBlockPool

if TYPE_CHECKING:
    import torch

__all__ = ["StagingBuffer", "staging_for"]

logger = logging.getLogger(__name__)

HEADROOM = 0.25
"""Blocks :func:`staging_for` adds, as a fraction of the blocks in use, for what is cached before the copy."""


class StagingBuffer:
    """``num_elements`` elements of ``dtype`` in host memory, every page written once (pinned when ``pin``), handed
    out front to back by :meth:`take`.  Not thread-safe: one capture uses it at a time."""

    def __init__(self, num_elements: int, dtype: torch.dtype, *, pin: bool = False) -> None:
        import torch

        data = None
        if pin:
            try:
                data = torch.empty(num_elements, dtype=dtype, pin_memory=True)
            except RuntimeError as error:  # no pinnable memory left: pageable memory copies too, only slower
                logger.warning("cannot pin a snapshot copy's buffer (%s); using pageable memory", error)
        if data is None:
            data = torch.empty(num_elements, dtype=dtype)
        data.zero_()  # the page faults happen here, on the caller's thread, not during the copy
        self._data = data
        self._used = 0

    @property
    def num_free_elements(self) -> int:
        """Elements not yet handed out."""
        return self._data.numel() - self._used

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of ``shape`` and ``dtype``: the next part of the buffer, or new memory (whose page
        faults the caller then pays) when the rest of the buffer is too small or of another dtype.  Its content is
        whatever the buffer held: the caller overwrites all of it.  O(1) from the buffer."""
        num = math.prod(shape)
        if dtype != self._data.dtype or num > self.num_free_elements:
            import torch

            logger.debug("a snapshot copy outgrew its staging buffer: %d elements in new memory", num)
            return torch.empty(tuple(shape), dtype=dtype)
        part = self._data[self._used : self._used + num].view(tuple(shape))
        self._used += num
        return part


def staging_for(pool: KVBlockPool, host_pool: KVBlockPool | None = None) -> StagingBuffer | None:
    """A buffer for a copy of what ``pool`` (and the host tier's ``host_pool``) hold now, plus :data:`HEADROOM`:
    the blocks in use of each (never more than its size).  None for metadata-only pools.  O(buffer bytes): the caller
    runs it off the thread the copy must not stall.  Reads the pools' counters without their cache's mutex (an
    estimate; a copy that outgrows it still succeeds, see :meth:`StagingBuffer.take`)."""
    if pool.kv is None:
        return None
    num_blocks = 0
    for each in (pool, host_pool):
        if each is not None and each.kv is not None:
            used = each.num_used_blocks
            num_blocks += min(each.num_blocks, used + math.ceil(used * HEADROOM) + 1)
    per_block = pool.kv[:, :, 0].numel()
    return StagingBuffer(num_blocks * per_block, pool.kv.dtype, pin=pool.kv.is_cuda)
