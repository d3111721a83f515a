"""Admission: a request's hold on the cache, from its prompt's match to the insert of what it computed.

:meth:`Admission.acquire` matches at most ``len - 1`` prompt tokens (the last prompt token is always computed: its
logits start decoding), locks the whole blocks of the match, and copies the rows of a partially matched last block
into a block the request owns.  That copy is *copy-on-write* as in vLLM's PagedAttention (Kwon et al., "Efficient
Memory Management for Large Language Model Serving with PagedAttention", 2023): a shared block is not written in
place when its later rows belong to another sequence.  When they belong to nobody (the match takes all of a node that
ends inside its last block, no child shares that block and no other request extends it), the request writes the
block's free rows in place and owns the block beside the node (``extending`` in :mod:`prefixcache.cache.blocks`):
no copy, no extra block, and its insert makes the new leaf share the block.  :meth:`Admission.reserve` grows the
request's block table, :meth:`Admission.commit` inserts the request's tokens and unlocks, :meth:`Admission.release`
gives everything back after a failure.  Callers hold the cache's mutex.

Feasibility first.  With the number of tokens to admit, :meth:`Admission.acquire` counts the blocks the request needs
beyond its shared prefix against free plus evictable blocks before it evicts or copies anything, and refuses with
:class:`~prefixcache.errors.PoolBusyError` (or :class:`~prefixcache.errors.CapacityError` past the pool's size).  A
refused request counts in ``rejected_requests`` and nowhere else.

No double pin at a mid-block seam.  A lock pins whole nodes.  Where a cached sequence was extended from inside a block,
the parent node holds one copy of that block and the child its own (copy-on-write), so locking a path through the child
used to pin both: a prompt of exactly the pool's size could need one block more than the pool, forever.  The fix is to
remove the duplicate rather than to lock around it: :meth:`~prefixcache.cache.seams.SeamHealing.heal_seam` lets the
parent share the child's copy (same tokens, same KV rows) and frees its own, at insert and for every seam on a matched
path before it is locked.  Locking less (only up to the first seam) would have meant copying every block after a seam,
which in a multi-turn chat is every turn.  A heal may happen under the request's own lock (its table holds the child's
copy, not the parent's).  Where two branches leave one block at the same point, the branch sharing the parent's copy
blocks the other's heal until it is evicted; the request's lock would then pin both copies for its whole life, so a
request of exactly the pool's size failed mid-decode.  Admission therefore heals again whenever it allocates, counts
such blocked seams as blocks it can get back, and when only they make up the difference evicts every unlocked node first
(allocation would have evicted them all anyway).  A seam is left only while another running request locks the parent's
copy or the sibling sharing it; then that request is running, and the guarantee is for a pool with nothing else running.

Resume points.  A cache of a recurrent (hybrid or state-space) model resumes a prefix only where a state is kept
(:mod:`prefixcache.cache.resume`): with ``states`` set, :meth:`Admission.acquire` ends the match at the deepest kept
state at or before the longest token match, marks the position where the prompt leaves a cached sequence that goes
on when no state stands there (:mod:`prefixcache.cache.marks`), and hands the request the marked positions it will
prefill through (``Lease.state_points``), where it should keep states.  Without, it pays one test.

What a request hands the tree while its lease is open (:meth:`~prefixcache.cache.handover.Handover.insert_prefix`,
recurrent states, blocks extended in place) is :mod:`prefixcache.cache.handover`'s job, a part of :class:`Admission`;
the :class:`~prefixcache.cache.lease.Lease` record is in :mod:`prefixcache.cache.lease`.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from prefixcache.cache.blocks import BlockLedger
from prefixcache.cache.handover import Handover
from prefixcache.cache.lease import Lease
from prefixcache.cache.locks import LockHandle, LockRegistry
from prefixcache.cache.pool import check_count
from prefixcache.cache.results import InsertResult, Promotion
from prefixcache.cache.stats import HitCounters
from prefixcache.cache.tree import RadixTree
from prefixcache.errors import CapacityError, LockError, OutOfBlocksError

if TYPE_CHECKING:
    from prefixcache.cache.node import Node
    from prefixcache.cache.resume import StateStore


class Admission(Handover):
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
        # Set by a cache with a host-memory tier: the tier's promote(q, namespace, num_tokens), bound to this cache,
        # which brings host blocks continuing q's device match back into the tree before the match.
        self.promote: Callable[[array, str | None, int | None], Promotion | None] | None = None
        self.states: StateStore | None = None  # set by a cache that resumes recurrent states

    def acquire(
        self,
        q: array,
        namespace: str | None,
        request_id: str | None,
        num_tokens: int | None = None,
        counted: bool = True,
    ) -> Lease:
        """Match, lock and copy-on-write for the prompt ``q`` (see the module docstring).  If not even one block
        can be found for the copy, those rows are left to be recomputed (``num_cached_tokens`` drops to the block
        boundary) rather than failing the request.

        With ``num_tokens`` the lease's block table is also grown to address that many tokens, and admission checks
        feasibility first: the blocks the request needs beyond its shared prefix must be covered by free plus
        evictable blocks, else it raises before evicting or copying anything.  A refused request counts in
        ``rejected_requests``; an admitted one counts its query and one request in the hit window (neither when not
        ``counted``: a preempted request resuming).

        Exception-safe: whatever raises inside (a fault anywhere below included), the lock, the copy-on-write
        block, the temporary reference on its source and every allocated block are given back.

        Raises:
            CapacityError: ``num_tokens`` need more blocks than the pool has.
            PoolBusyError: running requests hold what the request would need (nothing evicted).
        """
        tree = self.tree
        bs = self.block_size
        pool = self.blocks.pool
        if num_tokens is not None and -(-num_tokens // bs) > pool.num_blocks:
            self.counters.rejected_requests += counted
            raise CapacityError(
                f"{num_tokens} tokens need {-(-num_tokens // bs)} blocks; "
                f"the pool holds {pool.num_blocks} blocks of {bs} tokens"
            )
        promotion = None if self.promote is None else self.promote(q, namespace, num_tokens)
        match = tree.match(q, namespace, len(q) - 1, self.owner, refresh_partial=False)
        num_matched = match.num_tokens
        states = self.states
        resume_state = None
        state_points: tuple[int, ...] = ()
        if states is not None:
            resume_at, resume_state = states.deepest(match.node, num_matched)
            if resume_at < num_matched:
                node = match.node
                if num_matched < len(q) - 1 and (num_matched < node.end or node.children):
                    # q leaves a cached sequence that goes on: a branch point (not the end of a sequence it extends).
                    states.marks.mark(node, num_matched)
                state_points = states.marks.between(match.node, resume_at, num_matched)
                match = tree.match(q, namespace, resume_at, self.owner, touch=False)
        self._heal_path(match.node)
        # Ours to change: the match concatenated its nodes' blocks into a new array (or gave the empty one, which
        # has nothing to write to).
        table = match.block_table
        num_cached = match.num_tokens
        shortfall = num_matched - num_cached
        copied = num_cached % bs
        aligned = num_cached - copied
        own = tree.own_tokens(match.node, num_cached, request_id) if request_id is not None else 0
        in_place = bool(copied) and self._extendable(match.node, num_cached)
        end = match.node if in_place else tree.lock_point(match.node, aligned, stamp=tree.clock)
        handle: LockHandle | None = None
        borrowed: int | None = None  # the copy source while it holds a temporary reference
        owned: list[np.ndarray] = []  # blocks allocated (or taken over) for this lease so far
        try:
            handle = self.locks.lock(end)
            first_owned = len(table) - (1 if copied else 0)
            if num_tokens is not None:
                need = max(-(-num_tokens // bs), len(table)) - len(table) + (bool(copied) and not in_place)
                if need > pool.num_free_blocks:
                    self.blocks.check_feasible(
                        need, f"admitting {num_tokens} tokens", own_locked=first_owned, healable=self._waiting(end)
                    )
            if in_place:
                # The block's later rows are free: the request writes them, the node keeps reading its own.
                block = int(table[-1])
                pool.incref([block])
                owned.append(table[-1:])
                self.blocks.owned[block] = self.blocks.extending[block] = True
                copied = 0
            elif copied:
                source = int(table[-1])
                pool.incref([source])
                borrowed = source
                try:
                    self._make_room(end, 1)
                    private = self.blocks.allocate(1, "copy-on-write")
                except OutOfBlocksError:
                    private = None
                if private is not None:
                    owned.append(private)
                    pool.copy_rows(source, int(private[0]), copied)
                    pool.decref([source])
                    borrowed = None
                    table[-1] = private[0]
                elif pool.ref_count(source) == 1:
                    # Eviction took the source's node while we held it: the block is ours, nothing to copy.
                    self.blocks.owned[source] = True
                    borrowed = None
                    owned.append(table[-1:])
                else:
                    # Too tight to copy: recompute those rows instead of failing the request.
                    pool.decref([source])
                    borrowed = None
                    table = table[:-1]
                    num_cached, copied = aligned, 0
                    if states is not None:
                        # The state at the match is of no use without its last rows: back to one on a boundary.
                        num_cached, resume_state = _block_boundary_state(states, end, aligned, bs)
                        table = table[: num_cached // bs]
                        first_owned = len(table)
                    own = 0
                    if request_id is not None:
                        own = tree.own_tokens(_holding(end, num_cached), num_cached, request_id)
            if num_tokens is not None and -(-num_tokens // bs) > len(table):
                count = -(-num_tokens // bs) - len(table)
                self._make_room(end, count)
                extra = self.blocks.allocate(count, f"admitting {num_tokens} tokens")
                owned.append(extra)
                table = np.concatenate((table, extra))
                # Eviction may have taken the sibling that kept a seam on the path from healing.
                self._heal_path(end)
            lease = Lease(q, namespace, num_cached, copied, table, first_owned, handle, bs)
            lease.request_id = request_id
            lease.num_matched_tokens = num_matched
            if states is not None:
                lease.resume_state = resume_state
                lease.resume_shortfall_tokens = shortfall
                lease.state_points = state_points
                if counted:
                    states.shortfall_tokens += shortfall
                    if num_cached:  # a resume adds to the state's value once admitted (not on every refused retry)
                        states.resumed(match.node, num_cached)
            if promotion is not None:
                lease.num_host_tokens = promotion.host_tokens(num_cached)
            if counted:
                self.counters.host_hit_tokens += lease.num_host_tokens
                self.counters.record_query(len(q), num_cached, own)
                self.counters.record_request(len(q), num_cached - own)
        except BaseException as error:
            if isinstance(error, OutOfBlocksError):  # counted first: an undo that raises still leaves it refused
                self.counters.rejected_requests += counted
            self._undo(handle, borrowed, owned)
            raise
        return lease

    def _extendable(self, node: Node, num_cached: int) -> bool:
        """Whether a match of ``num_cached`` tokens ending inside a block may write its later rows in place: the match
        takes all of ``node``, whose last block it is, and no child shares that block nor another lease writes it."""
        extended = self.blocks.extending[node.blocks.item(-1)] if node.parent is not None else True
        return node.end == num_cached and node.sharing_child is None and not extended

    def _heal_path(self, node) -> None:
        # A seam on the matched path would make the lock pin two copies of one block (see cache.seams).
        bs = self.block_size
        tree = self.tree
        while node.parent is not None:
            if node.start % bs and not node.shares_first and node.parent.parent is not None:
                tree.heal_seam(node)
            node = node.parent

    def _waiting(self, node) -> int:
        # Seams on the locked path that would heal (each giving a block back) once every unlocked node is evicted.
        count = 0
        while node.parent is not None:
            count += self.tree.seam_waits_for_eviction(node)
            node = node.parent
        return count

    def _make_room(self, node, num_blocks: int) -> None:
        """Before allocating ``num_blocks`` for a lease locked at ``node``: heal the seams on its path, and when the
        pool is short of even free plus evictable blocks but the seams that eviction would unblock make up the
        difference, evict every unlocked node (allocation would evict them all anyway) and heal those too.  Evicts
        nothing when even that would not be enough, so the allocation's PoolBusyError leaves the cache as it was.
        A seam blocked by an unlocked sibling pins a duplicate block under the lock; its sibling goes last in
        policy order or not at all (a leaf sharing its first block frees nothing), so eviction alone cannot count
        on it."""
        pool, tree = self.blocks.pool, self.tree
        if num_blocks <= pool.num_free_blocks:
            return
        self._heal_path(node)
        short = num_blocks - pool.num_free_blocks - tree.evictable_blocks
        if short > 0 and short <= self._waiting(node):
            tree.evict(pool.num_blocks)
            self._heal_path(node)

    def _undo(self, handle: LockHandle | None, borrowed: int | None, owned: list[np.ndarray]) -> None:
        # Every step runs however an earlier one raises; pool.release repeats an interrupted decref once.
        try:
            if borrowed is not None:
                self.blocks.pool.release([borrowed])
        finally:
            try:
                if owned:
                    index = np.concatenate(owned).astype(np.intp)
                    self.blocks.owned[index] = self.blocks.extending[index] = False
                    self.blocks.pool.release(index)
            finally:
                if handle is not None:
                    self.locks.unlock(handle)

    def reserve(self, lease: Lease, num_tokens: int) -> np.ndarray:
        """Grow the lease's block table to address ``num_tokens`` tokens (evicting if needed); returns the table.

        Raises:
            InvalidArgumentError: ``num_tokens`` is not a non-negative int.
            CapacityError: ``num_tokens`` exceed the whole pool.  OutOfBlocksError: as ``allocate``.
            LockError: the lease is closed.
        """
        self.check_lease(lease, "reserve")
        num_tokens = check_count(num_tokens, "num_tokens")
        bs = self.block_size
        need = -(-num_tokens // bs) - len(lease.block_table)
        if need > 0:
            pool = self.blocks.pool
            if -(-num_tokens // bs) > pool.num_blocks:
                raise CapacityError(
                    f"{num_tokens} tokens need {-(-num_tokens // bs)} blocks; "
                    f"the pool holds {pool.num_blocks} blocks of {bs} tokens"
                )
            # A seam on the locked path that eviction has since unblocked gives its duplicate block back.
            self._make_room(lease.lock.node, need)
            lease.block_table = np.concatenate((lease.block_table, self.blocks.allocate(need, "reserve")))
        return lease.block_table

    def shrink(self, lease: Lease, num_tokens: int) -> int:
        """Give back the lease's own blocks past those addressing ``num_tokens`` tokens: blocks reserved for tokens
        the request will not keep (the rejected part of a speculative draft).  The blocks of the lease's prompt (its
        matched prefix among them) and the blocks handed to the tree stay.  Returns the blocks freed.
        O(blocks given back).

        Raises:
            InvalidArgumentError: ``num_tokens`` is not a non-negative int.  LockError: the lease is closed.
        """
        self.check_lease(lease, "shrink")
        num_tokens = check_count(num_tokens, "num_tokens")
        keep = max(-(-max(num_tokens, len(lease.token_ids)) // self.block_size), lease.first_owned_block)
        if not lease.owns_blocks or keep >= len(lease.block_table):
            return 0
        freed = self.blocks.free(lease.block_table[keep:])
        lease.block_table = lease.block_table[:keep].copy()  # a new array: holders of the old one see the change
        return freed

    def commit(self, lease: Lease, q: array, state: object = None, nbytes: int = 0) -> InsertResult:
        """Insert the request's tokens ``q`` (prompt and anything generated after it, all with KV written) and close
        the lease: the new suffix is cached, duplicate blocks released, the lock dropped.  ``state`` (``nbytes``
        bytes, checked by the caller), when not None, is kept at position ``len(q)``.

        Raises:
            InvalidTokensError: ``q`` does not start with the lease's matched prefix (the lease stays open).
            InvalidArgumentError: the tokens need more blocks than the lease holds (the lease stays open).
            LockError: the lease is closed.
        """
        self.check_lease(lease, "commit")
        self._check_committed(lease, q)
        first = lease.first_owned_block
        # The lock's path spells the lease's first tokens, which q agrees with (checked above): the tree's walk
        # starts there, and the borrowed blocks, the locked path's own, need no check (insert never reads them).
        start = lease.lock.node if lease.lock.node.end <= len(q) else None
        keep = self._settle_extension(lease, q)
        owned = self.blocks.as_block_ids(lease.block_table[first:])
        try:
            result = self.blocks.insert_owned(q[:keep], owned, first, lease.namespace, lease.request_id, start)
        except BaseException:
            if owned.size and not self.blocks.owned[owned].any():
                # Only giving a block back raised, after the insert: release() has only the lock left to drop.
                lease.owns_blocks = False
            raise
        # The lease owns nothing now; should the unlock fail, release() only has the lock left to drop.
        lease.owns_blocks = False
        if state is not None:
            self.keep_state(q, lease.namespace, len(q), state, nbytes)
        self.locks.unlock(lease.lock)
        lease.closed = True
        # Eviction during this request may have left a seam that only this request's lock kept from healing.
        self._heal_path(lease.lock.node)
        return result

    def release(self, lease: Lease) -> None:
        """Drop a lease without caching anything: free its own blocks and unlock its prefix.

        Raises:
            LockError: the lease is already closed, or its blocks were given away directly (its lock is released).
        """
        self.check_lease(lease, "release", closed_message="lease released twice")
        owned = lease.block_table[lease.first_owned_block if lease.owns_blocks else len(lease.block_table) :]
        owned = owned.astype(np.intp)
        flags = self.blocks.owned
        if not flags[owned].all():
            lease.closed = True
            self.locks.unlock(lease.lock)
            raise LockError(
                "the lease's own blocks were already given away (inserted or freed directly); its lock is "
                "released, its blocks left with their holders"
            )
        # Each step leaves the lease consistent, so a release that raises midway can be called again.
        self.blocks.pool.decref(owned)
        flags[owned] = self.blocks.extending[owned] = False
        lease.owns_blocks = False
        self.locks.unlock(lease.lock)
        lease.closed = True
        self._heal_path(lease.lock.node)


def _holding(node: Node, num_tokens: int) -> Node:
    """The node on the path to ``node`` that holds token ``num_tokens - 1`` (the root when ``num_tokens == 0``)."""
    while node.parent is not None and node.start >= num_tokens:
        node = node.parent
    return node


def _block_boundary_state(states: StateStore, node: Node, limit: int, block_size: int) -> tuple[int, object]:
    """The deepest kept state at a block boundary at or before ``limit`` on the path to ``node``: ``(0, None)``
    when there is none.  O(depth + states) per state passed over."""
    pos, state = states.deepest(node, limit)
    while pos % block_size:
        pos, state = states.deepest(node, pos - 1)
    return pos, state
