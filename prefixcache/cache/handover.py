"""Handover: what a request gives the tree while it holds a lease, and the checks on what it gives.

A running request hands over tokens with KV written: at :meth:`~prefixcache.cache.admission.Admission.commit` (then
the lease closes) or, still running, at :meth:`Handover.insert_prefix` (its prompt once prefilled, so that other
requests hit it while it decodes; the lease stays open, its lock moved onto the new path).  Either way the tokens must
start with the prefix the lease matched and agree with its prompt (:meth:`Handover._check_committed`), and every lease
handed back must be an open one of this cache (:meth:`Handover.check_lease`).

Blocks extended in place.  A lease that writes the free rows of a cached node's last block in place (``extending`` in
:mod:`prefixcache.cache.blocks`) hands that block over shared with the new leaf, when the leaf hangs right below that
node; when another request's branch has grown through the block meanwhile, the new leaf gets a copy instead
(:meth:`Handover._settle_extension`), so two leaves never write one block's rows.

Recurrent states.  A cache of a recurrent (hybrid or state-space) model resumes a prefix only where a state is kept
(:mod:`prefixcache.cache.resume`): with ``states`` set, commit, :meth:`Handover.insert_prefix` and
:meth:`Handover.put_state` keep the states a request hands over (:meth:`Handover.keep_state`), where the tree holds
their tokens.  Without, each of them pays one test.

:class:`Handover` is a part of :class:`~prefixcache.cache.admission.Admission` (a mixin: it uses the admission's
``tree``, ``blocks``, ``locks``, ``owner``, ``block_size`` and ``states``).  Callers hold the cache's mutex.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

import numpy as np

from prefixcache.cache.lease import Lease
from prefixcache.cache.results import InsertResult
from prefixcache.errors import InvalidArgumentError, InvalidTokensError, LockError

if TYPE_CHECKING:
    from prefixcache.cache.blocks import BlockLedger
    from prefixcache.cache.locks import LockRegistry
    from prefixcache.cache.resume import StateStore
    from prefixcache.cache.tree import RadixTree


class Handover:
    """The lease's handover of tokens, blocks and states to the tree (see the module docstring)."""

    tree: RadixTree
    blocks: BlockLedger
    locks: LockRegistry
    owner: object
    block_size: int
    states: StateStore | None

    def insert_prefix(self, lease: Lease, q: array, state: object = None, nbytes: int = 0) -> InsertResult:
        """Insert the request's tokens ``q`` (KV written) and keep the lease open: the tree takes the request's
        whole blocks of ``q``, the lease switches to the tree's blocks for them under a lock on the new path, so
        other requests hit ``q`` while this one goes on (SGLang caches a request's prompt when its prefill ends,
        not when it finishes).  The block the request goes on writing, where ``q`` ends inside one, stays the
        request's: the tree gets a copy of its first ``len(q) % block_size`` rows, or (no block to be had for the
        copy) only the whole blocks of ``q``.  ``Admission.commit`` or ``release`` closes the lease as before.
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
        lease.extend_prompt(q)
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

    def check_lease(self, lease: Lease, what: str, closed_message: str | None = None) -> None:
        """Raises LockError unless ``lease`` is an open lease of this cache whose lock is still held."""
        if not isinstance(lease, Lease) or lease.lock.owner is not self.owner:
            raise LockError(f"{what} takes a Lease returned by this cache's acquire()")
        if lease.closed:
            raise LockError(closed_message or f"{what} on a closed lease")
        if lease.lock.released:
            raise LockError(f"{what} on a lease whose lock was released directly; release() it")
