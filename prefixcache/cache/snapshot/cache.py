"""A whole cache's snapshots: :class:`CacheSnapshots`, the save, capture, restore and load methods of
:class:`~prefixcache.RadixCache`, which put the device tree's part (:mod:`~prefixcache.cache.snapshot.tree`) and the
host tier's part (:mod:`~prefixcache.cache.snapshot.host`) together under the cache's mutex.

:class:`CacheSnapshots` is a part of :class:`~prefixcache.RadixCache` (a mixin: it uses the cache's ``pool``, its
mutex and change guard, its tree, block ledger and host tier).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from prefixcache.cache.host import events as host_events
from prefixcache.cache.snapshot import host as host_snapshot
from prefixcache.cache.snapshot import states as saved_states
from prefixcache.cache.snapshot import tree as snapshot
from prefixcache.cache.snapshot import writer as snapshot_write
from prefixcache.cache.snapshot.staging import StagingBuffer
from prefixcache.errors import SnapshotError

if TYPE_CHECKING:
    from prefixcache.cache.blocks import BlockLedger
    from prefixcache.cache.host.tier import HostTier
    from prefixcache.cache.locks import ChangeGuard
    from prefixcache.cache.pool import KVBlockPool
    from prefixcache.cache.tree import RadixTree

_Cache = TypeVar("_Cache", bound="CacheSnapshots")


class CacheSnapshots:
    """The snapshot methods of :class:`~prefixcache.RadixCache` (see the module docstring)."""

    pool: KVBlockPool
    _mutex: threading.RLock
    _change: ChangeGuard
    _tree: RadixTree
    _blocks: BlockLedger
    _host: HostTier | None

    def save(
        self,
        directory: str | os.PathLike[str],
        *,
        identity: Mapping[str, str] | None = None,
        keep_namespace: Callable[[str | None], bool] | None = None,
    ) -> snapshot.SnapshotSummary:
        """:meth:`capture`, then write it into the snapshot folder ``directory`` atomically
        (:func:`~prefixcache.cache.snapshot.writer.write`): the previous snapshot stays current until the new one is
        durable.  The mutex is held during the copy only.  O(cached tokens) plus the copy and the write of its blocks.

        Raises:
            SnapshotWriteError: a write or sync failed (also an OSError); the previous snapshot is kept.
            SnapshotError: safetensors is missing.
        """
        return snapshot_write.write(self.capture(identity=identity, keep_namespace=keep_namespace), directory)

    def capture(
        self,
        *,
        identity: Mapping[str, str] | None = None,
        keep_namespace: Callable[[str | None], bool] | None = None,
        staging: StagingBuffer | None = None,
    ) -> snapshot.Snapshot:
        """A consistent copy of the cached tree and its K/V in host memory, for
        :func:`~prefixcache.cache.snapshot.writer.write` (on any thread: nothing the cache does later reaches it).
        ``identity`` (e.g. model and tokenizer fingerprints) is stored for :meth:`restore` to check;
        ``keep_namespace`` picks the namespaces (all when None); a host tier's runs are copied too, and the
        recurrent states kept on the nodes saved (held, not copied: they never change).  ``staging``
        (:func:`~prefixcache.cache.snapshot.staging.staging_for`) holds the copy.  Changes nothing in the cache.
        O(cached tokens) plus one memcpy of the saved blocks, under the mutex."""
        with self._mutex:
            captured = snapshot.capture(self._tree, identity, keep_namespace, staging)
            return host_snapshot.capture(captured, self._host, keep_namespace, staging)

    def restore(
        self,
        directory: str | os.PathLike[str],
        *,
        identity: Mapping[str, str] | None = None,
        replace: bool = False,
        state_loader: saved_states.StateLoader | None = None,
    ) -> snapshot.SnapshotSummary:
        """Load the snapshot in ``directory`` into this cache, which must be empty (``replace=True`` evicts
        everything first, once the snapshot has been read and checked).  When the snapshot holds more than the pool,
        the most recently used whole prefixes that fit are loaded; saved host runs go back into this cache's host tier
        (the most recently used that fit; dropped and counted when it has none).  Every checksum is verified before
        the cache is touched; on any error the cache is left as it was.  A cache that keeps recurrent states gets
        back those of the nodes restored, rebuilt by ``state_loader`` (the model's: a state's tensors on its device;
        without one only tensorless states come back), before anything changes
        (:mod:`~prefixcache.cache.snapshot.states`).

        Raises:
            SnapshotNotFoundError: no snapshot there.  SnapshotCorruptError: truncated, edited or damaged files.
            SnapshotMismatchError: another block size, KV dtype or shape, format version, or ``identity`` value.
            SnapshotError: the cache (device or host tier) is not empty (or locked/owned blocks remain after
                ``replace``, which also drops the host runs).  What ``state_loader`` raises for a state it refuses.
        """
        loaded = snapshot.read(directory)
        snapshot.check_compatible(loaded, self.pool, identity)
        snapshot.check_nodes(loaded, self.pool.block_size)
        saved_states.check(loaded.manifest, set(loaded.states), loaded.path)
        host_snapshot.check(loaded, self.pool.block_size)
        states = None
        if self._tree.states is not None:
            states = saved_states.load(loaded.manifest, loaded.states, state_loader)
        with self._change:
            if replace:
                if self._tree.locked_tokens or self._blocks.num_owned:
                    raise SnapshotError("cannot replace the cache's content while requests hold locks or blocks")
                self._tree.evict(self.pool.num_blocks + 1)
                if self._host is not None:
                    self._host.clear()
            host_plan = host_snapshot.plan(loaded, self._host, self.pool.block_size)
            # The host runs first: the device restore is the step that may refuse (a cache not empty), and undoing it
            # would demote; the host runs are taken out again without a trace.
            host_counts = host_snapshot.apply(loaded, self._host, host_plan)
            try:
                summary = snapshot.restore(loaded, self._tree, states)
            except BaseException:
                host_snapshot.discard(self._host)
                raise
            host_events.announce_held(self._host, self._tree.roots)
            return dataclasses.replace(summary, **host_counts)

    @classmethod
    def load(
        cls: type[_Cache],
        directory: str | os.PathLike[str],
        pool: KVBlockPool,
        *,
        identity: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> _Cache:
        """A new cache over ``pool`` (``kwargs`` as for the constructor) holding the snapshot in ``directory``;
        see :meth:`restore` (``pool`` must have no block in use).  Raises as :meth:`restore`."""
        cache = cls(pool, **kwargs)
        cache.restore(directory, identity=identity)
        return cache
