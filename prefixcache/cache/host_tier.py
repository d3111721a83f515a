"""The host-memory tier: a second, larger block pool in host memory that catches what device eviction frees.

The idea is SGLang's HiCache and vLLM's CPU offloading (and llama.cpp's ``--cache-ram``): when the device pool runs
short, the evictor's victims are copied to host memory instead of being dropped, and a later request that matches them
copies them back (*promotion*) instead of recomputing them.  Host memory is cheap and plentiful, a host-to-device copy
is much faster than prefill, so a host pool several times the device pool turns capacity misses into hits.

Residency.  Only *full* blocks move to host (as vLLM caches only full blocks).  A host block is named by a digest of
its namespace and every token from position 0 to the block's end (xxh3-128, computed incrementally), so equal keys
mean equal prefixes and a block is found again from any request's tokens without a tree walk.  The device tree keeps
only device blocks; what its evictor cut off a leaf's tail lives on in :attr:`HostTier.entries` as blocks
``k, k + 1, ...`` right after what the device still holds, so a request's cached prefix is its device match followed
by the consecutive host blocks after it.  Block-granular eviction frees a leaf's tail first, so the host holds the
continuation of the device prefix; the host LRU drops the least recently demoted or promoted block when it is full
(a run is filed tail first, so a dropped block leaves the blocks nearer the device prefix in place).

Promotion (:meth:`HostTier.promote`, from admission, before the prompt is matched): the device match is locked, fresh
device blocks are allocated (which may evict and demote other device blocks; feasibility first, as admission: nothing
is evicted for a request that then cannot fit), the host blocks are copied in, and the tokens are inserted into the
device tree as an ordinary leaf; the host copies are then freed (a block lives in one tier at a time, except when the
device recomputed a block the host still holds).  Any exception on the way gives back every block and the lock.

Events: with a host tier, the device tree's events carry ``medium="GPU"`` and the tier's own ``medium="CPU"`` (vLLM's
names for its two media).  A demotion is ``BlockRemoved(GPU)`` followed by ``BlockStored(CPU)`` with the same block
hashes; a promotion ``BlockStored(GPU)`` followed by ``BlockRemoved(CPU)`` (copied first, then freed); a drop
``BlockRemoved(CPU)``.  The device tree sends no ``AllCleared``: with two tiers the removals say it all.  Host
blocks demoted while nobody listened are never announced (so neither is their removal).

With ``num_layers == 0`` on both pools (the ``--no-model`` replay) demotion and promotion move block ids only.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from prefixcache.cache.blocks import BlockLedger
from prefixcache.cache.events import BlockRemoved, BlockStored, EventPublisher
from prefixcache.cache.locks import LockRegistry
from prefixcache.cache.node import Node
from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.cache.tree import RadixTree
from prefixcache.errors import InvalidArgumentError, OutOfBlocksError

logger = logging.getLogger(__name__)

DEVICE_MEDIUM = "GPU"
HOST_MEDIUM = "CPU"


@dataclass(slots=True)
class HostBlock:
    """One host-resident block: its host pool id and, when it was announced, the event that stored it."""

    block_id: int
    stored: BlockStored | None


@dataclass(frozen=True, slots=True)
class Promotion:
    """What :meth:`HostTier.promote` did for a prompt: the device match before it (``device_tokens``) and the end of
    the promoted blocks (``host_end``, a token position; equal to ``device_tokens`` when nothing was promoted)."""

    device_tokens: int
    host_end: int

    def host_tokens(self, num_cached_tokens: int) -> int:
        """Of a request's ``num_cached_tokens``, those that came from host memory."""
        return max(0, min(num_cached_tokens, self.host_end) - self.device_tokens)


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


