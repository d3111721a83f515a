"""prefixcache: exact prefix caching for LLM inference.

Token ids -> radix tree match -> block table -> model prefill/decode -> tree insert.
"""

from prefixcache.errors import (
    CapacityError,
    InvalidArgumentError,
    InvalidTokensError,
    LockError,
    NamespaceError,
    OutOfBlocksError,
    PrefixCacheError,
)
from prefixcache.evictor import LFUPolicy, LRUPolicy
from prefixcache.pool import KVBlockPool
from prefixcache.radix import CacheStats, InsertResult, Lease, LockHandle, MatchResult, RadixCache

__version__ = "0.1.0"

__all__ = [
    "CacheStats",
    "CapacityError",
    "InsertResult",
    "InvalidArgumentError",
    "InvalidTokensError",
    "KVBlockPool",
    "LFUPolicy",
    "LRUPolicy",
    "Lease",
    "LockError",
    "LockHandle",
    "MatchResult",
    "NamespaceError",
    "OutOfBlocksError",
    "PrefixCacheError",
    "RadixCache",
]
