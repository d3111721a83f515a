"""The cache layer: token ids, the KV block pool, the radix tree and everything that keeps it (eviction, block
ownership, locks, admission, hit accounting, KV events, invariants).  It knows nothing of models.

Two subpackages sit beside that core: :mod:`~prefixcache.cache.host` (the host-memory tier) and
:mod:`~prefixcache.cache.snapshot` (the cache on disk).  The core takes the host tier's moves as hooks, and only
:class:`~prefixcache.cache.radix_cache.RadixCache`, which assembles the parts, imports either.

Data flows token ids -> :mod:`~prefixcache.cache.tree` match -> block table (:mod:`~prefixcache.cache.pool`) ->
the caller's model -> tree insert; :class:`~prefixcache.cache.radix_cache.RadixCache` is the thread-safe face.
"""

from prefixcache.cache.events import AllCleared, BlockIndex, BlockRemoved, BlockStored
from prefixcache.cache.evictor import LFUPolicy, LRUPolicy
from prefixcache.cache.host import make_host_pool
from prefixcache.cache.lease import Lease
from prefixcache.cache.locks import LockHandle
from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.radix_cache import RadixCache
from prefixcache.cache.results import EvictResult, InsertResult, MatchResult
from prefixcache.cache.resume import StateMarker
from prefixcache.cache.snapshot import SnapshotSummary
from prefixcache.cache.stats import CacheStats

__all__ = [
    "AllCleared",
    "BlockIndex",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "EvictResult",
    "InsertResult",
    "KVBlockPool",
    "LFUPolicy",
    "LRUPolicy",
    "Lease",
    "LockHandle",
    "MatchResult",
    "RadixCache",
    "SnapshotSummary",
    "StateMarker",
    "make_host_pool",
]
