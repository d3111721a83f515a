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
state at or before the longest token match, and :meth:`Admission.commit`, :meth:`Admission.insert_prefix` and
:meth:`Admission.put_state` keep the states a request hands over.  Without, each of them pays one test.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from prefixcache.cache.blocks import BlockLedger
from prefixcache.cache.locks import LockHandle, LockRegistry
from prefixcache.cache.pool import check_count
from prefixcache.cache.results import InsertResult
from prefixcache.cache.stats import HitCounters
from prefixcache.cache.tree import RadixTree
from prefixcache.errors import CapacityError, InvalidArgumentError, InvalidTokensError, LockError, OutOfBlocksError

if TYPE_CHECKING:
    from prefixcache.cache.host_tier import HostTier
    from prefixcache.cache.node import Node
    from prefixcache.cache.resume import StateStore


@dataclass(slots=True, eq=False)
class Lease:
    """A request's hold on the cache, from :meth:`~prefixcache.RadixCache.acquire` to
    :meth:`~prefixcache.RadixCache.commit` or :meth:`~prefixcache.RadixCache.release`.

    ``block_table[:first_owned_block]`` are the tree's blocks of the matched prefix (kept alive by ``lock``);
    ``block_table[first_owned_block:]`` are owned by the request (the copy-on-write block of a match ending inside
    a block, then the blocks for the tokens it computes).  ``num_cached_tokens`` prompt tokens need no prefill;
    ``num_copied_tokens`` of them were copied rather than shared, ``num_host_tokens`` of them were promoted from the
    host-memory tier (:mod:`prefixcache.cache.host_tier`) for this request.

    ``num_matched_tokens`` is the longest token match (at most ``len - 1`` prompt tokens).  In a cache that resumes
    recurrent states (:mod:`prefixcache.cache.resume`) the request resumes from ``resume_state``, the state kept at
    position ``num_cached_tokens`` (None at 0: the initial state), and ``resume_shortfall_tokens`` of the matched
    tokens could not be resumed (no state kept at or after them).  Then ``num_cached_tokens == num_matched_tokens -
    resume_shortfall_tokens``, except where copy-on-write found no block: the request then resumes at the deepest
    state at a block boundary.  Without resume states ``resume_state`` is None and the shortfall 0.
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
    # False once the blocks from first_owned_block on are handed to the tree or freed; the lock may still be held.
    owns_blocks: bool = True
    num_host_tokens: int = 0
    num_matched_tokens: int = 0
    resume_state: object | None = None
    resume_shortfall_tokens: int = 0

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
        self.host: HostTier | None = None
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
        promotion = None
        if self.host is not None:
            promotion = self.host.promote(tree, self.blocks, self.locks, q, namespace, num_tokens, self.owner)
        match = tree.match(q, namespace, len(q) - 1, self.owner, refresh_partial=False)
        num_matched = match.num_tokens
        states = self.states
        resume_state = None
        if states is not None:
            resume_at, resume_state = states.deepest(match.node, num_matched)
            if resume_at < num_matched:
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
                if counted:
                    states.shortfall_tokens += shortfall
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

    def _settle_extension(self, lease: Lease, q: array) -> int:
        """Before the insert of ``q``: where the lease extends a cached block in place but ``q``'s cached path now
        runs past that node's end inside the block, through another request's branch holding its own copy of it,
        the new leaf would hang below that branch and cannot share the node's block: give it a copy (the lease's
        rows), the node keeps its block.  Returns how many tokens of ``q`` to insert: all of them, or, with no block
        to be had for the copy, only the cached ones (nothing new is kept; the lease's blocks go back)."""
        first = lease.first_owned_block
        if first >= len(lease.block_table) or not self.blocks.extending[lease.block_table[first]]:
            return len(q)
        block = int(lease.block_table[first])
        if self._grows_at_extended_node(lease, q, block):
            return len(q)  # the new leaf hangs below the extended node and shares its block
        match = self.tree.match(q, lease.namespace, len(q), self.owner, touch=False)
        bs = self.block_size
        inside = first * bs < match.num_tokens < min(len(q), (first + 1) * bs)  # the path's block `first` is partial
        if not inside or int(match.block_table[first]) == block:
            return len(q)
        copy = self.blocks.copy_of(block, bs, "the copy of a block extended in place")
        if copy is None:
            # Eviction may have shortened the branch; what the tree holds now is what may go in.
            return self.tree.match(q, lease.namespace, len(q), self.owner, touch=False).num_tokens
        try:
            self.blocks.pool.decref([block])  # the lease's hold; the node's stays
        except BaseException:
            self.blocks.free(copy)
            raise
        lease.block_table[first] = copy[0]
        self.blocks.owned[block] = self.blocks.extending[block] = False
        return len(q)

    @staticmethod
    def _grows_at_extended_node(lease: Lease, q: array, block: int) -> bool:
        """Whether ``q`` leaves the cached path right at the end of the node whose ``block`` the lease extends in place
        (its lock's node): no child there starts with ``q``'s next token.  O(1), not a walk of the whole path."""
        node = lease.lock.node
        if node.parent is None or node.blocks.item(-1) != block:
            return False
        return node.end >= len(q) or q[node.end] not in node.children

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

    def insert_prefix(self, lease: Lease, q: array, state: object = None, nbytes: int = 0) -> InsertResult:
        """Insert the request's tokens ``q`` (KV written) and keep the lease open: the tree takes the request's
        whole blocks of ``q``, the lease switches to the tree's blocks for them under a lock on the new path, so
        other requests hit ``q`` while this one goes on (SGLang caches a request's prompt when its prefill ends,
        not when it finishes).  The block the request goes on writing, where ``q`` ends inside one, stays the
        request's: the tree gets a copy of its first ``len(q) % block_size`` rows, or (no block to be had for the
        copy) only the whole blocks of ``q``.  :meth:`commit` or :meth:`release` closes the lease as before.
        ``state`` (``nbytes`` bytes, checked by the caller), when not None, is kept at position ``len(q)`` if the tree
        now holds all of ``q``, and dropped (counted) if it holds only the whole blocks of it.

        Raises:
            InvalidTokensError: ``q`` does not start with the lease's matched prefix and agree with its prompt.
            InvalidArgumentError: the tokens need more blocks than the lease holds.
            LockError: the lease is closed.
        Nothing changes when it raises.
        """
        self.check_lease(lease, "insert_prefix")
        self._check_committed(lease, q)
        bs = self.block_size
        n = len(q)
        if -(-n // bs) > len(lease.block_table):
            raise InvalidArgumentError(
                f"{n} tokens need {-(-n // bs)} blocks of {bs} tokens, but the lease holds {len(lease.block_table)}"
            )
        full, rows = divmod(n, bs)
        first_owned = lease.first_owned_block
        if full > first_owned and self._settle_extension(lease, q[: full * bs]) < full * bs:
            full = rows = 0  # no block for the copy the new leaf needs: the tree gets nothing now
        if rows and full == first_owned and self.blocks.extending[lease.block_table[full]]:
            if lease.lock.node.end < n and self._grows_at_extended_node(lease, q, int(lease.block_table[full])):
                return self._insert_extended_prefix(lease, q, state, nbytes)
        if full < first_owned:
            # q ends inside the locked prefix (a longer one went in before): the tree holds it, nothing to copy.
            self._extended_prompt(lease, q, state, nbytes)
            return InsertResult(0, n, 0)
        table = self.blocks.as_block_ids(lease.block_table[:full])
        if rows:
            copy = self.blocks.copy_of(int(lease.block_table[full]), rows, "the copy of a partly written block")
            rows = 0 if copy is None else rows
            table = table if copy is None else np.concatenate((table, copy))
        n = full * bs + rows
        if n <= first_owned * bs:
            # Nothing beyond the locked prefix that a whole block could hold.
            self._extended_prompt(lease, q, state, nbytes)
            return InsertResult(0, n, 0)
        try:
            result = self.blocks.insert(q[:n], table, first_owned, lease.namespace, lease.request_id)
        except BaseException:
            if not self.blocks.owned[table[first_owned:]].any():
                lease.first_owned_block = full  # only giving a duplicate back raised, after the tree took the rest
            elif rows:
                self.blocks.free(table[-1:])
            raise
        tree = self.tree
        lease.first_owned_block = full  # the tree's blocks now: should anything below raise, release() skips them
        if full == first_owned:
            # The lease's table and lock stay: a lock moved up to the block boundary would leave the node of a block
            # extended in place unlocked, evictable (its block counted so, though the lease holds it) and healable.
            self._extended_prompt(lease, q, state, nbytes)
            return result
        # The tree holds q[:n] now (the request's blocks, or equal ones inserted before): lock it before unlocking
        # the old path, so no block of the lease is unprotected in between.
        match = tree.match(q, lease.namespace, full * bs, self.owner)
        handle = self.locks.lock(tree.lock_point(match.node, full * bs))
        lease.lock = self.locks.move(lease.lock, handle)
        lease.block_table[:full] = match.block_table
        self._extended_prompt(lease, q, state, nbytes)
        return result

    def _extended_prompt(self, lease: Lease, q: array, state: object, nbytes: int) -> None:
        # The end of every insert_prefix: q becomes the lease's prompt if longer, and its state is kept if given.
        _extend_prompt(lease, q)
        if state is not None:
            self.keep_state(q, lease.namespace, len(q), state, nbytes)

    def _insert_extended_prefix(self, lease: Lease, q: array, state: object, nbytes: int) -> InsertResult:
        """:meth:`insert_prefix` where ``q`` ends inside the block the lease extends in place, right below that
        block's node: the tree takes ``q`` with the block itself (the new leaf shares it with the node) and the lease
        goes on writing the block's later rows, now past the new leaf's end, under a lock on that leaf."""
        full = len(q) // self.block_size
        block = int(lease.block_table[full])
        table = self.blocks.as_block_ids(lease.block_table[: full + 1])
        try:
            result = self.blocks.insert(q, table, full, lease.namespace, lease.request_id)
            self.blocks.pool.incref([block])  # the lease's hold on the block became the leaf's: take one again
        except BaseException:
            if not self.blocks.owned[block]:
                lease.first_owned_block = full + 1  # the tree's block alone now: release() leaves it there
            raise
        self.blocks.owned[block] = self.blocks.extending[block] = True
        match = self.tree.match(q, lease.namespace, len(q), self.owner)
        lease.lock = self.locks.move(lease.lock, self.locks.lock(match.node))
        self._extended_prompt(lease, q, state, nbytes)
        return result

    def put_state(self, lease: Lease, num_tokens: int, state: object, nbytes: int) -> bool:
        """Keep ``state`` (``nbytes`` bytes, checked by the caller) at position ``num_tokens`` of the lease's prompt
        (or of the longer tokens given to :meth:`insert_prefix`), if the tree holds its first ``num_tokens`` tokens
        (else it is dropped and counted).  Returns whether
        it was kept.  O(depth) plus the O(log n) of the store.

        Raises:
            LockError: the lease is closed.
            InvalidArgumentError: ``num_tokens`` is not an int in ``1 .. len(prompt)`` (the longer of the acquired
                prompt and the tokens given to :meth:`insert_prefix`).
        """
        self.check_lease(lease, "put_state")
        prompt = lease.token_ids
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise InvalidArgumentError(f"num_tokens must be an int, got {num_tokens!r}")
        if not 1 <= num_tokens <= len(prompt):
            raise InvalidArgumentError(f"num_tokens must be in 1..{len(prompt)} (the prompt), got {num_tokens}")
        return self.keep_state(prompt, lease.namespace, int(num_tokens), state, nbytes)

    def keep_state(self, q: array, namespace: str | None, num_tokens: int, state: object, nbytes: int) -> bool:
        """Keep ``state`` at position ``num_tokens`` of ``q`` if the tree holds ``q[:num_tokens]`` in ``namespace``,
        else count it dropped; a state at 0 (the initial one) is ignored.  Returns whether it was kept.  O(depth)."""
        if num_tokens == 0:
            return False
        match = self.tree.match(q, namespace, num_tokens, self.owner, touch=False)
        if match.num_tokens != num_tokens:
            self.states.drop()
            return False
        return self.states.put(match.node, num_tokens, state, nbytes)

    def _check_committed(self, lease: Lease, q: array) -> None:
        prompt = lease.token_ids
        # One slice, of the longer of the two: comparing copies is one memcmp.
        agree = q[: len(prompt)] == prompt if len(q) >= len(prompt) else q == prompt[: len(q)]
        if len(q) < lease.num_cached_tokens or not agree:
            raise InvalidTokensError(
                "committed tokens must start with the prefix the lease matched and agree with its prompt: the "
                "prompt (or a prefix of it at least as long as the match) followed by tokens computed after it"
            )

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

    def check_lease(self, lease: Lease, what: str, closed_message: str | None = None) -> None:
        """Raises LockError unless ``lease`` is an open lease of this cache whose lock is still held."""
        if not isinstance(lease, Lease) or lease.lock.owner is not self.owner:
            raise LockError(f"{what} takes a Lease returned by this cache's acquire()")
        if lease.closed:
            raise LockError(closed_message or f"{what} on a closed lease")
        if lease.lock.released:
            raise LockError(f"{what} on a lease whose lock was released directly; release() it")


def _extend_prompt(lease: Lease, q: array) -> None:
    """After ``q`` went to :meth:`Admission.insert_prefix`: tokens beyond a shorter acquired prompt (a resumed request
    matches a prefix of what it knows) become the lease's prompt, so that :meth:`Admission.put_state` reaches them."""
    if len(q) > len(lease.token_ids):
        lease.token_ids = q


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
