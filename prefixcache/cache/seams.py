"""Seams: one block's rows held twice where an edge starts inside a block, and how the tree removes the duplicate.

Seams.  When a request extends a cached sequence that ends inside a block, the new leaf's first block is the
request's own copy of that block (copy-on-write), so the parent's last block and the leaf's first block hold the same
rows twice.  A lock through the leaf would pin both, and a prompt that fits an empty pool could need one block more
than the pool has (issue 11).  :meth:`SeamHealing.heal_seam` removes the duplicate: when no lock other than those
through the leaf is on the parent's copy (a match through the leaf reads the leaf's copy), the parent switches to the
leaf's copy, whose first rows are the same tokens' KV, and its own copy is freed.  Insert heals the seam it creates,
admission heals the seams on a matched path before locking it and again, under its own lock, when it allocates.  A
sibling sharing the parent's copy (two branches inside one block) blocks the heal until eviction takes it, which is
why admission heals after evicting, and counts such seams as blocks it can get back
(:meth:`SeamHealing.seam_waits_for_eviction`).  A seam stays only while another running request needs the parent's copy.

Two things keep seams from appearing at all.  A request whose match takes all of a node ending inside that node's
last block writes the block's later rows in place, with no copy, when nothing else holds rows past the node's end
(admission's ``_extendable``; the block is then flagged ``extending`` in :mod:`prefixcache.cache.blocks`), and its
insert makes the new leaf share that block (:meth:`SeamHealing.check_unshared`).  And when eviction removes the child
that shared its parent's last block, another child's seam under that parent heals at once
(:meth:`SeamHealing.heal_a_child`), so the duplicate goes with the leaf, as a block-level LRU would drop it.

:class:`SeamHealing` is a part of :class:`~prefixcache.cache.tree.RadixTree` (a mixin: it uses the tree's
``block_size``, ``pool``, ``evictable_blocks`` and ``retention``).  Callers hold the cache's mutex.
"""

from __future__ import annotations

from prefixcache.cache.node import Node
from prefixcache.errors import InvalidArgumentError


class SeamHealing:
    """The tree's seam operations (see the module docstring).  Every method is O(length of the sharing chain) or,
    for :meth:`heal_a_child`, O(children) at most."""

    @staticmethod
    def check_unshared(node: Node) -> bool:
        """Raise InvalidArgumentError when ``node``'s last block is shared with a child already: two children
        extending one block in place would write the same rows (admission lets only one do it).  True otherwise."""
        if node.sharing_child is not None:
            raise InvalidArgumentError(
                f"block {node.blocks.item(-1)} is extended in place, but another child already shares it"
            )
        return True

    def heal_seam(self, node: Node) -> bool:
        """Remove the duplicate block at a seam (see the module docstring): ``node`` starts inside a block of which
        it holds its own copy while its parent holds another.  Returns whether it healed (see
        :meth:`share_parent_block` for when it does).  O(length of the sharing chain)."""
        if (
            node.shares_first
            or not node.start % self.block_size
            or not self.share_parent_block(node.parent, node.blocks.item(0), node.lock_count)
        ):
            return False
        self.link_sharing(node.parent, node)
        if node.lock_count == 0:
            self.evictable_blocks -= 1
        if node.priority:
            self.retention.removed(node, 0, 1)
        return True

    def heal_a_child(self, parent: Node) -> bool:
        """After the child sharing ``parent``'s last block left: let another unlocked child starting inside that
        block share it instead of its own copy (:meth:`heal_seam`), the first that can.  Returns whether one did.
        Unlocked only, so that eviction frees evictable blocks alone (admission heals under its own locks).
        O(children) at most, one test mostly."""
        if not self.a_child_can_heal(parent):
            return False
        return any(not child.lock_count and self.heal_seam(child) for child in list(parent.children.values()))

    def a_child_can_heal(self, parent: Node) -> bool:
        """Whether :meth:`heal_a_child` would heal a seam below ``parent`` now (changes nothing)."""
        if parent.parent is None or not parent.end % self.block_size or parent.sharing_child is not None:
            return False
        if parent.lock_count or _old_copy_holders(parent)[-1].lock_count:
            return False
        return any(not child.shares_first and not child.lock_count for child in parent.children.values())

    def seam_waits_for_eviction(self, node: Node) -> bool:
        """Whether the seam at ``node`` would heal once every unlocked node is evicted: it is a seam, and the only
        thing in the way is another child, unlocked, that shares the parent's copy.  O(length of the sharing
        chain)."""
        parent = node.parent
        if node.shares_first or not node.start % self.block_size or parent is None or parent.parent is None:
            return False
        other = parent.sharing_child
        if other is None or other is node or other.lock_count or parent.lock_count != node.lock_count:
            return False
        return _old_copy_holders(parent)[-1].lock_count == node.lock_count

    def share_parent_block(self, parent: Node, block: int, child_locks: int = 0) -> bool:
        """Make ``parent`` hold ``block`` (a child's copy of its last block) instead of its own copy, and free that
        copy.  The ancestors sharing that copy with ``parent`` (splits inside one block) switch with it.  Only when
        nothing else depends on the old copy: the parent is not the root, no other child shares it, and every lock
        on the sharing chain is one of the ``child_locks`` locks through the child.  A lock through the child pins a
        match that went on into the child, whose block table took the child's copy for that block (see
        :meth:`match`), so no running request reads the old copy; any other lock might.  Atomic: raises with nothing
        changed, or switches.  O(length of the sharing chain)."""
        if parent.parent is None or parent.lock_count != child_locks or parent.sharing_child is not None:
            return False
        chain = _old_copy_holders(parent)
        if chain[-1].lock_count != child_locks:
            return False
        old = parent.blocks.item(-1)
        pool = self.pool
        added = removed = 0
        try:
            for _ in chain:
                pool.incref([block])
                added += 1
            for _ in chain:
                pool.decref([old])
                removed += 1
        except BaseException:
            for _ in range(removed):
                pool.incref([old])
            for _ in range(added):
                pool.decref([block])
            raise
        for holder in chain:
            holder.blocks[-1] = block
        return True

    def link_sharing(self, parent: Node, child: Node) -> None:
        """Record that ``child``'s first block is now ``parent``'s last (after :meth:`share_parent_block`)."""
        child.shares_first = True
        child.num_own_blocks = len(child.blocks) - 1
        parent.sharing_child = child


def _old_copy_holders(parent: Node) -> list[Node]:
    """``parent`` and the ancestors holding its last block too (splits inside one block: upward while that block is
    also a node's first and only one).  O(length of that chain)."""
    chain = [parent]
    while len(chain[-1].blocks) == 1 and chain[-1].shares_first:
        chain.append(chain[-1].parent)
    return chain
