"""The host-memory tier: a second, larger block pool in CPU memory that catches what device eviction frees, and
gives it back to a prompt that matches it (promotion) instead of recomputing it.

- :mod:`~prefixcache.cache.host.pools`: the host pool, shaped like the device pool and sized in tokens or bytes
  (:func:`make_host_pool`, :func:`host_pool_for`, :func:`check_host_pool`);
- :mod:`~prefixcache.cache.host.tier`: :class:`HostTier`, the host-resident runs (:class:`HostRun`) in LRU order,
  demotion from the tree's eviction, promotion before admission's match, and their KV events;
- :mod:`~prefixcache.cache.host.events`: announcing runs no listener has heard of (demoted while nobody listened, or
  restored from a snapshot).

The tier sits beside the cache's core, not inside it: the tree and admission take its moves as hooks
(``RadixTree.demote``, ``RadixTree.cover``, ``Admission.promote``) that :class:`~prefixcache.RadixCache` sets when
given a ``host_pool``; only that assembly imports this package.  It imports the core (pool, tree, blocks, locks,
events), never the snapshot package; snapshots save its runs (:mod:`prefixcache.cache.snapshot.host`).
"""

from prefixcache.cache.host.pools import check_host_pool, host_pool_for, make_host_pool
from prefixcache.cache.host.tier import HostRun, HostTier

__all__ = ["HostRun", "HostTier", "check_host_pool", "host_pool_for", "make_host_pool"]