class HostTier:
    """The host pool, the index of host-resident blocks in LRU order, and the moves between the tiers.

    ``entries`` maps a block key (see the module docstring) to its :class:`HostBlock`, least recently used first.
    Counters: ``demoted_blocks``, ``promoted_blocks``, ``dropped_blocks`` (host LRU victims).  Callers hold the
    cache's mutex.  Costs: demoting or promoting ``b`` blocks of a sequence of ``n`` tokens is one C-speed hash pass
    over the ``n`` tokens plus O(b) dict operations and one batched copy.
    """

    def __init__(self, pool: KVBlockPool, device_pool: KVBlockPool, events: EventPublisher) -> None:
        check_host_pool(pool, device_pool)
        self.pool = pool
        self.device_pool = device_pool
        self.block_size = pool.block_size
        self.events = events
        self.entries: OrderedDict[int, HostBlock] = OrderedDict()
        self.pinned: dict[int, HostBlock] = {}  # entries taken out of the LRU while a promotion reads them
        self.demoted_blocks = 0
        self.promoted_blocks = 0
        self.dropped_blocks = 0

    @property
    def num_blocks(self) -> int:
        """Host-resident blocks now."""
        return len(self.entries) + len(self.pinned)

    # ---- keys ---------------------------------------------------------------------------------------------

    def _hasher(self, tokens: array, namespace: str | None, first_block: int) -> xxhash.xxh3_128:
        h = xxhash.xxh3_128()
        name = b"\xff" if namespace is None else namespace.encode("utf-8", errors="surrogatepass")
        h.update(len(name).to_bytes(8, "little") + name)
        h.update(memoryview(tokens)[: first_block * self.block_size].cast("B"))
        return h

    def _keys(self, tokens: array, namespace: str | None, first_block: int, stop_block: int) -> list[int]:
        """Keys of blocks ``first_block .. stop_block - 1`` of ``tokens``.  O(len(tokens)) C-speed hashing."""
        h = self._hasher(tokens, namespace, first_block)
        data = memoryview(tokens).cast("B")
        step = 4 * self.block_size
        keys = []
        for j in range(first_block, stop_block):
            h.update(data[j * step : (j + 1) * step])
            keys.append(h.intdigest())
        return keys

    # ---- demotion (the tree's hook) -------------------------------------------------------------------------

    def demote(self, leaf: Node, first: int, block_ids: np.ndarray) -> None:
        """Called by :meth:`RadixTree.evict` before it frees ``block_ids`` (``leaf.blocks[first:]``) of ``leaf``: copy
        the ones full on the leaf's path to host blocks.  A removed leaf's shared first block is passed too: the parent
        keeps it, but its rows past the parent's end are the leaf's, and the parent, ending inside it, never will
        demote it as a full block.  Best effort: a failure is logged and the blocks are simply evicted (the tree's
        eviction must not be interrupted halfway)."""
        try:
            self._demote(leaf, first, block_ids)
        except Exception:
            logger.exception("demotion to host memory failed; the blocks are evicted instead")

    def _demote(self, leaf: Node, first: int, block_ids: np.ndarray) -> None:
        bs = self.block_size
        first_block = leaf.start // bs + first
        num_full = min(len(block_ids), leaf.end // bs - first_block)
        if num_full <= 0:
            return
        path = _path_tokens(leaf)
        keys = self._keys(path, leaf.namespace, first_block, first_block + num_full)
        entries = self.entries
        fresh = [i for i, key in enumerate(keys) if key not in entries and key not in self.pinned]
        for key in keys:
            if key in entries:
                entries.move_to_end(key)  # the device recomputed a block the host still held
        # Past the host's size, keep the blocks nearest the device prefix: they are the ones a promotion reaches.
        fresh = fresh[: self.pool.num_blocks - len(self.pinned)]
        if not fresh:
            return
        self._make_room(len(fresh))
        host_ids = self.pool.allocate(len(fresh))
        try:
            if self.pool.kv is not None:
                src = torch.from_numpy(np.asarray(block_ids[fresh], dtype=np.int64)).to(self.device_pool.device)
                self.pool.kv[:, :, torch.from_numpy(host_ids.astype(np.int64))] = self.device_pool.kv[:, :, src].to(
                    "cpu"
                )
        except BaseException:
            self.pool.decref(host_ids)
            raise
        stored = self._stored_events(leaf, path, first_block, fresh) if self.events.listeners else None
        # Tail first, so that the LRU drops a run from its far end.
        for n in range(len(fresh) - 1, -1, -1):
            key = keys[fresh[n]]
            entries[key] = HostBlock(int(host_ids[n]), stored[n] if stored else None)
        self.demoted_blocks += len(fresh)
        if stored:
            self.events.deferred.extend(stored)

    def _stored_events(self, leaf: Node, path: array, first_block: int, fresh: list[int]) -> list[BlockStored]:
        # The chained event hashes of the leaf's full blocks are on the leaf while anyone listens.
        bs = self.block_size
        hashes = leaf.block_hashes or []
        base = leaf.start // bs
        out = []
        for i in fresh:
            k = first_block + i
            offset = k - base
            if offset >= len(hashes):
                break
            parent = hashes[offset - 1] if offset else self.events.hash_before(leaf.parent, k)
            tokens = tuple(path[k * bs : (k + 1) * bs])
            out.append(BlockStored(leaf.namespace, (hashes[offset],), parent, k, tokens, bs, HOST_MEDIUM))
        return out if len(out) == len(fresh) else []

    def _make_room(self, num_blocks: int) -> None:
        """Drop least recently used host blocks until ``num_blocks`` are free."""
        short = num_blocks - self.pool.num_free_blocks
        if short <= 0:
            return
        victims = [self.entries.popitem(last=False)[1] for _ in range(min(short, len(self.entries)))]
        self._free(victims)
        self.dropped_blocks += len(victims)

    def _free(self, blocks: list[HostBlock]) -> None:
        if not blocks:
            return
        self.pool.decref(np.fromiter((b.block_id for b in blocks), dtype=np.intp, count=len(blocks)))
        removed = [b.stored for b in blocks if b.stored is not None]
        if removed and self.events.listeners:
            by_namespace: dict[str | None, list[int]] = {}
            for event in removed:
                by_namespace.setdefault(event.namespace, []).extend(event.block_hashes)
            self.events.emit([BlockRemoved(ns, tuple(hashes), HOST_MEDIUM) for ns, hashes in by_namespace.items()])

    # ---- promotion ------------------------------------------------------------------------------------------

    def promote(
        self,
        tree: RadixTree,
        ledger: BlockLedger,
        locks: LockRegistry,
        q: array,
        namespace: str | None,
        num_tokens: int | None,
        owner: object,
    ) -> Promotion | None:
        """Bring the host blocks that continue ``q``'s device match back into fresh device blocks and insert them
        into the tree, so that the admission right after finds them.  Returns None when the host holds nothing after
        the device match; a :class:`Promotion` (possibly of no block, when the device cannot take them) otherwise.

        Feasibility first: with ``num_tokens`` the request's whole need beyond its device prefix must fit free plus
        evictable blocks, else nothing is promoted (the admission then refuses it without evicting); without, only
        as many blocks as can be had are promoted.  Exception-safe: whatever raises, no block is leaked, the
        temporary lock is released and the host blocks stay host-resident.
        """
        if not self.entries:
            return None
        bs = self.block_size
        match = tree.match(q, namespace, len(q), owner)
        m = match.num_tokens
        b0 = m // bs
        hits: list[tuple[int, HostBlock]] = []
        h = self._hasher(q, namespace, b0)
        data = memoryview(q).cast("B")
        step = 4 * bs
        for j in range(b0, len(q) // bs):
            h.update(data[j * step : (j + 1) * step])
            key = h.intdigest()
            entry = self.entries.get(key)
            if entry is None:
                break
            hits.append((key, entry))
        if not hits:
            return None
        pool = ledger.pool
        handle = locks.lock(tree.lock_point(match.node, b0 * bs))
        try:
            # A device match ending inside block b0 leaves a seam: the promoted leaf starts with its own copy of that
            # block, and the parent's copy stays pinned beside it when a sibling shares it (see tree.heal_seam).
            available = pool.num_free_blocks + tree.evictable_blocks - (m % bs != 0)
            num = len(hits)
            if num_tokens is not None:
                # The request's need beyond its device prefix, plus a copy-on-write block when the promoted blocks
                # reach the prompt's last token (admission matches one token less and copies that block).
                cow = (b0 + num) * bs >= len(q)
                if max(-(-num_tokens // bs), b0 + num) - b0 + cow > available:
                    num = 0
            else:
                num = max(0, min(num, available))
            if num == 0:
                return Promotion(m, m)
            hits = hits[:num]
            for key, _ in hits:
                self.pinned[key] = self.entries.pop(key)
            try:
                self._promote(tree, ledger, q, namespace, match.block_table[:b0], b0, hits)
            except BaseException as error:
                for key, _ in hits:
                    self.entries[key] = self.pinned.pop(key)
                if isinstance(error, OutOfBlocksError):
                    # Only a block held for a moment by copy-on-write can cause it; the request recomputes instead.
                    return Promotion(m, m)
                raise
            for key, _ in hits:
                del self.pinned[key]
            self._free([entry for _, entry in hits])
            self.promoted_blocks += num
            return Promotion(m, (b0 + num) * bs)
        finally:
            locks.unlock(handle)

    def _promote(
        self,
        tree: RadixTree,
        ledger: BlockLedger,
        q: array,
        namespace: str | None,
        prefix: np.ndarray,
        b0: int,
        hits: list[tuple[int, HostBlock]],
    ) -> None:
        num = len(hits)
        fresh = ledger.allocate(num, "promotion from host memory")
        try:
            self.copy_in(fresh, np.fromiter((e.block_id for _, e in hits), dtype=np.int64, count=num))
            table = np.concatenate((prefix.astype(np.intp), fresh.astype(np.intp)))
            ledger.insert(q[: (b0 + num) * self.block_size], table, b0, namespace, None)
        except BaseException:
            owned = fresh[ledger.owned[fresh.astype(np.intp)]]
            if owned.size:
                ledger.free(owned)
            raise

    def copy_in(self, device_ids: np.ndarray, host_ids: np.ndarray) -> None:
        """Copy host blocks ``host_ids`` into device blocks ``device_ids`` (all layers, K and V): one batched,
        non-blocking host-to-device copy (asynchronous from pinned memory).  No-op for metadata-only pools."""
        device = self.device_pool
        if device.kv is None:
            return
        rows = self.pool.kv[:, :, torch.from_numpy(host_ids)]
        dst = torch.from_numpy(np.asarray(device_ids, dtype=np.int64)).to(device.device)
        device.kv[:, :, dst] = rows.to(device.device, non_blocking=True)

    # ---- observation ----------------------------------------------------------------------------------------

    def stored_events(self) -> list[BlockStored]:
        """The events of every announced host block (for a new subscriber), least recently used first."""
        return [entry.stored for entry in self.entries.values() if entry.stored is not None]

    def check_invariants(self) -> None:
        """The host pool's free list is consistent; every host-resident block has exactly one holder (its entry);
        no block is both free and used or listed twice; no promotion is in flight.

        Raises:
            AssertionError: naming what is wrong.
        """
        pool = self.pool
        pool.check_invariants()
        if self.pinned:
            raise AssertionError(f"{len(self.pinned)} host blocks still pinned by a promotion")
        ids = np.fromiter((e.block_id for e in self.entries.values()), dtype=np.intp, count=len(self.entries))
        if np.unique(ids).size != ids.size:
            raise AssertionError("a host block is listed under two keys")
        expected = np.zeros(pool.num_blocks, dtype=np.int32)
        expected[ids] = 1
        if not np.array_equal(expected, pool.ref_counts()):
            bad = np.flatnonzero(expected != pool.ref_counts())[:5].tolist()
            raise AssertionError(f"host reference counts differ from the host index for blocks {bad}")
        if pool.num_used_blocks != len(self.entries):
            raise AssertionError(f"{pool.num_used_blocks} host blocks used, {len(self.entries)} indexed")


def _path_tokens(node: Node) -> array:
    """The token ids from position 0 to the end of ``node``'s edge.  O(depth + tokens)."""
    parts = []
    while node.parent is not None:
        parts.append(node.tokens)
        node = node.parent
    out = array(TOKEN_TYPECODE)
    for part in reversed(parts):
        out.extend(part)
    return out
