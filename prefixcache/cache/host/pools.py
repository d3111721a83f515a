"""The host tier's pool: made to match a device pool, sized in tokens or bytes, and checked before a tier takes it.

A host pool holds whole blocks of the device pool's shape (block size, ``num_layers``, ``num_kv_heads``, ``head_dim``,
dtype) in CPU memory, pinned when the device is CUDA, so a block copies between the two tiers as one tensor slice.
"""

from __future__ import annotations

from prefixcache.cache.pool import KVBlockPool
from prefixcache.errors import InvalidArgumentError


def make_host_pool(device_pool: KVBlockPool, num_blocks: int) -> KVBlockPool:
    """A host pool of ``num_blocks`` blocks shaped like ``device_pool`` (block size, KV shape, dtype) on the CPU,
    page-locked (pinned) when the device pool is on CUDA so that copies between them run asynchronously.

    Raises:
        InvalidArgumentError: ``num_blocks < 1``.
    """
    pool = KVBlockPool(
        num_blocks,
        device_pool.block_size,
        num_layers=device_pool.num_layers,
        num_kv_heads=device_pool.num_kv_heads,
        head_dim=device_pool.head_dim,
        dtype=device_pool.dtype,
        device="cpu",
    )
    if pool.kv is not None and device_pool.device.type == "cuda":
        pool.kv = pool.kv.pin_memory()
    return pool


def host_pool_for(
    device_pool: KVBlockPool, host_tokens: int | None = None, host_bytes: int | None = None
) -> KVBlockPool | None:
    """The host pool for ``device_pool`` holding ``host_tokens`` tokens (rounded up to whole blocks) or as many
    whole blocks as ``host_bytes`` bytes of KV hold; None when both are None.

    Raises:
        InvalidArgumentError: both given, a size that is not a positive int, or ``host_bytes`` for a metadata-only
            pool (no bytes per token) or too small for one block.
    """
    if host_tokens is None and host_bytes is None:
        return None
    if host_tokens is not None and host_bytes is not None:
        raise InvalidArgumentError("give at most one of the host tier's size in tokens and in bytes")
    size = host_tokens if host_tokens is not None else host_bytes
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidArgumentError(f"the host tier's size must be a positive int, got {size!r}")
    bs = device_pool.block_size
    if host_tokens is not None:
        return make_host_pool(device_pool, -(-host_tokens // bs))
    per_block = device_pool.bytes_per_token * bs
    if per_block == 0:
        raise InvalidArgumentError("a host tier sized in bytes needs a model (bytes per token); give it in tokens")
    if host_bytes < per_block:
        raise InvalidArgumentError(f"{host_bytes} bytes of host memory hold no block of {per_block} bytes")
    return make_host_pool(device_pool, host_bytes // per_block)


def check_host_pool(host: KVBlockPool, device: KVBlockPool) -> None:
    """Refuse a host pool that cannot hold the device pool's blocks.

    Raises:
        InvalidArgumentError: not a KVBlockPool, not on the CPU, or another block size, KV shape
            (``num_layers``, ``num_kv_heads``, ``head_dim``) or dtype than the device pool.
    """
    if not isinstance(host, KVBlockPool):
        raise InvalidArgumentError(f"host_pool must be a KVBlockPool, got {type(host).__name__}")
    if host is device:
        raise InvalidArgumentError("host_pool must be a second pool, not the device pool itself")
    if host.device.type != "cpu":
        raise InvalidArgumentError(f"host_pool must live in host memory (device 'cpu'), got {host.device}")
    for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "dtype"):
        if getattr(host, name) != getattr(device, name):
            raise InvalidArgumentError(
                f"host_pool {name} {getattr(host, name)} differs from the device pool's {getattr(device, name)}: "
                "host blocks must have the device blocks' block size, KV shape and dtype"
            )
