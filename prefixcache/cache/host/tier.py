"""The host-memory tier: a second, larger block pool in host memory that catches what device eviction frees.

The idea is SGLang's HiCache and vLLM's CPU offloading (and llama.cpp's ``--cache-ram``): when the device pool runs
short, the evictor's victims are copied to host memory instead of being dropped, and a later request that matches them
copies them back (*promotion*) instead of recomputing them.  Host memory is cheap and plentiful, a host-to-device copy
is much faster than prefill, so a host pool several times the device pool turns capacity misses into hits.

Residency.  Only *full* blocks move to host (as vLLM caches only full blocks).  The device tree keeps only device
blocks; what its evictor frees at once from a leaf's tail (blocks ``k .. k + n - 1`` of one sequence) lives on in
:attr:`HostTier.runs` as one :class:`HostRun`, named by a digest (xxh3-128) of its namespace and every token up to the
end of its first block, and holding its own tokens.  Block-granular eviction frees a leaf's tail first, and a device
insert over a run's head drops those host copies (:meth:`HostTier.cover`), so a run starts where the device prefix (or
the next run) ends: a request's cached prefix is its device match followed by the runs found by digesting its own tokens
at each run boundary and comparing the run's tokens with its own (both C-speed passes), with no tree walk and no
per-block Python work.  Equal digests mean equal prefixes; the token comparison decides how far a run goes on.  The host
LRU orders runs by demotion or promotion; when full it drops the least recent runs, and cuts the tail off the last one
it needs (a tail first, so the blocks nearer the device prefix, the ones a promotion reaches, stay).

Promotion (:meth:`HostTier.promote`, from admission, before the prompt is matched): the device match is locked, fresh
device blocks are allocated (which may evict and demote other device blocks; feasibility first, as admission: nothing is
evicted for a request that then cannot fit), the host blocks are copied in, and the tokens are inserted into the device
tree as an ordinary leaf; the host copies are then freed, so a block lives in one tier at a time (as when the device
recomputes it); what a prompt did not use of a run stays, as a run of its own.  Any exception on the way gives back
every block and the lock.

Events: with a host tier, the device tree's events carry ``medium="GPU"`` and the tier's own ``medium="CPU"`` (vLLM's
names for its two media).  A demotion is ``BlockRemoved(GPU)`` followed by ``BlockStored(CPU)`` with the same block
hashes (and before it the ``BlockRemoved(CPU)`` of any run dropped to make room, all in the order they happened); a
promotion ``BlockStored(GPU)`` followed by ``BlockRemoved(CPU)`` (copied first, then freed); a drop
``BlockRemoved(CPU)``, as is a host copy the device recomputed.  Should that drop fail, a block can be demoted again
into a second, overlapping run: it is announced on host when its first copy arrives and removed when its last goes.  The
device tree sends no ``AllCleared``: with two tiers the removals say it all.  Host blocks demoted while nobody listened,
and runs restored from a snapshot, are announced when a listener subscribes or the restore ends, from the tokens before
them that the device tree or another run holds (:mod:`prefixcache.cache.host.events`).

With ``num_layers == 0`` on both pools (the ``--no-model`` replay) demotion and promotion move block ids only.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from prefixcache.cache.blocks import BlockLedger
from prefixcache.cache.events import HOST_MEDIUM, BlockRemoved, BlockStored, EventPublisher, KVEvent
from prefixcache.cache.host.pools import check_host_pool
from prefixcache.cache.locks import LockRegistry
from prefixcache.cache.node import Node, common_prefix_length
from prefixcache.cache.pool import KVBlockPool
from prefixcache.cache.results import Promotion
from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.cache.tree import RadixTree
from prefixcache.errors import OutOfBlocksError

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class HostRun:
    """Consecutive host-resident blocks of one sequence, demoted together: blocks ``first .. first + len - 1``.

    ``key`` names the run by its first block (a digest of the namespace and every token up to that block's end);
    ``tokens`` are the run's own tokens (``len(block_ids) * block_size``), compared with a prompt at C speed to see how
    far it goes on; ``block_ids`` are host pool ids; ``stored`` one event per block when they were announced.
    """

    key: int
    namespace: str | None
    first: int
    tokens: array
    block_ids: np.ndarray
    stored: list[BlockStored] | None


class HostTier:
    """The host pool, the host-resident runs in LRU order, and the moves between the tiers.

    ``runs`` maps a run's key (see :class:`HostRun`) to the run, least recently used first.  Counters:
    ``demoted_blocks``, ``promoted_blocks``, ``dropped_blocks`` (host LRU victims).  Callers hold the cache's mutex.
    Costs: demoting blocks of a leaf, or promoting them for a prompt of ``n`` tokens, is one C-speed hash pass over
    the sequence, a C-speed token comparison, O(runs touched) dict operations and one batched copy: nothing is done
    per block in Python, so the cache-only replay stays fast.
    """

    def __init__(self, pool: KVBlockPool, device_pool: KVBlockPool, events: EventPublisher) -> None:
        check_host_pool(pool, device_pool)
        self.pool = pool
        self.device_pool = device_pool
        self.block_size = pool.block_size
        self.events = events
        self.runs: OrderedDict[int, HostRun] = OrderedDict()
        self.pinned: dict[int, HostRun] = {}  # runs taken out of the LRU while a promotion reads them
        # Events of the tier's moves, in the order they happened, until the operation that caused them sends them:
        # after the device's own events of an eviction (demote returns them), or at the end of a promotion or clear.
        self.pending: list[KVEvent] = []
        # How many runs hold each announced (namespace, block hash): a device that recomputed blocks the host still
        # holds can demote them again into a second, overlapping run.  Listeners hear a block stored when its first
        # copy arrives and removed when its last goes, so nothing is announced twice.
        self.announced: dict[tuple[str | None, int], int] = {}
        self.demoted_blocks = 0
        self.promoted_blocks = 0
        self.dropped_blocks = 0

    # ---- keys ---------------------------------------------------------------------------------------------

    def _hasher(self, tokens: array, namespace: str | None, num_blocks: int) -> xxhash.xxh3_128:
        """A digest state over the namespace and the first ``num_blocks`` blocks of ``tokens``."""
        h = xxhash.xxh3_128()
        name = b"\xff" if namespace is None else namespace.encode("utf-8", errors="surrogatepass")
        h.update(len(name).to_bytes(8, "little") + name)
        h.update(memoryview(tokens)[: num_blocks * self.block_size].cast("B"))
        return h

    def run_key(self, tokens: array, namespace: str | None, block: int) -> int:
        """The key of block ``block`` of ``tokens``: a digest of everything up to its end.  O(position) in C."""
        return self._hasher(tokens, namespace, block + 1).intdigest()

    # ---- demotion (the tree's hook) -------------------------------------------------------------------------

    def demote(self, leaf: Node, first: int, block_ids: np.ndarray) -> list[KVEvent]:
        """Called by :meth:`RadixTree.evict` before it frees ``block_ids`` (``leaf.blocks[first:]``) of ``leaf``: copy
        the ones full on the leaf's path to host blocks, as one run.  A removed leaf's shared first block is passed
        too: the parent keeps it, but its rows past the parent's end are the leaf's, and the parent, ending inside it,
        never will demote it as a full block.  Best effort: a failure is logged and the blocks are simply evicted (the
        tree's eviction must not be interrupted halfway).  Returns the host's events of it in order (runs dropped for
        room, then the new run stored), which the tree sends after its own removal of those blocks."""
        mark = len(self.pending)
        try:
            self._demote(leaf, first, block_ids)
        except Exception:
            logger.exception("demotion to host memory failed; the blocks are evicted instead")
        events = self.pending[mark:]
        del self.pending[mark:]
        return events

    def _demote(self, leaf: Node, first: int, block_ids: np.ndarray) -> None:
        bs = self.block_size
        first_block = leaf.start // bs + first
        # Past the host's size, keep the blocks nearest the device prefix: they are the ones a promotion reaches.
        pinned = sum(len(run.block_ids) for run in self.pinned.values())
        num = min(len(block_ids), leaf.end // bs - first_block, self.pool.num_blocks - pinned)
        if num <= 0:
            return
        path = _path_tokens(leaf)
        key = self.run_key(path, leaf.namespace, first_block)
        if key in self.pinned:
            return
        old = self.runs.pop(key, None)
        if old is not None:
            # A run from the same block on: the device recomputed it, or another continuation; keep the newer.  Its
            # announced blocks are counted out after the new run's are counted in: the blocks both hold stay put.
            self.pool.decref(old.block_ids)
        try:
            self._demote_into(leaf, block_ids, path, key, first_block, num)
        finally:
            if old is not None:
                self._unannounce(old.stored)

    def _demote_into(
        self, leaf: Node, block_ids: np.ndarray, path: array, key: int, first_block: int, num: int
    ) -> None:
        bs = self.block_size
        self._make_room(num)
        host_ids = self.pool.allocate(num).astype(np.intp)
        try:
            if self.pool.kv is not None:
                src = self.device_pool.block_table_tensor(block_ids[:num])
                self.pool.kv[:, :, self.pool.block_table_tensor(host_ids)] = self.device_pool.kv[:, :, src].to("cpu")
        except BaseException:
            self.pool.decref(host_ids)
            raise
        stored = self._stored_events(leaf, path, first_block, num) if self.events.listeners else None
        tokens = path[first_block * bs : (first_block + num) * bs]
        self.runs[key] = HostRun(key, leaf.namespace, first_block, tokens, host_ids, stored)
        self.demoted_blocks += num
        if stored:
            self.announce(stored)

    def cover(self, leaf: Node, path: array) -> list[KVEvent]:
        """Called by :meth:`RadixTree.insert` on a new ``leaf`` (the end of ``path``): drop the host copies of its
        full blocks, a run's rest filed under its new first block, where :meth:`_find` looks.  Best effort."""
        if not self.runs:
            return []
        mark, bs, runs, num_full = len(self.pending), self.block_size, self.runs, len(path) // self.block_size
        try:
            data, step = memoryview(path).cast("B"), path.itemsize * bs
            h = self._hasher(path, leaf.namespace, leaf.start // bs)
            for j in range(leaf.start // bs, num_full):
                h.update(data[j * step : (j + 1) * step])
                run = runs.get(h.intdigest())
                size = 0 if run is None else min(len(run.block_ids), num_full - j)
                if size and (k := common_prefix_length(run.tokens, path, j * bs, size * bs) // bs):
                    del runs[run.key]  # out of the LRU first, as a promoted run; the rest goes back in
                    self._consume(run, k, path)
        except Exception:
            logger.exception("dropping the host copies of recomputed blocks failed; they stay on host")
        events = self.pending[mark:]
        del self.pending[mark:]
        return events

    def _stored_events(self, leaf: Node, path: array, first_block: int, num: int) -> list[BlockStored] | None:
        # The chained event hashes of the leaf's full blocks are on the leaf while anyone listens.
        bs = self.block_size
        hashes = leaf.block_hashes or []
        offset = first_block - leaf.start // bs
        if offset + num > len(hashes):
            return None
        out = []
        for i in range(offset, offset + num):
            k = leaf.start // bs + i
            parent = hashes[i - 1] if i else self.events.hash_before(leaf.parent, k)
            tokens = tuple(path[k * bs : (k + 1) * bs])
            out.append(BlockStored(leaf.namespace, (hashes[i],), parent, k, tokens, bs, HOST_MEDIUM))
        return out

    def _make_room(self, num_blocks: int) -> None:
        """Drop least recently used host blocks until ``num_blocks`` are free: whole runs, then the tail of one."""
        short = num_blocks - self.pool.num_free_blocks
        runs = self.runs
        while short > 0 and runs:
            run = next(iter(runs.values()))
            size = len(run.block_ids)
            if size <= short:
                self._free(run.block_ids, run.stored)  # before it leaves the LRU: a failure leaks no block
                runs.popitem(last=False)
                cut = size
            else:
                cut = short
                keep = size - cut
                self._free(run.block_ids[keep:], run.stored[keep:] if run.stored else None)
                run.block_ids = run.block_ids[:keep]
                del run.tokens[keep * self.block_size :]
                if run.stored:
                    del run.stored[keep:]
            short -= cut
            self.dropped_blocks += cut

    def clear(self) -> None:
        """Drop every host run (counted in ``dropped_blocks``), as a restore that replaces the cache's content does.
        O(runs)."""
        try:
            while self.runs:
                run = next(iter(self.runs.values()))
                self._free(run.block_ids, run.stored)  # before it leaves the LRU: a failure leaks no block
                self.runs.popitem(last=False)
                self.dropped_blocks += len(run.block_ids)
        finally:
            self.send_pending()

    def announce(self, stored: list[BlockStored]) -> None:
        """Count the new run's announced blocks; queue the events of those no other run holds.  O(blocks)."""
        counts = self.announced
        for event in stored:
            key = (event.namespace, event.block_hashes[0])
            held = counts.get(key, 0)
            counts[key] = held + 1
            if not held:
                self.pending.append(event)

    def _free(self, block_ids: np.ndarray, stored: list[BlockStored] | None) -> None:
        self.pool.decref(block_ids)
        self._unannounce(stored)

    def _unannounce(self, stored: list[BlockStored] | None) -> None:
        """Count out a run's announced blocks; queue the removal of those no other run holds.  O(blocks)."""
        if not stored:
            return
        counts = self.announced
        gone = []
        for event in stored:
            key = (event.namespace, event.block_hashes[0])
            held = counts[key] - 1
            if held:
                counts[key] = held
            else:
                del counts[key]
                gone.append(key[1])
        if gone and self.events.listeners:
            self.pending.append(BlockRemoved(stored[0].namespace, tuple(gone), HOST_MEDIUM))

    def send_pending(self) -> None:
        """Send the events of the moves made so far (see :attr:`pending`)."""
        if self.pending:
            events, self.pending = self.pending, []
            self.events.emit(events)

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
        the device match; a :class:`~prefixcache.cache.results.Promotion` (possibly of no block, when the device
        cannot take them) otherwise.

        Feasibility first: with ``num_tokens`` the request's whole need beyond its device prefix must fit free plus
        evictable blocks, else nothing is promoted (the admission then refuses it without evicting); without, only
        as many blocks as can be had are promoted.  Exception-safe: whatever raises, no block is leaked, the
        temporary lock is released and the host blocks stay host-resident.
        """
        if not self.runs:
            return None
        bs = self.block_size
        match = tree.match(q, namespace, len(q), owner)
        m = match.num_tokens
        b0 = m // bs
        hits = self._find(q, namespace, b0)
        if not hits:
            return None
        pool = ledger.pool
        handle = locks.lock(tree.lock_point(match.node, b0 * bs))
        try:
            # A device match ending inside block b0 leaves a seam: the promoted leaf starts with its own copy of that
            # block, and the parent's copy stays pinned beside it when a sibling shares it (see cache.seams).
            available = pool.num_free_blocks + tree.evictable_blocks - (m % bs != 0)
            num = sum(k for _, k in hits)
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
            hits = _take(hits, num)
            for run, _ in hits:
                self.pinned[run.key] = self.runs.pop(run.key)
            try:
                self._promote(tree, ledger, q, namespace, match.block_table[:b0], b0, hits)
            except BaseException as error:
                for run, _ in hits:
                    self.runs[run.key] = self.pinned.pop(run.key)
                if isinstance(error, OutOfBlocksError):
                    # Only a block held for a moment by copy-on-write can cause it; the request recomputes instead.
                    return Promotion(m, m)
                raise
            for run, k in hits:
                del self.pinned[run.key]
                self._consume(run, k, q)
            self.promoted_blocks += num
            return Promotion(m, (b0 + num) * bs)
        finally:
            locks.unlock(handle)
            self.send_pending()

    def _find(self, q: array, namespace: str | None, b0: int) -> list[tuple[HostRun, int]]:
        """The runs continuing ``q`` from block ``b0``, each with how many of its blocks ``q`` shares in full."""
        bs = self.block_size
        num_full = len(q) // bs
        data = memoryview(q).cast("B")
        step = 4 * bs
        h = self._hasher(q, namespace, b0)
        hits: list[tuple[HostRun, int]] = []
        j = b0
        while j < num_full:
            h.update(data[j * step : (j + 1) * step])
            run = self.runs.get(h.intdigest())
            if run is None:
                break
            size = min(len(run.block_ids), num_full - j)
            k = common_prefix_length(run.tokens, q, j * bs, size * bs) // bs
            if k == 0:
                break
            hits.append((run, k))
            h.update(data[(j + 1) * step : (j + k) * step])
            # A run that leaves q partway is a branch point, not an end: a sibling's run may go on from block j + k.
            j += k
        return hits

    def _promote(
        self,
        tree: RadixTree,
        ledger: BlockLedger,
        q: array,
        namespace: str | None,
        prefix: np.ndarray,
        b0: int,
        hits: list[tuple[HostRun, int]],
    ) -> None:
        num = sum(k for _, k in hits)
        fresh = ledger.allocate(num, "promotion from host memory")
        try:
            self.copy_in(fresh, np.concatenate([run.block_ids[:k] for run, k in hits]))
            table = np.concatenate((prefix.astype(np.intp), fresh.astype(np.intp)))
            ledger.insert(q[: (b0 + num) * self.block_size], table, b0, namespace, None)
        except BaseException:
            owned = fresh[ledger.owned[fresh.astype(np.intp)]]
            if owned.size:
                ledger.free(owned)
            raise

    def _consume(self, run: HostRun, k: int, q: array) -> None:
        """Free the first ``k`` blocks of a promoted run; the rest stays on host as a run of its own."""
        bs = self.block_size
        self._free(run.block_ids[:k], run.stored[:k] if run.stored else None)
        if k == len(run.block_ids):
            return
        rest_first = run.first + k
        path = q[: rest_first * bs] + run.tokens[k * bs : (k + 1) * bs]
        key = self.run_key(path, run.namespace, rest_first)
        rest = HostRun(
            key,
            run.namespace,
            rest_first,
            run.tokens[k * bs :],
            run.block_ids[k:],
            run.stored[k:] if run.stored else None,
        )
        old = self.runs.pop(key, None)
        if old is not None:
            self._free(old.block_ids, old.stored)
        self.runs[key] = rest

    def copy_in(self, device_ids: np.ndarray, host_ids: np.ndarray) -> None:
        """Copy host blocks ``host_ids`` into device blocks ``device_ids`` (all layers, K and V): one batched,
        non-blocking host-to-device copy (asynchronous from pinned memory).  No-op for metadata-only pools."""
        device = self.device_pool
        if device.kv is None:
            return
        rows = self.pool.kv[:, :, self.pool.block_table_tensor(host_ids)]
        dst = device.block_table_tensor(device_ids)
        device.kv[:, :, dst] = rows.to(device.device, non_blocking=True)

    # ---- observation ----------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Host-resident blocks now.  O(runs)."""
        return sum(len(run.block_ids) for run in (*self.runs.values(), *self.pinned.values()))

    def stored_events(self) -> list[BlockStored]:
        """The events of every announced host block (for a new subscriber), least recently used run first."""
        seen: set[tuple[str | None, int]] = set()
        out = []
        for run in self.runs.values():
            for event in run.stored or ():
                key = (event.namespace, event.block_hashes[0])
                if key not in seen:
                    seen.add(key)
                    out.append(event)
        return out

    def announced_blocks(self) -> set[tuple[str | None, int]]:
        """``(namespace, block hash)`` of every host block announced to listeners (what a mirror of the cache's events
        holds on host).  O(announced host blocks)."""
        return {
            (run.namespace, h) for run in self.runs.values() if run.stored for e in run.stored for h in e.block_hashes
        }

    def check_invariants(self) -> None:
        """The host pool's free list is consistent; every host-resident block has exactly one holder (its run); no
        block is both free and used or in two runs; each run is filed under its key, with its tokens and events
        matching its blocks; the announced blocks are counted once per run holding them; no promotion is in flight
        and no event is left unsent.  O(host blocks).

        Raises:
            AssertionError: naming what is wrong.
        """
        pool = self.pool
        bs = self.block_size
        pool.check_invariants()
        if self.pinned:
            raise AssertionError(f"{len(self.pinned)} host runs still pinned by a promotion")
        if self.pending:
            raise AssertionError(f"{len(self.pending)} host events were never sent")
        counts: dict[tuple[str | None, int], int] = {}
        for run in self.runs.values():
            for event in run.stored or ():
                key = (event.namespace, event.block_hashes[0])
                counts[key] = counts.get(key, 0) + 1
        if counts != self.announced:
            raise AssertionError("the announced host blocks are not counted once per run holding them")
        for key, run in self.runs.items():
            if run.key != key or not len(run.block_ids):
                raise AssertionError(f"host run {key:#x} is filed under another key or empty")
            if len(run.tokens) != len(run.block_ids) * bs:
                raise AssertionError(f"host run {key:#x} has {len(run.tokens)} tokens for {len(run.block_ids)} blocks")
            if run.stored is not None and len(run.stored) != len(run.block_ids):
                raise AssertionError(f"host run {key:#x} keeps {len(run.stored)} events for {len(run.block_ids)}")
        runs = list(self.runs.values())
        ids = np.concatenate([run.block_ids for run in runs]) if runs else np.zeros(0, dtype=np.intp)
        if np.unique(ids).size != ids.size:
            raise AssertionError("a host block is in two runs")
        expected = np.zeros(pool.num_blocks, dtype=np.int32)
        expected[ids] = 1
        if not np.array_equal(expected, pool.ref_counts()):
            bad = np.flatnonzero(expected != pool.ref_counts())[:5].tolist()
            raise AssertionError(f"host reference counts differ from the host runs for blocks {bad}")


def _take(hits: list[tuple[HostRun, int]], num: int) -> list[tuple[HostRun, int]]:
    """The first ``num`` blocks of ``hits``."""
    out = []
    for run, k in hits:
        if num <= 0:
            break
        out.append((run, min(k, num)))
        num -= k
    return out


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
