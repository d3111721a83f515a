"""The pool a server starts with when it is given no size: from the model's shape and the memory free on its device.

vLLM fills a fraction of the GPU (``gpu_memory_utilization``, 0.9) with KV blocks; llama.cpp's server sizes its
context from the model (``n_ctx``).  A prefix cache on a shared CPU host takes both into account: it keeps
:data:`DEFAULT_MEMORY_FRACTION` of the memory available after the model is loaded, and no more than
:data:`DEFAULT_SESSIONS` sessions of the model's full context would fill, so that a small model does not reserve
gigabytes it can never use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.cache.pool import kv_bytes_per_token
from prefixcache.errors import InvalidArgumentError

__all__ = [
    "DEFAULT_MEMORY_FRACTION",
    "DEFAULT_SESSIONS",
    "MIN_POOL_BLOCKS",
    "PoolSize",
    "available_memory",
    "check_default_pool",
    "default_pool_size",
    "describe_pool",
]

DEFAULT_MEMORY_FRACTION = 0.25
"""Share of the device's available memory the default pool takes (CPU: ``MemAvailable``; CUDA: free memory)."""

DEFAULT_SESSIONS = 32
"""The default pool holds at most this many full-context sessions (the engine's default ``max_running``)."""

MIN_POOL_BLOCKS = 2
"""The smallest default pool a server starts with: a one-block pool holds no prompt past one block and cannot give a
request a block to decode into while its prompt's block is held."""


@dataclass(frozen=True, slots=True)
class PoolSize:
    """A default pool: ``num_tokens`` of KV (``num_bytes``), what bounded it (``"memory"`` or ``"sessions"``), and
    how many sessions of ``context_tokens`` (the model's ``max_position``) fit."""

    num_tokens: int
    num_bytes: int
    bound: str
    context_tokens: int

    @property
    def sessions(self) -> int:
        """Full-context sessions that fit at once (at least 0)."""
        return self.num_tokens // self.context_tokens if self.context_tokens else 0

    def describe(self) -> str:
        """One line for a start message, e.g. ``65,536 tokens of KV (256.0 MiB; 32 sessions of 2,048 tokens)``."""
        return (
            f"{self.num_tokens:,} tokens of KV ({self.num_bytes / 2**20:,.1f} MiB; {self.sessions:,} sessions of "
            f"{self.context_tokens:,} tokens; sized by {self.bound})"
        )


def available_memory(device: torch.device | str) -> int:
    """Bytes available for a new pool on ``device``: CUDA's free memory, or on a CPU Linux's ``MemAvailable``
    (``/proc/meminfo``; elsewhere the free physical pages).  Raises :class:`InvalidArgumentError` when it cannot be
    read."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        raise InvalidArgumentError("cannot read the free memory here: give --cache-tokens or --cache-memory") from None


def default_pool_size(
    model,
    block_size: int,
    *,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
    sessions: int = DEFAULT_SESSIONS,
    available_bytes: int | None = None,
) -> PoolSize:
    """The default pool of ``model`` (a :class:`~prefixcache.models.base.CausalLM`): ``memory_fraction`` of the
    available memory of its device (``available_bytes`` when given), at most ``sessions`` x its ``max_position``
    tokens, rounded down to whole blocks of ``block_size`` tokens and at least one block.  O(1).

    Raises:
        InvalidArgumentError: ``memory_fraction`` outside (0, 1], ``sessions`` < 1, ``block_size`` < 1.
    """
    if not 0 < memory_fraction <= 1:
        raise InvalidArgumentError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    if sessions < 1 or block_size < 1:
        raise InvalidArgumentError(f"sessions and block_size must be positive, got {sessions!r}, {block_size!r}")
    per_token = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype)
    free = available_memory(model.device) if available_bytes is None else available_bytes
    by_memory = int(free * memory_fraction) // per_token
    by_sessions = sessions * model.max_position
    tokens, bound = (by_memory, "memory") if by_memory < by_sessions else (by_sessions, "sessions")
    tokens = max(block_size, tokens // block_size * block_size)
    return PoolSize(tokens, tokens * per_token, bound, model.max_position)


def check_default_pool(size: PoolSize, block_size: int) -> str | None:
    """Check a default pool (:func:`default_pool_size`) before a server is built on it: ``None`` when it holds a
    request of the model's full context (``size.context_tokens``), else a warning line to print, saying how long a
    request can be and how to get a larger pool.  O(1).

    Raises:
        InvalidArgumentError: the pool has fewer than :data:`MIN_POOL_BLOCKS` blocks of ``block_size`` tokens (too
            little memory available), naming its size and the options that set one.
    """
    if block_size < 1:
        raise InvalidArgumentError(f"block_size must be positive, got {block_size!r}")
    num_blocks = size.num_tokens // block_size
    if num_blocks < MIN_POOL_BLOCKS:
        raise InvalidArgumentError(
            f"the default pool would be {num_blocks} block{'s' if num_blocks != 1 else ''} of {block_size} tokens "
            f"({size.num_tokens:,} tokens of KV, {size.num_bytes / 2**20:,.2f} MiB, sized by {size.bound}); a server "
            f"needs at least {MIN_POOL_BLOCKS}: give --cache-tokens or --cache-memory, or a larger --memory-fraction"
        )
    if size.num_tokens < size.context_tokens:
        return (
            f"the default pool ({size.num_tokens:,} tokens of KV, sized by {size.bound}) cannot hold one request of "
            f"the model's full context ({size.context_tokens:,} tokens): a longer prompt and answer will be refused; "
            "give --cache-tokens or --cache-memory, or a larger --memory-fraction"
        )
    return None


def describe_pool(pool, context_tokens: int, bound: str) -> str:
    """:meth:`PoolSize.describe` of a built ``pool`` (a :class:`~prefixcache.cache.pool.KVBlockPool`) whose size
    ``bound`` names (``"memory"``, ``"sessions"``, ``"--cache-tokens"``, ...), for a model of ``context_tokens``."""
    tokens = pool.capacity_tokens
    return PoolSize(tokens, tokens * pool.bytes_per_token, bound, context_tokens).describe()
