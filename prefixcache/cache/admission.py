"""Admission: a request's hold on the cache, from its prompt's match to the insert of what it computed.

:meth:`Admission.acquire` matches at most ``len - 1`` prompt tokens (the last prompt token is always computed: its
logits start decoding), locks the whole blocks of the match, and copies the rows of a partially matched last block
into a block the request owns.  That copy is *copy-on-write* as in vLLM's PagedAttention (Kwon et al., "Efficient
Memory Management for Large Language Model Serving with PagedAttention", 2023): a shared block is never written in
place, because its later rows belong to another sequence.  :meth:`Admission.reserve` grows the request's block
table, :meth:`Admission.commit` inserts the request's tokens and unlocks, :meth:`Admission.release` gives
everything back after a failure.  Callers hold the cache's mutex.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from prefixcache.cache.blocks import BlockLedger
from prefixcache.cache.locks import LockHandle, LockRegistry
from prefixcache.cache.stats import HitCounters
from prefixcache.cache.tree import InsertResult, RadixTree
from prefixcache.errors import CapacityError, InvalidArgumentError, InvalidTokensError, LockError, OutOfBlocksError


@dataclass(slots=True, eq=False)
class Lease:
    """A request's hold on the cache, from :meth:`~prefixcache.RadixCache.acquire` to
    :meth:`~prefixcache.RadixCache.commit` or :meth:`~prefixcache.RadixCache.release`.

    ``block_table[:first_owned_block]`` are the tree's blocks of the matched prefix (kept alive by ``lock``);
    ``block_table[first_owned_block:]`` are owned by the request (the copy-on-write block of a match ending inside
    a block, then the blocks for the tokens it computes).  ``num_cached_tokens`` prompt tokens need no prefill;
    ``num_copied_tokens`` of them were copied rather than shared.
    """

    token_ids: array
    namespace: str | None
    num_cached_tokens: int
    num_copied_tokens: int
    block_table: np.ndarray
    first_owned_block: int
    lock: LockHandle
    block_size: int
    closed: bool = False
    request_id: str | None = None

    @property
    def capacity_tokens(self) -> int:
        """Tokens the block table can address: ``len(block_table) * block_size``."""
        return len(self.block_table) * self.block_size


class Admission:
    """Leases over one cache's tree, blocks, locks and hit counters.  ``owner`` is the cache, stamped on matches
    and checked on leases so that leases never cross caches."""

    def __init__(
        self, tree: RadixTree, blocks: BlockLedger, locks: LockRegistry, counters: HitCounters, owner: object
    ) -> None:
        self.tree = tree
        self.blocks = blocks
        self.locks = locks
        self.counters = counters
        self.owner = owner
        self.block_size = tree.block_size

    def acquire(self, q: array, namespace: str | None, request_id: str | None) -> Lease:
        """Match, lock and copy-on-write for the prompt ``q`` (see the module docstring).  If not even one block
        can be found for the copy, those rows are left to be recomputed (``num_cached_tokens`` drops to the block
        boundary) rather than failing the request.  Counts the query and one request in the hit window."""
        tree = self.tree
        match = tree.match(q, namespace, len(q) - 1, self.owner)
        bs = self.block_size
        table = match.block_table.copy()
        num_cached = match.num_tokens
        copied = num_cached % bs
        aligned = num_cached - copied
        own = tree.own_tokens(match.node, num_cached, request_id) if request_id is not None else 0
        end = tree.lock_point(match.node, aligned)
        handle = self.locks.lock(end)
        first_owned = len(table)
        if copied:
            private = self._copy_partial_block(int(table[-1]), copied, handle)
            if private is None:
                # Too tight to copy: recompute those rows instead of failing the request.
                table = table[:-1]
                own = tree.own_tokens(end, aligned, request_id) if request_id is not None else 0
                num_cached, copied = aligned, 0
            else:
                table[-1] = private
            first_owned -= 1
        self.counters.record_query(len(q), num_cached, own)
        self.counters.record_request(len(q), num_cached - own)
        lease = Lease(q, namespace, num_cached, copied, table, first_owned, handle, bs)
        lease.request_id = request_id
        return lease

    def _copy_partial_block(self, source: int, num_rows: int, handle: LockHandle) -> int | None:
        """Copy-on-write: a block owned by the caller holding the first ``num_rows`` rows of ``source``, or None
        if no block can be had.  Only the block-aligned prefix of a match is locked, so finding the block may
        evict ``source``'s node: a temporary reference keeps its rows alive meanwhile, and if that reference is
        all that is left of it, the block itself is taken over (nothing to copy).  On any other error the lock
        ``handle`` is released."""
        pool = self.blocks.pool
        pool.incref([source])
        try:
            private = self.blocks.allocate(1)
        except OutOfBlocksError:
            if pool.ref_count(source) == 1:
                self.blocks.owned[source] = True
                return source
            pool.decref([source])
            return None
        except BaseException:
            pool.decref([source])
            self.locks.unlock(handle)
            raise
        try:
            pool.copy_rows(source, int(private[0]), num_rows)
        except BaseException:
            self.blocks.owned[private] = False
            pool.decref(private)
            pool.decref([source])
            self.locks.unlock(handle)
            raise
        pool.decref([source])
        return int(private[0])

    def reserve(self, lease: Lease, num_tokens: int) -> np.ndarray:
        """Grow the lease's block table to address ``num_tokens`` tokens (evicting if needed); returns the table.

        Raises:
            InvalidArgumentError: ``num_tokens`` is not a non-negative int.
            CapacityError: ``num_tokens`` exceed the whole pool.  OutOfBlocksError: as ``allocate``.
            LockError: the lease is closed.
        """
        self.check_lease(lease, "reserve")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        bs = self.block_size
        need = -(-num_tokens // bs) - len(lease.block_table)
        if need > 0:
            pool = self.blocks.pool
            if -(-num_tokens // bs) > pool.num_blocks:
                raise CapacityError(
                    f"{num_tokens} tokens need {-(-num_tokens // bs)} blocks; "
                    f"the pool holds {pool.num_blocks} blocks of {bs} tokens"
                )
            lease.block_table = np.concatenate((lease.block_table, self.blocks.allocate(need)))
        return lease.block_table

    def commit(self, lease: Lease, q: array) -> InsertResult:
        """Insert the request's tokens ``q`` (prompt and anything generated after it, all with KV written) and close
        the lease: the new suffix is cached, duplicate blocks released, the lock dropped.

        Raises:
            InvalidTokensError: ``q`` does not start with the lease's matched prefix (the lease stays open).
            InvalidArgumentError: the tokens need more blocks than the lease holds (the lease stays open).
            LockError: the lease is closed.
        """
        self.check_lease(lease, "commit")
        m = lease.num_cached_tokens
        prompt = lease.token_ids
        shared = min(len(q), len(prompt))
        if len(q) < m or q[:shared] != prompt[:shared]:
            raise InvalidTokensError(
                "committed tokens must start with the prefix the lease matched and agree with its prompt: the "
                "prompt (or a prefix of it at least as long as the match) followed by tokens computed after it"
            )
        table = self.blocks.as_block_ids(lease.block_table)
        result = self.blocks.insert(q, table, lease.first_owned_block, lease.namespace, lease.request_id)
        lease.closed = True
        self.locks.unlock(lease.lock)
        return result

    def release(self, lease: Lease) -> None:
        """Drop a lease without caching anything: free its own blocks and unlock its prefix.

        Raises:
            LockError: the lease is already closed, or its blocks were given away directly (its lock is released).
        """
        self.check_lease(lease, "release", closed_message="lease released twice")
        lease.closed = True
        owned = lease.block_table[lease.first_owned_block :].astype(np.intp)
        flags = self.blocks.owned
        if not flags[owned].all():
            self.locks.unlock(lease.lock)
            raise LockError(
                "the lease's own blocks were already given away (inserted or freed directly); its lock is "
                "released, its blocks left with their holders"
            )
        flags[owned] = False
        self.blocks.pool.decref(owned)
        self.locks.unlock(lease.lock)

    def check_lease(self, lease: Lease, what: str, closed_message: str | None = None) -> None:
        """Raises LockError unless ``lease`` is an open lease of this cache whose lock is still held."""
        if not isinstance(lease, Lease) or lease.lock.owner is not self.owner:
            raise LockError(f"{what} takes a Lease returned by this cache's acquire()")
        if lease.closed:
            raise LockError(closed_message or f"{what} on a closed lease")
        if lease.lock.released:
            raise LockError(f"{what} on a lease whose lock was released directly; release() it")
