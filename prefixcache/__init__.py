"""prefixcache: exact prefix caching for LLM inference.

Token ids -> radix tree match -> block table -> model prefill/decode -> tree insert.  The layers, each a folder
importing only those below it: ``cache`` (tokens, pool, tree, eviction, admission, events) <- ``models`` and
``chat`` (tokenizers, chat templates) <- ``engine`` (runner, sampling) <- ``replay`` and ``bench`` <- ``cli``.
This module is the stable public surface.  The errors are imported with it; every other name on first use
(:pep:`562`), so that ``import prefixcache`` (and ``prefixcache --help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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

_LAZY = {
    **dict.fromkeys(
        (
            "CacheStats",
            "EvictResult",
            "InsertResult",
            "KVBlockPool",
            "Lease",
            "LFUPolicy",
            "LockHandle",
            "LRUPolicy",
            "MatchResult",
            "RadixCache",
            "SnapshotSummary",
            "StateMarker",
        ),
        "prefixcache.cache",
    ),
    **dict.fromkeys(
        ("ChatResult", "GenerationResult", "PrefixCachingRunner", "SamplingParams", "Usage"), "prefixcache.engine"
    ),
    "load_model": "prefixcache.models.loading",
}
"""The facade's names that import torch: name -> the module it is taken from on first use."""

if TYPE_CHECKING:
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
    from prefixcache.models.loading import load_model


def __getattr__(name: str) -> Any:
    """A lazy name of the facade, imported on first use (and kept); AttributeError for any other name."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"

__all__ = [
    "CacheStats",
    "CapacityError",
    "ChatResult",
    "EvictResult",
    "GenerationResult",
    "InsertResult",
    "InvalidArgumentError",
    "load_model",
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
