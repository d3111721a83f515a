"""prefixcache: exact prefix caching for LLM inference.

Token ids -> radix tree match -> block table -> model prefill/decode -> tree insert.  The layers, each a folder
importing only those below it: ``cache`` (tokens, pool, tree, eviction, admission, events) <- ``models`` and
``chat`` (tokenizers, chat templates) <- ``engine`` (runner, sampling) <- ``replay`` and ``bench`` <- ``cli``.
This module is the stable public surface.
"""

from prefixcache.cache import (
    CacheStats,
    EvictResult,
    InsertResult,
    KVBlockPool,
    Lease,
    LFUPolicy,
    LockHandle,
    LRUPolicy,
    MatchResult,
    RadixCache,
    SnapshotSummary,
    StateMarker,
)
from prefixcache.engine import ChatResult, GenerationResult, PrefixCachingRunner, SamplingParams, Usage
from prefixcache.errors import (
    CapacityError,
    InvalidArgumentError,
    InvalidTokensError,
    LockError,
    NamespaceError,
    OutOfBlocksError,
    PoolBusyError,
    PrefixCacheError,
    ScenarioError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotMismatchError,
    SnapshotNotFoundError,
    SnapshotWriteError,
    TemplateError,
    UnsupportedModelError,
    VerificationError,
)

__version__ = "0.1.0"

__all__ = [
    "CacheStats",
    "CapacityError",
    "ChatResult",
    "EvictResult",
    "GenerationResult",
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
    "PoolBusyError",
    "PrefixCacheError",
    "PrefixCachingRunner",
    "RadixCache",
    "SamplingParams",
    "ScenarioError",
    "SnapshotCorruptError",
    "SnapshotError",
    "SnapshotMismatchError",
    "SnapshotNotFoundError",
    "SnapshotWriteError",
    "SnapshotSummary",
    "StateMarker",
    "TemplateError",
    "UnsupportedModelError",
    "Usage",
    "VerificationError",
]
