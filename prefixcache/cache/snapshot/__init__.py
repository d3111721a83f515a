"""Snapshots: the cached tree, its K/V and the host tier's runs on disk, so a restarted process starts warm.

- :mod:`~prefixcache.cache.snapshot.tree`: the format (folder layout, ``snapshot.json``, ``kv.safetensors``),
  :class:`Snapshot` (a capture in host memory), :class:`SnapshotSummary`, capturing the device tree, :func:`read`,
  the compatibility checks and restoring a tree;
- :mod:`~prefixcache.cache.snapshot.host`: the host tier's runs saved beside the tree and put back;
- :mod:`~prefixcache.cache.snapshot.writer`: :func:`write`, the atomic commit of a captured snapshot as the folder's
  new current version (on any thread);
- :mod:`~prefixcache.cache.snapshot.folder`, :mod:`~prefixcache.cache.snapshot.manifest`: the folder's lock, reads
  and checksums, and the complete check of a manifest;
- :mod:`~prefixcache.cache.snapshot.staging`: :class:`StagingBuffer` and :func:`staging_for`, host memory made
  ready before a capture so that the copy is a memcpy;
- :mod:`~prefixcache.cache.snapshot.cache`: :meth:`~prefixcache.RadixCache.save`, ``capture``, ``restore`` and
  ``load``, which join the tree's and the host tier's parts under the cache's mutex.

Snapshots read and rebuild the cache's core (pool, tree) and may import the host tier (:mod:`prefixcache.cache.host`);
neither the core below :class:`~prefixcache.RadixCache` nor the host tier imports this package.
"""

from prefixcache.cache.snapshot.staging import StagingBuffer, staging_for
from prefixcache.cache.snapshot.tree import Snapshot, SnapshotSummary, read
from prefixcache.cache.snapshot.writer import write

__all__ = ["Snapshot", "SnapshotSummary", "StagingBuffer", "read", "staging_for", "write"]
