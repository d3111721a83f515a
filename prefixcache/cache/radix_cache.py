"""The cache: a radix tree over exact token ids whose KV lives in a pool of reference-counted blocks.

:class:`RadixCache` is the thread-safe face of the parts beside it, each with one job:

- :mod:`~prefixcache.cache.tree`: the radix tree (match, insert, split, evict leaves), after SGLang's RadixAttention;
- :mod:`~prefixcache.cache.blocks`: which blocks callers own, allocation (evicting when short), hand-over on insert;
- :mod:`~prefixcache.cache.locks`: lock handles on matched paths;
- :mod:`~prefixcache.cache.admission`: request leases (acquire / reserve / commit / release, copy-on-write), with
  :mod:`~prefixcache.cache.handover` (what a running request gives the tree) and :mod:`~prefixcache.cache.lease`;
- :mod:`~prefixcache.cache.stats`, :mod:`~prefixcache.cache.events`, :mod:`~prefixcache.cache.invariants`:
  hit accounting, KV events, invariant checks;
- :mod:`~prefixcache.cache.host` (the host-memory tier, wired into the tree's and admission's hooks here) and
  :mod:`~prefixcache.cache.snapshot` (save and restore, :class:`~prefixcache.cache.snapshot.cache.CacheSnapshots`):
  the two subpackages beside the core, which only this module brings in.

Ownership.  Each block's reference count is the number of tree nodes holding it plus one while a caller owns it
(from :meth:`RadixCache.allocate` until it hands the block to :meth:`RadixCache.insert` or :meth:`RadixCache.free`).
A request keeps the blocks of its matched prefix alive by *locking* the matched path (lock count on each node up
to the root), not by reference counts: locked nodes are never evicted.

Thread safety: every public method holds one re-entrant mutex for its whole duration, so tree bookkeeping is
serialized; model compute happens outside, on blocks the request owns privately.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import numpy as np

from prefixcache.cache.admission import Admission
from prefixcache.cache.blocks import BlockLedger
from prefixcache.cache.events import (
    DEVICE_MEDIUM,
    BlockIndex,
    EventListener,
    EventPublisher,
    check_hash_seed,
    check_namespace,
)
from prefixcache.cache.evictor import EvictionPolicy, Evictor
from prefixcache.cache.host import events as host_events
from prefixcache.cache.host.tier import HostTier
from prefixcache.cache.invariants import check_invariants, check_mirror
from prefixcache.cache.lease import Lease
from prefixcache.cache.locks import ChangeGuard, LockHandle, LockRegistry
from prefixcache.cache.pool import BlockIds, KVBlockPool, check_count
from prefixcache.cache.results import EvictResult, InsertResult, MatchResult
from prefixcache.cache.resume import StateMarker, StateStore, check_resume_options, check_state, state_bytes
from prefixcache.cache.retention import Retention, check_retain, path_to
from prefixcache.cache.snapshot.cache import CacheSnapshots
from prefixcache.cache.stats import CacheStats, HitCounters, check_request_id, collect_stats
from prefixcache.cache.tokens import TokenIds, as_token_array
from prefixcache.cache.tree import RadixTree
from prefixcache.errors import InvalidArgumentError, LockError

__all__ = [
    "CacheStats",
    "EvictResult",
    "InsertResult",
    "Lease",
    "LockHandle",
    "MatchResult",
    "RadixCache",
    "StateMarker",
    "check_namespace",
]


class RadixCache(CacheSnapshots):
    """A prefix cache over exact token-id sequences, backed by a :class:`~prefixcache.KVBlockPool`.

    Low-level operations: :meth:`match` (read-only lookup), :meth:`lock` / :meth:`unlock`, :meth:`allocate` /
    :meth:`free`, :meth:`insert`, :meth:`evict`.  Request-level operations, which the runner uses:
    :meth:`acquire` (match + lock + copy-on-write), :meth:`reserve` (blocks for new tokens), :meth:`insert_prefix`
    (cache a running request's prompt, keep its lease), :meth:`commit` (insert + release) and :meth:`release` (give
    everything back after a failure); :meth:`cached_length` is a scheduler's look-ahead.

    Sequences in different namespaces (cache salt) share nothing: each namespace has its own root.

    Complexities: ``match``/``insert`` cost O(depth) dict lookups plus O(n) C-speed token comparison;
    evicting one leaf costs O(log c) in the number of eviction candidates ``c``.

    Observation: :meth:`stats` (with a recent hit rate over the last ``hit_rate_window`` requests), and KV events
    (:mod:`prefixcache.cache.events`, block hashes seeded with ``hash_seed``) sent to ``event_listener`` and to
    callbacks given to :meth:`subscribe`.  With no listener the event machinery costs one test per insert and per
    eviction call.

    Memory pressure: eviction frees single blocks from the tail of the least valuable unlocked leaf
    (``eviction_granularity="block"``, the default; ``"leaf"`` frees whole leaves, as SGLang does), and only once the
    blocks asked for can be had at all.  :meth:`retain` keeps chosen prefixes ahead of everything else, within
    ``max_retained_fraction`` of the pool (``clock`` gives the seconds retention times are measured in).

    Host-memory tier: with ``host_pool`` (a second, larger :class:`~prefixcache.KVBlockPool` on the CPU, e.g. from
    :func:`~prefixcache.cache.host.tier.make_host_pool`) the full blocks eviction frees are copied there instead of
    dropped, and :meth:`acquire` promotes them back into device blocks when a prompt matches them
    (:mod:`prefixcache.cache.host.tier`).  Without one, nothing on the lookup, lock or eviction path changes.

    Recurrent models (``resume_states=True``, :mod:`prefixcache.cache.resume`): inserts take an opaque state (with
    ``nbytes``) to keep at a position, lookups end at the deepest kept state, within ``max_state_bytes`` (required).
    Snapshots save the states kept on the nodes they save (:mod:`prefixcache.cache.snapshot.states`; ``restore``
    rebuilds them with the model's ``state_loader``); a host tier is refused.  Off (the default), passing a state is
    an error and each lookup or insert pays one test.

    Raises:
        InvalidArgumentError: ``host_pool`` is not a CPU pool with the device pool's block size, KV shape and dtype;
            ``pool`` is not a KVBlockPool, ``hit_rate_window`` not a positive int, ``hash_seed``
            not an int in ``[0, 2**64)``, an unknown policy or granularity, ``max_retained_fraction`` outside
            ``[0, 1]``, or ``clock`` or ``event_listener`` not callable; bad resume options
            (:func:`~prefixcache.cache.resume.check_resume_options`).
    """

    def __init__(
        self,
        pool: KVBlockPool,
        policy: str | EvictionPolicy = "lru",
        *,
        hit_rate_window: int = 100,
        event_listener: EventListener | None = None,
        hash_seed: int = 0,
        eviction_granularity: str = "block",
        max_retained_fraction: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        host_pool: KVBlockPool | None = None,
        resume_states: bool = False,
        max_state_bytes: int | None = None,
    ) -> None:
        if not isinstance(pool, KVBlockPool):
            raise InvalidArgumentError(f"pool must be a KVBlockPool, got {type(pool).__name__}")
        check_resume_options(resume_states, max_state_bytes, host_pool is not None)
        if isinstance(hit_rate_window, bool) or not isinstance(hit_rate_window, int) or hit_rate_window < 1:
            raise InvalidArgumentError(f"hit_rate_window must be a positive int, got {hit_rate_window!r}")
        check_hash_seed(hash_seed)
        self.pool = pool
        self.block_size = pool.block_size
        self.hash_seed = hash_seed
        self._mutex = threading.RLock()
        self._events = EventPublisher(pool.block_size, hash_seed)
        self._change = ChangeGuard(self._mutex, self._events)  # the mutex, for calls that change the cache
        evictor = Evictor(policy)
        retention = Retention(pool.num_blocks, evictor, max_retained_fraction, clock)
        self._tree = RadixTree(pool, evictor, self._events, retention, eviction_granularity)
        self._blocks = BlockLedger(pool, self._tree)
        self._locks = LockRegistry(self._tree, self)
        self._counters = HitCounters(hit_rate_window)
        self._admission = Admission(self._tree, self._blocks, self._locks, self._counters, self)
        self._host: HostTier | None = None
        if host_pool is not None:
            self._host = HostTier(host_pool, pool, self._events)
            self._tree.demote = self._host.demote
            self._tree.cover = self._host.cover
            self._admission.promote = functools.partial(
                self._host.promote, self._tree, self._blocks, self._locks, owner=self
            )
            self._events.medium = DEVICE_MEDIUM
        self._states: StateStore | None = None
        if resume_states:
            self._states = StateStore(int(max_state_bytes))
            self._tree.states = self._states
            self._admission.states = self._states
        if event_listener is not None:
            self.subscribe(event_listener)

    @property
    def policy(self) -> EvictionPolicy:
        return self._tree.evictor.policy

    @property
    def max_state_bytes(self) -> int | None:
        """The byte budget of the kept recurrent states, None when the cache does not resume states."""
        return None if self._states is None else self._states.max_bytes

    # ---- lookup and locks ---------------------------------------------------------------------------------

    def match(
        self,
        token_ids: TokenIds,
        namespace: str | None = None,
        *,
        for_prefill: bool = False,
        request_id: str | None = None,
    ) -> MatchResult:
        """Longest cached prefix of ``token_ids`` in ``namespace``.

        With ``for_prefill=True`` at most ``len(token_ids) - 1`` tokens are matched: a request must compute at
        least its last token to get logits.  With ``for_prefill=False`` (pure lookup) a fully cached sequence
        matches in full.  Does not change the tree's shape; refreshes the access time (and LFU hit count) of the
        matched path; counts the query in :meth:`stats` (tokens on nodes inserted under ``request_id`` as
        self-hits).  With resume states it ends at the deepest kept state (counting the shortfall).

        Raises:
            InvalidTokensError, NamespaceError, InvalidArgumentError: bad input (``request_id`` not a str or None);
                nothing changes.
        """
        q = as_token_array(token_ids)
        namespace = check_namespace(namespace)
        check_request_id(request_id)
        with self._mutex:
            result = self._tree.match(q, namespace, len(q) - 1 if for_prefill else len(q), self)
            if self._states is not None:
                result = self._states.resumable(self._tree, q, namespace, result, self)
            own = self._tree.own_tokens(result.node, result.num_tokens, request_id) if request_id is not None else 0
            self._counters.record_query(len(q), result.num_tokens, own)
            return result

    def lock(self, match: MatchResult) -> LockHandle:
        """Lock the matched path so none of its nodes (the match's node and every ancestor) can be evicted.  O(depth).
        Raises LockError: the match is not this cache's, or is stale (its node was evicted or shortened since)."""
        with self._change:
            if not isinstance(match, MatchResult) or match.owner is not self:
                raise LockError("lock takes a MatchResult returned by this cache's match()")
            return self._locks.lock(match.node, match.num_tokens)

    def unlock(self, handle: LockHandle) -> None:
        """Release a lock taken by :meth:`lock`.  O(depth).  Raises LockError: the handle is another cache's or was
        already released (nothing changes)."""
        with self._change:
            self._locks.unlock(handle)

    # ---- blocks, insert, evict ----------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> np.ndarray:
        """Take ``num_blocks`` blocks for the caller, evicting least valuable unlocked leaves if the pool is short.

        The caller owns the returned blocks (int32 ids) until it passes them to :meth:`insert` or :meth:`free`.

        Raises:
            CapacityError: more blocks than the pool has at all (nothing is evicted).
            OutOfBlocksError: not enough blocks even after evicting every unlocked leaf; what was evicted stays
                evicted (the cache stays consistent), nothing is allocated.
        """
        with self._change:
            return self._blocks.allocate(num_blocks)

    def free(self, block_ids: BlockIds) -> int:
        """Give back blocks the caller owns (from :meth:`allocate`) without caching them.  Returns blocks freed.

        Raises: LockError: a block is not owned by a caller (already freed, or held by the tree); nothing changes.
        """
        with self._change:
            return self._blocks.free(block_ids)

    def insert(
        self,
        token_ids: TokenIds,
        block_ids: BlockIds,
        namespace: str | None = None,
        *,
        request_id: str | None = None,
        state: object = None,
    ) -> InsertResult:
        """Cache ``token_ids`` whose KV the caller has written into ``block_ids`` (its block table).

        ``block_ids[j]`` holds positions ``j * block_size ..``; at least ``ceil(len(token_ids) / block_size)``
        ids are needed.  Leading ids may be the tree's own blocks of a prefix the caller matched and locked; the
        rest must be owned by the caller (from :meth:`allocate`).  Insert takes over the caller's ownership: the
        blocks of the new suffix move into a new leaf (splitting a node where the sequences diverge); owned blocks
        of the part that was already cached, and any beyond the sequence, are released.  The new leaf remembers
        ``request_id`` (see :attr:`CacheStats.self_hit_tokens`).  ``state`` (after all of ``token_ids``, resume
        states only) is kept at position ``len(token_ids)``.

        Raises:
            InvalidTokensError, NamespaceError, InvalidArgumentError, LockError: bad input; the cache is unchanged.
        """
        q = as_token_array(token_ids)
        namespace = check_namespace(namespace)
        check_request_id(request_id)
        nbytes = state_bytes(self._states, state)
        with self._change:
            blocks = self._blocks
            result = blocks.insert(q, blocks.as_block_ids(block_ids), None, namespace, request_id)
            if state is not None:
                self._admission.keep_state(q, namespace, len(q), state, nbytes)
            return result

    def evict(self, num_blocks: int) -> EvictResult:
        """Free ``num_blocks`` blocks of unlocked nodes in policy order (fewer when fewer are unlocked).

        Block granularity cuts blocks off the tail of the first candidate leaf (shortening its edge at a block
        boundary) and removes a leaf once nothing of it is left; its parent may then become a candidate.  The result
        and the ``BlockRemoved`` events say exactly what was freed.  O(log c) per block freed.
        """
        num_blocks = check_count(num_blocks, "num_blocks")
        with self._change:
            return self._tree.evict(num_blocks)

    def evict_all(self) -> EvictResult:
        """Evict every unlocked node."""
        with self._change:
            return self._tree.evict(self.pool.num_blocks + 1)

    # ---- request-level ------------------------------------------------------------------------------------

    def acquire(
        self,
        token_ids: TokenIds,
        namespace: str | None = None,
        *,
        request_id: str | None = None,
        num_tokens: int | None = None,
        resumed: bool = False,
    ) -> Lease:
        """Admit a request: match at most ``len - 1`` prompt tokens, lock their whole blocks, and copy the rows of a
        partially matched last block into a block the request owns (copy-on-write).  The copy is made at once, so
        the partial block's node stays evictable; if not even one block can be found for it, those rows are left
        to be recomputed (``num_cached_tokens`` drops to the block boundary) rather than failing the request.

        ``request_id`` names the request in the stats: tokens it finds that it inserted itself (a retry) count as
        self-hits, and :meth:`commit` marks what it inserts with it.  Each admitted request counts as one request in
        the recent hit rate window.  ``resumed=True`` is a request taking a lease again after preemption (its prompt
        and what it generated so far): nothing of it counts in the hit statistics or rejections, which counted the
        request when it was first admitted.

        With ``num_tokens`` (the prompt and what will be generated, or at least the prompt) admission also reserves
        the blocks for that many tokens, after checking that they can be had: a request that cannot be served raises
        before anything is evicted, and counts in :attr:`CacheStats.rejected_requests` only.

        Raises:
            InvalidTokensError, NamespaceError, InvalidArgumentError: bad input (``request_id`` not a str or None).
            CapacityError: ``num_tokens`` exceed the pool.  PoolBusyError: running requests hold what it needs.
        Without ``num_tokens`` it never runs out of blocks: the copy falls back to recomputation as said above.
        Whatever raises, the cache is left as before (no lock, no block of this request).
        With resume states the match ends at the deepest kept state (see :class:`Lease`); only resumed tokens are hits.
        """
        q = as_token_array(token_ids)
        namespace = check_namespace(namespace)
        check_request_id(request_id)
        if num_tokens is not None and (
            isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < len(q)
        ):
            raise InvalidArgumentError(
                f"num_tokens must be an int of at least the prompt's {len(q)} tokens, got {num_tokens!r}"
            )
        with self._change:
            return self._admission.acquire(
                q, namespace, request_id, None if num_tokens is None else int(num_tokens), counted=not resumed
            )

    def reserve(self, lease: Lease, num_tokens: int) -> np.ndarray:
        """Grow the lease's block table to address ``num_tokens`` tokens (evicting if needed); returns the table.

        Raises:
            CapacityError: ``num_tokens`` exceed the whole pool.  OutOfBlocksError: as :meth:`allocate`.
            LockError: the lease is closed.
        """
        with self._change:
            return self._admission.reserve(lease, num_tokens)

    def shrink(self, lease: Lease, num_tokens: int) -> int:
        """Free the lease's own blocks past those addressing ``num_tokens`` tokens (reserved for tokens it will not
        keep: a rejected speculative draft); never the blocks of its prompt.  Returns the blocks freed.

        Raises:
            InvalidArgumentError: ``num_tokens`` is not a non-negative int.  LockError: the lease is closed.
        """
        with self._change:
            return self._admission.shrink(lease, num_tokens)

    def commit(self, lease: Lease, token_ids: TokenIds, state: object = None) -> InsertResult:
        """Insert the request's tokens (prompt and anything generated after it, all with KV written) and close the
        lease: the new suffix is cached, duplicate blocks released, the lock dropped; ``state`` as for :meth:`insert`.

        Raises:
            InvalidTokensError: ``token_ids`` do not start with the lease's matched prefix (the lease stays open:
                call :meth:`release`).
            InvalidArgumentError: the tokens need more blocks than the lease holds (call :meth:`reserve` first;
                the lease stays open).
            LockError: the lease is closed.
        """
        q = as_token_array(token_ids)
        nbytes = state_bytes(self._states, state)
        with self._change:
            return self._admission.commit(lease, q, state, nbytes)

    def insert_prefix(self, lease: Lease, token_ids: TokenIds, state: object = None) -> InsertResult:
        """Insert tokens of a request that is still running (its prompt, once prefilled) and keep its lease open, so
        that other requests hit them while it decodes; :meth:`commit` or :meth:`release` later closes the lease as
        usual.  The lease's whole blocks of ``token_ids`` pass to the tree and its lock moves onto the new path;
        where ``token_ids`` end inside a block, the tree gets a copy of that block's rows and the request keeps
        writing its own.  O(len(token_ids)) plus one block copy.
        ``state`` as for :meth:`insert`, dropped (counted) if no block could be had for that copy.

        Raises:
            InvalidTokensError: ``token_ids`` do not start with the lease's matched prefix and agree with its prompt.
            InvalidArgumentError: the tokens need more blocks than the lease holds; a bad ``state``.
            LockError: the lease is closed.
        Nothing changes when it raises (the lease stays open).
        """
        q = as_token_array(token_ids)
        nbytes = state_bytes(self._states, state)
        with self._change:
            return self._admission.insert_prefix(lease, q, state, nbytes)

    def put_state(self, lease: Lease, num_tokens: int, state: object) -> bool:
        """Keep ``state``, taken after the lease prompt's first ``num_tokens`` tokens (e.g. at a block boundary of a
        chunked prefill), if the tree holds them (after :meth:`insert_prefix`), else drop it; returns whether kept.
        The prompt is the one acquired, or the longer tokens given to :meth:`insert_prefix` since.

        Raises: InvalidArgumentError: no resume states, a bad ``state`` or ``num_tokens``.  LockError: closed lease.
        """
        if self._states is None:
            raise InvalidArgumentError("put_state needs a cache made with resume_states=True")
        nbytes = check_state(state)
        with self._change:
            return self._admission.put_state(lease, num_tokens, state, nbytes)

    def state_positions(self, token_ids: TokenIds, namespace: str | None = None) -> list[int]:
        """Positions along the cached prefix of ``token_ids`` with a kept state, ascending; touches nothing."""
        q = as_token_array(token_ids)
        namespace = check_namespace(namespace)
        with self._mutex:
            if self._states is None:
                return []
            result = self._tree.match(q, namespace, len(q), self, touch=False)
            return self._states.positions(result.node, result.num_tokens)

    def cached_length(self, token_ids: TokenIds, namespace: str | None = None, *, for_prefill: bool = False) -> int:
        """Tokens of ``token_ids`` that :meth:`match` would find cached (at most ``len - 1`` with ``for_prefill``),
        as a pure look-ahead: nothing is counted in :meth:`stats` and no access time or hit count changes, so a
        scheduler may ask every step for every waiting request (with resume states, the resumable length).  O(depth)
        plus O(n) C-speed comparison.

        Raises:
            InvalidTokensError, NamespaceError: bad input.
        """
        q = as_token_array(token_ids)
        namespace = check_namespace(namespace)
        with self._mutex:
            result = self._tree.match(q, namespace, len(q) - 1 if for_prefill else len(q), self, touch=False)
            if self._states is not None:
                return self._states.deepest(result.node, result.num_tokens)[0]
            return result.num_tokens

    def release(self, lease: Lease) -> None:
        """Drop a lease without caching anything: free its own blocks and unlock its prefix.

        Raises:
            LockError: the lease is already closed.
        """
        with self._change:
            self._admission.release(lease)

    def retain(
        self,
        token_ids: TokenIds,
        namespace: str | None = None,
        *,
        priority: int = 1,
        retain_s: float | None = None,
    ) -> int:
        """Keep the cached prefix ``token_ids`` ahead of unretained blocks: eviction takes lower ``priority`` first,
        and a retained prefix goes only when nothing of lower priority is left, or ``retain_s`` seconds from now
        (never, when None).  Only what is cached is marked (the longest cached prefix of ``token_ids``), and only
        while the retained blocks stay within ``max_retained_fraction`` of the pool (from the root down).  Returns
        the tokens retained.  O(depth log n).

        Raises:
            InvalidTokensError, NamespaceError: bad input.
            InvalidArgumentError: ``priority`` not a positive int, ``retain_s`` not a positive number.
        """
        q = as_token_array(token_ids)
        namespace = check_namespace(namespace)
        check_retain(priority, retain_s)
        with self._change:
            tree = self._tree
            match = tree.match(q, namespace, len(q), self)
            if match.num_tokens == 0:
                return 0
            return tree.retention.retain(path_to(tree.lock_point(match.node, match.num_tokens)), priority, retain_s)

    # ---- observation --------------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """A consistent snapshot of sizes and counters.  O(1)."""
        with self._mutex:
            return collect_stats(self.pool, self._tree, self._counters, self._host, self._states)

    @property
    def host_pool(self) -> KVBlockPool | None:
        """The host-memory tier's pool, or None."""
        return None if self._host is None else self._host.pool

    def subscribe(self, callback: EventListener) -> None:
        """Send KV events (:mod:`prefixcache.cache.events`) to ``callback`` from now on, starting with a
        :class:`~prefixcache.cache.events.BlockStored` for every full block cached, on host too: a complete view.
        O(cached tokens): every node's block hashes are recomputed.  Raises InvalidArgumentError: not callable."""
        if not callable(callback):
            raise InvalidArgumentError(f"an event listener must be callable, got {callback!r}")
        with self._mutex:
            stored = self._events.hash_tree(self._tree.roots)
            stored += host_events.announce_held(self._host, self._tree.roots, hashed=True)
            self._events.listeners.append(callback)
            self._events.emit(stored, [callback])

    def unsubscribe(self, callback: EventListener) -> None:
        """Stop sending events to ``callback``.  Raises InvalidArgumentError: ``callback`` is not subscribed."""
        with self._mutex:
            if callback not in self._events.listeners:
                raise InvalidArgumentError("unsubscribe: that callback is not subscribed")
            self._events.listeners.remove(callback)

    def cached_sequences(self, namespace: str | None = None) -> list[list[int]]:
        """Every root-to-leaf token sequence cached in ``namespace`` (for tests and debugging; O(depth x tokens))."""
        with self._mutex:
            return self._tree.cached_sequences(namespace)

    def check_invariants(self, index: BlockIndex | None = None) -> None:
        """Recompute every piece of bookkeeping from scratch and compare (:mod:`prefixcache.cache.invariants`); with
        ``index`` (fed every event since the cache was empty or since it subscribed), also that it mirrors the cache
        (:func:`~prefixcache.cache.invariants.check_mirror`).  O(total tokens).  Raises AssertionError: naming the
        first broken invariant."""
        with self._mutex:
            check_invariants(self._tree, self._blocks, self._locks)
            if self._host is not None:
                self._host.check_invariants()
            if index is not None:
                announced = None if self._host is None else self._host.announced_blocks()
                check_mirror(self._tree, announced, index, self.hash_seed)
