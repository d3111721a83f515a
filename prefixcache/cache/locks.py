"""Locks on matched paths: a handle per lock, so each is released exactly once and never by another cache.

A lock on a node holds that node and all its ancestors out of eviction (lock counts on the path, kept by
:meth:`~prefixcache.cache.tree.RadixTree.lock_path`); the registry here knows every live handle, which is what
:func:`~prefixcache.cache.invariants.check_invariants` recounts the lock counts from.  Callers hold the cache's mutex.
"""

from __future__ import annotations

import itertools

from prefixcache.cache.node import Node
from prefixcache.cache.tree import RadixTree
from prefixcache.errors import LockError


class LockHandle:
    """Proof that a matched path is locked; give it back to :meth:`~prefixcache.RadixCache.unlock` exactly once."""

    __slots__ = ("handle_id", "node", "released", "owner")

    def __init__(self, handle_id: int, node: Node, owner: object = None) -> None:
        self.handle_id = handle_id
        self.node = node
        self.released = False
        self.owner = owner  # the RadixCache that issued it: handles never cross caches


class LockRegistry:
    """The live lock handles of one cache (``handles``, by id).  Lock and unlock are O(depth)."""

    def __init__(self, tree: RadixTree, owner: object) -> None:
        self.tree = tree
        self.owner = owner
        self.handles: dict[int, LockHandle] = {}
        self._ids = itertools.count(1)

    def lock(self, node: Node, num_tokens: int = 0) -> LockHandle:
        """Lock the path ending at ``node``, which must still hold the first ``num_tokens`` tokens of the path.

        Raises:
            LockError: the node was evicted, or block-granular eviction shortened it below ``num_tokens`` (a stale
                match).
        """
        if node.evicted or node.end < num_tokens:
            if node.evicted:
                raise LockError("cannot lock a stale match: its node was evicted after the match; match again")
            raise LockError("cannot lock a stale match: eviction shortened it after the match; match again")
        handle = LockHandle(next(self._ids), node, self.owner)
        self.tree.lock_path(node)
        self.handles[handle.handle_id] = handle
        return handle

    def unlock(self, handle: LockHandle) -> None:
        """Release ``handle``'s lock.

        Raises:
            LockError: not a handle, another cache's handle, or released already (nothing changes).
        """
        if not isinstance(handle, LockHandle):
            raise LockError(f"unlock takes the LockHandle returned by lock(), got {type(handle).__name__}")
        if handle.owner is not self.owner:
            raise LockError("this lock handle was issued by another cache")
        if handle.released or handle.handle_id not in self.handles:
            raise LockError("lock handle released twice")
        self.tree.unlock_path(handle.node)  # first: should it raise, the handle is still live and can be retried
        handle.released = True
        del self.handles[handle.handle_id]

    def move(self, old: LockHandle, new: LockHandle) -> LockHandle:
        """Unlock ``old`` for ``new`` (locked already) and return ``new``; should that unlock raise, ``new`` is
        unlocked and ``old`` stays held, so that its owner (a lease) still holds exactly one lock."""
        try:
            self.unlock(old)
        except BaseException:
            self.unlock(new)
            raise
        return new


class ChangeGuard:
    """``with guard:`` holds the cache's mutex for a call that changes the cache, and refuses the call when it comes
    from a KV event listener.  Events go out while the call that sent them is still under way (an insert_prefix has
    yet to lock what it inserted), so a listener evicting, admitting or locking there would change the tree under it.
    Reading (match, stats, cached_length) and subscribing stay allowed.  ``events.emitting`` can only be nonzero for
    the thread holding the mutex, so it is read once the mutex is held."""

    __slots__ = ("_mutex", "_events")

    def __init__(self, mutex, events) -> None:
        self._mutex = mutex
        self._events = events

    def __enter__(self) -> None:
        self._mutex.acquire()
        if self._events.emitting:
            self._mutex.release()
            raise LockError(
                "the cache cannot be changed from inside a KV event listener (the call that sent the event is still "
                "under way); make the change after that call returns"
            )

    def __exit__(self, *exc_info: object) -> None:
        self._mutex.release()
