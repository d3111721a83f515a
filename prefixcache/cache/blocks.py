"""Which pool blocks callers own, and the hand-over of those blocks to the tree.

Each block's reference count (:class:`~prefixcache.cache.pool.KVBlockPool`) is the number of tree nodes holding it
plus one while a caller owns it: from :meth:`BlockLedger.allocate` until the caller hands it to the tree
(:meth:`BlockLedger.insert`) or gives it back (:meth:`BlockLedger.free`).  The ledger keeps one flag per block for
that "plus one", so a block can never be handed over twice, freed twice, or freed while the tree holds it.

One kind of block is both: a lease that extends a cached partial block in place
(:meth:`~prefixcache.cache.admission.Admission.acquire`) owns that block while the tree's node keeps holding its first
rows.  ``extending`` flags those blocks; they go back by ``decref`` (the tree's hold stays), never by the fast path for
blocks whose only holder is the caller.  Callers hold the cache's mutex.
"""

from __future__ import annotations

from array import array

import numpy as np

from prefixcache.cache.node import Node
from prefixcache.cache.pool import BlockIds, KVBlockPool, check_count
from prefixcache.cache.results import InsertResult
from prefixcache.cache.tree import RadixTree
from prefixcache.errors import CapacityError, InvalidArgumentError, LockError, OutOfBlocksError, PoolBusyError

NOT_OWNED = "block(s) not owned by the caller: freed already, held by the tree, or listed twice"


class BlockLedger:
    """The blocks callers own (``owned[block_id]``; ``extending[block_id]`` where the tree holds the block too, see
    the module docstring), allocation that evicts from ``tree`` when the pool is short, and inserts that move a
    caller's blocks into the tree.  All checks are O(len(block ids)) numpy passes."""

    def __init__(self, pool: KVBlockPool, tree: RadixTree) -> None:
        self.pool = pool
        self.tree = tree
        self.owned = np.zeros(pool.num_blocks, dtype=bool)
        self.extending = np.zeros(pool.num_blocks, dtype=bool)
        # Scratch for the duplicate test of a block table (see distinct); its contents mean nothing between calls.
        self._slot = np.zeros(pool.num_blocks, dtype=np.int32)
        self._positions = np.arange(0, dtype=np.int32)  # 0, 1, 2...: grown to the longest table checked

    @property
    def num_owned(self) -> int:
        """Blocks owned by callers now.  O(num_blocks)."""
        return int(np.count_nonzero(self.owned))

    def allocate(self, num_blocks: int, what: str = "") -> np.ndarray:
        """Take ``num_blocks`` blocks for the caller (int32 ids), evicting unlocked blocks if the pool is short.

        Feasibility first: eviction starts only when free plus evictable blocks cover the request, so a request that
        cannot be served never costs the cache anything.  ``what`` names the allocation in error messages.

        Raises:
            InvalidArgumentError: ``num_blocks`` is not a non-negative int.
            CapacityError: more blocks than the pool has at all (nothing is evicted).
            PoolBusyError: free plus evictable blocks fall short, because running requests hold the rest (nothing
                is evicted).
            OutOfBlocksError: short after eviction although the count said otherwise, which only a block held for a
                moment by copy-on-write can cause; nothing is allocated.
        """
        num_blocks = check_count(num_blocks, "num_blocks")
        pool = self.pool
        if num_blocks > pool.num_blocks:
            raise CapacityError(
                f"{num_blocks} blocks needed but the pool only has {pool.num_blocks} blocks of {pool.block_size} tokens"
            )
        short = num_blocks - pool.num_free_blocks
        if short > 0:
            self.check_feasible(num_blocks, what)
            self.tree.evict(short)
            if num_blocks > pool.num_free_blocks:
                raise OutOfBlocksError(
                    f"{num_blocks} blocks needed, {pool.num_free_blocks} free after evicting every unlocked block "
                    f"({self.tree.locked_tokens} tokens locked by running requests, "
                    f"{self.num_owned} blocks owned by requests)"
                )
        blocks = pool.allocate(num_blocks)
        self.owned[blocks.astype(np.intp)] = True
        return blocks

    def check_feasible(self, num_blocks: int, what: str = "", own_locked: int = 0, healable: int = 0) -> None:
        """Raises PoolBusyError unless free plus evictable blocks (plus ``healable`` duplicate blocks that
        eviction would let the asking request's path give back) cover ``num_blocks``.  O(1) when they do.
        ``own_locked`` blocks of the locked ones are the asking request's own prefix, left out of the blame."""
        pool, tree = self.pool, self.tree
        free = pool.num_free_blocks
        if num_blocks > free + tree.evictable_blocks + healable:
            owned = self.num_owned
            raise PoolBusyError(
                num_blocks,
                free_blocks=free,
                evictable_blocks=tree.evictable_blocks,
                locked_blocks=pool.num_used_blocks - tree.evictable_blocks - owned - own_locked,
                owned_blocks=owned,
                pool_blocks=pool.num_blocks,
                what=what,
            )

    def free(self, block_ids: BlockIds) -> int:
        """Give back blocks the caller owns without caching them.  Returns blocks freed.

        Raises:
            InvalidArgumentError: malformed ids.
            LockError: a block is not owned by a caller (already freed, or held by the tree); nothing changes.
        """
        index = self.as_block_ids(block_ids)
        if np.count_nonzero(self.owned[index]) != index.size or not self.distinct(index):
            raise LockError(NOT_OWNED)
        self.owned[index] = False
        return self.give_back(index)

    def copy_of(self, block: int, rows: int, what: str) -> np.ndarray | None:
        """A block of the caller's own (intp ids, one) holding ``block``'s first ``rows`` rows, or None when none can
        be had (eviction included).  Should the copy raise, the new block goes back."""
        try:
            copy = self.allocate(1, what).astype(np.intp)
        except OutOfBlocksError:
            return None
        try:
            self.pool.copy_rows(block, int(copy[0]), rows)
        except BaseException:
            self.free(copy)
            raise
        return copy

    def give_back(self, index: np.ndarray) -> int:
        """Drop the caller's hold on blocks it owned (intp ids, flags already cleared by the caller): blocks the
        tree holds too (``extending``) keep the tree's hold, the rest are freed.  Returns blocks freed."""
        shared = self.extending[index]
        if not shared.any():
            return self.pool.free_exclusive(index)
        extended = index[shared]
        self.extending[extended] = False
        return self.pool.free_exclusive(index[~shared]) + self.pool.release(extended)

    def insert(
        self, q: array, table: np.ndarray, first_owned: int | None, namespace: str | None, origin: str | None
    ) -> InsertResult:
        """Insert ``q`` into the tree with its KV in ``table`` (from :meth:`as_block_ids`): the tree takes the
        caller's blocks it needs, the rest go back to the pool.  ``first_owned`` is found from the ownership flags
        when None (the caller's blocks follow the borrowed, tree-held ones).

        Raises:
            InvalidArgumentError: too few blocks for the tokens, or the sequence leaves the cached path inside
                the borrowed blocks.
            LockError: a block the caller hands over is not its own, or a borrowed block is not cached.
        Nothing changes when it raises.
        """
        bs = self.pool.block_size
        n = len(q)
        need = -(-n // bs)
        if len(table) < need:
            raise InvalidArgumentError(
                f"{n} tokens need {need} blocks of {bs} tokens, but the block table has {len(table)}"
            )
        if first_owned is None:
            owned = self.owned[table]
            first = int(owned.argmax()) if owned.size else 0
            first_owned = first if owned.size and owned[first] else len(table)
        if first_owned:
            counts = self.pool._ref[table[:first_owned]]
            if counts[counts.argmin()] <= 0:
                self._check_owned(table[first_owned:])
                raise LockError("the block table starts with blocks that are neither owned by the caller nor cached")
        return self.insert_owned(q, table[first_owned:], first_owned, namespace, origin)

    def insert_owned(
        self,
        q: array,
        owned: np.ndarray,
        first_owned: int,
        namespace: str | None,
        origin: str | None,
        start: Node | None = None,
    ) -> InsertResult:
        """:meth:`insert` for a caller that knows its borrowed blocks are cached: a lease, whose first
        ``first_owned`` blocks are its locked path's (``start``, the lock's node, lets the tree's walk begin there,
        see :meth:`~prefixcache.cache.tree.RadixTree.insert`).  Only the caller's own blocks ``owned`` (intp ids of
        block indices ``first_owned`` on) are checked, as :meth:`insert` checks them: the borrowed ones are never
        read.  O(len(owned)) numpy work plus the tree's insert.

        Raises:
            InvalidArgumentError: too few blocks for the tokens, or the sequence leaves the cached path inside
                the borrowed blocks.
            LockError: a block in ``owned`` is not the caller's (or is listed twice).
        Nothing changes when it raises.
        """
        bs = self.pool.block_size
        n = len(q)
        need = -(-n // bs)
        if first_owned + len(owned) < need:
            raise InvalidArgumentError(
                f"{n} tokens need {need} blocks of {bs} tokens, but the block table has {first_owned + len(owned)}"
            )
        self._check_owned(owned)
        num_cached, released = self.tree.insert(q, owned, first_owned, namespace, origin, start)
        # Every block the caller owned now belongs to the new leaf or goes back to the pool (or, extended in place,
        # to the tree's node alone).
        self.owned[owned] = False
        try:
            num_released = self.give_back(released)
        finally:
            self.extending[owned] = False
        return InsertResult(n - num_cached, num_cached, num_released)

    def _check_owned(self, owned: np.ndarray) -> None:
        if np.count_nonzero(self.owned[owned]) != len(owned) or not self.distinct(owned):
            raise LockError(NOT_OWNED)

    def as_block_ids(self, block_ids: BlockIds) -> np.ndarray:
        """``block_ids`` checked to be 1-D ints in range, as an intp array.

        intp because numpy converts any other index type on every fancy-indexing call, which costs more than the
        indexing itself on a request's short arrays.  For the same reason the checks here and below use
        ``argmin``/``argmax`` and ``count_nonzero`` rather than ufunc reductions (``min()``, ``.all()``).

        Raises:
            InvalidArgumentError: not a 1-D sequence of ints in ``0 .. num_blocks - 1``.
        """
        try:
            ids = np.asarray(block_ids)
        except (TypeError, ValueError):
            raise InvalidArgumentError("block ids must be a 1-D sequence of ints") from None
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"block ids must be a 1-D sequence of ints, got shape {ids.shape} {ids.dtype}")
        index = ids.astype(np.intp, copy=False)
        # One range check for both ends: read as unsigned, a negative id (or a uint64 id past the intp range,
        # wrapped negative by the cast) is larger than any block id.
        unsigned = index.view(np.uintp)
        if index.size and unsigned[unsigned.argmax()] >= self.pool.num_blocks:
            raise InvalidArgumentError(f"block ids must be in 0..{self.pool.num_blocks - 1}")
        return index

    def distinct(self, index: np.ndarray) -> bool:
        """Whether no block id is listed twice.  O(len(index)) without sorting (``np.unique`` costs ~20x more): each
        id writes its position into its scratch slot; an id listed twice keeps only one of its positions there, so
        the other one reads back wrong."""
        if len(self._positions) < index.size:
            self._positions = np.arange(index.size, dtype=np.int32)
        positions = self._positions[: index.size]
        self._slot[index] = positions
        # Comparing the bytes is one memcmp, a third of the cost of a ufunc comparison on a request's table.
        return self._slot[index].tobytes() == positions.tobytes()
