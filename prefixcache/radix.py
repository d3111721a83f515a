"""The radix tree: every cached token-id prefix, mapped to the pool blocks that hold its KV.

The idea is SGLang's RadixAttention (Zheng et al., "SGLang: Efficient Execution of Structured Language Model
Programs", 2024): a compressed trie keyed on exact token ids whose edges carry the KV of their tokens, shared by
every request that starts with them, with reference-counted blocks and LRU eviction of unreferenced leaves.

How tokens map to blocks.  A node's edge holds the tokens at absolute positions ``[start, start + len)`` of every
sequence through it, and ``blocks`` holds the pool blocks for block indices ``start // block_size`` up to
``(end - 1) // block_size``.  The KV of position ``p`` lives in row ``p % block_size`` of the block of index
``p // block_size``.  When an edge starts inside a block, its first block also holds (valid copies of) the rows of
the earlier positions in that block; that block is shared with the parent when it came from splitting a node, and
private to the edge when a request computed or copied it.  So the block table of a path is the concatenation of
its nodes' blocks where a deeper node's first block replaces its parent's last one.

Matches are token-exact (longest common prefix, not rounded down to blocks).  A match that ends inside a block
can reuse those rows only by copying them into a private block (copy-on-write), because the shared block's later
rows belong to another sequence and a shared block is never written in place.  :meth:`RadixCache.acquire` does
that copy for a request.

Ownership.  Each block's reference count is the number of tree nodes holding it plus one while a caller owns it
(from :meth:`RadixCache.allocate` until it hands the block to :meth:`RadixCache.insert` or :meth:`RadixCache.free`).
A request keeps the blocks of its matched prefix alive by *locking* the matched path (lock count on each node up
to the root), not by reference counts: locked nodes are never evicted.

Thread safety: every public method holds one re-entrant mutex for its whole duration, so tree bookkeeping is
serialized; model compute happens outside, on blocks the request owns privately.
"""

from __future__ import annotations

import itertools
import logging
import threading
from array import array
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from prefixcache.errors import (
    CapacityError,
    InvalidArgumentError,
    InvalidTokensError,
    LockError,
    NamespaceError,
    OutOfBlocksError,
)
from prefixcache.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventListener,
    KVEvent,
    chain_hashes,
    namespace_root_hash,
)
from prefixcache.evictor import EvictionPolicy, Evictor
from prefixcache.pool import BLOCK_ID_DTYPE, BlockIds, KVBlockPool
from prefixcache.tokens import TOKEN_TYPECODE, TokenIds, as_token_array

logger = logging.getLogger(__name__)

_EMPTY_BLOCKS = np.zeros(0, dtype=BLOCK_ID_DTYPE)
_NOT_OWNED = "block(s) not owned by the caller: freed already, held by the tree, or listed twice"


class _Node:
    """One edge of the tree and the node below it.  ``children`` is keyed by each child's first token."""

    __slots__ = (
        "node_id",
        "parent",
        "children",
        "tokens",
        "start",
        "blocks",
        "lock_count",
        "last_access",
        "hit_count",
        "evict_key",
        "namespace",
        "evicted",
        "origin",
        "block_hashes",
    )

    def __init__(self, node_id: int, parent: _Node | None, tokens: array, start: int, blocks: np.ndarray) -> None:
        self.node_id = node_id
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.tokens = tokens
        self.start = start
        self.blocks = blocks
        self.lock_count = 0
        self.last_access = 0
        self.hit_count = 0
        self.evict_key: tuple | None = None
        self.namespace: str | None = None
        self.evicted = False
        # The request id that inserted these tokens, so its retries count as self-hits, not hits.
        self.origin: str | None = None
        # Chained hashes of the full blocks this node owns (see prefixcache.events); kept only while listened to.
        self.block_hashes: list[int] | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a query.

    ``num_tokens`` is exact (not rounded to blocks).  ``block_table`` (int32, ``ceil(num_tokens / block_size)``
    block ids) addresses the KV of those tokens; when ``num_tokens % block_size != 0`` its last block is shared and
    only its first ``num_tokens % block_size`` rows belong to this prefix.  ``node`` is what :meth:`RadixCache.lock`
    takes; the result goes stale if that node is evicted before it is locked.
    """

    num_tokens: int
    block_table: np.ndarray
    namespace: str | None
    node: _Node = field(repr=False)
    owner: object = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What :meth:`RadixCache.insert` did: tokens newly cached, tokens that were cached already, blocks released."""

    num_new_tokens: int
    num_cached_tokens: int
    num_released_blocks: int


@dataclass(frozen=True, slots=True)
class EvictResult:
    """What one :meth:`RadixCache.evict` call freed."""

    num_blocks: int
    num_nodes: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the cache.  Tokens are token counts, blocks block counts.

    ``query_tokens`` / ``hit_tokens`` count the tokens asked for and found by :meth:`RadixCache.match` and
    :meth:`RadixCache.acquire`; ``hit_rate = hit_tokens / query_tokens``.  Tokens found on nodes inserted by the
    same ``request_id`` as the query's (a retried request finding its own tokens) count as ``self_hit_tokens``
    instead, never as hits.  The ``window_*`` fields cover the last ``window_requests`` :meth:`RadixCache.acquire`
    calls (at most the cache's ``hit_rate_window``): ``window_hit_rate`` is the recent hit rate.
    """

    num_blocks: int
    block_size: int
    free_blocks: int
    used_blocks: int
    cached_tokens: int
    evictable_tokens: int
    locked_tokens: int
    num_nodes: int
    query_tokens: int
    hit_tokens: int
    evictions: int
    evicted_tokens: int
    evicted_blocks: int
    self_hit_tokens: int = 0
    window_requests: int = 0
    window_query_tokens: int = 0
    window_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def window_hit_rate(self) -> float:
        return self.window_hit_tokens / self.window_query_tokens if self.window_query_tokens else 0.0


class LockHandle:
    """Proof that a matched path is locked; give it back to :meth:`RadixCache.unlock` exactly once."""

    __slots__ = ("handle_id", "node", "released", "owner")

    def __init__(self, handle_id: int, node: _Node, owner: object = None) -> None:
        self.handle_id = handle_id
        self.node = node
        self.released = False
        self.owner = owner  # the RadixCache that issued it: handles never cross caches


@dataclass(slots=True, eq=False)
class Lease:
    """A request's hold on the cache, from :meth:`RadixCache.acquire` to :meth:`~RadixCache.commit` or
    :meth:`~RadixCache.release`.

    ``block_table[:first_owned_block]`` are the tree's blocks of the matched prefix (kept alive by ``lock``);
    ``block_table[first_owned_block:]`` are owned by the request (the copy-on-write block of a match ending inside
    a block, then the blocks for the tokens it computes).  ``num_cached_tokens`` prompt tokens need no prefill;
    ``num_copied_tokens`` of them were copied rather than shared.
    """

    token_ids: array
    namespace: str | None
    num_cached_tokens: int
    num_copied_tokens: int
    block_table: np.ndarray
    first_owned_block: int
    lock: LockHandle
    block_size: int
    closed: bool = False
    request_id: str | None = None

    @property
    def capacity_tokens(self) -> int:
        """Tokens the block table can address: ``len(block_table) * block_size``."""
        return len(self.block_table) * self.block_size


def check_namespace(namespace: object) -> str | None:
    """Return ``namespace`` if it is ``None`` or a ``str``.

    Raises:
        NamespaceError: any other type.
    """
    if namespace is None or type(namespace) is str:
        return namespace  # type: ignore[return-value]
    raise NamespaceError(f"namespace must be None or a str (a cache salt), got {type(namespace).__name__}")


class RadixCache:
    """A prefix cache over exact token-id sequences, backed by a :class:`~prefixcache.pool.KVBlockPool`.

    Low-level operations: :meth:`match` (read-only lookup), :meth:`lock` / :meth:`unlock`, :meth:`allocate` /
    :meth:`free`, :meth:`insert`, :meth:`evict`.  Request-level operations, which the runner uses:
    :meth:`acquire` (match + lock + copy-on-write), :meth:`reserve` (blocks for new tokens), :meth:`commit`
    (insert + release) and :meth:`release` (give everything back after a failure).

    Sequences in different namespaces (cache salt) share nothing: each namespace has its own root.

    Complexities: ``match``/``insert`` cost O(depth) dict lookups plus O(n) C-speed token comparison;
    evicting one leaf costs O(log c) in the number of eviction candidates ``c``.

    Observation: :meth:`stats` (with a recent hit rate over the last ``hit_rate_window`` requests), and KV events
    (:mod:`prefixcache.events`, block hashes seeded with ``hash_seed``) sent to ``event_listener`` and to callbacks
    given to :meth:`subscribe`.  With no listener the event machinery costs one test per insert and per evicted
    leaf.
    """

    def __init__(
        self,
        pool: KVBlockPool,
        policy: str | EvictionPolicy = "lru",
        *,
        hit_rate_window: int = 100,
        event_listener: EventListener | None = None,
        hash_seed: int = 0,
    ) -> None:
        if not isinstance(pool, KVBlockPool):
            raise InvalidArgumentError(f"pool must be a KVBlockPool, got {type(pool).__name__}")
        if isinstance(hit_rate_window, bool) or not isinstance(hit_rate_window, int) or hit_rate_window < 1:
            raise InvalidArgumentError(f"hit_rate_window must be a positive int, got {hit_rate_window!r}")
        if isinstance(hash_seed, bool) or not isinstance(hash_seed, int) or not 0 <= hash_seed < 2**64:
            raise InvalidArgumentError(f"hash_seed must be an int in [0, 2**64), got {hash_seed!r}")
        self.pool = pool
        self.block_size = pool.block_size
        self._evictor = Evictor(policy)
        self._roots: dict[str | None, _Node] = {}
        self._owned = np.zeros(pool.num_blocks, dtype=bool)
        # Scratch for the duplicate test of a block table (see _distinct); its contents mean nothing between calls.
        self._slot = np.zeros(pool.num_blocks, dtype=np.int32)
        self._positions = np.arange(0, dtype=np.int32)  # 0, 1, 2...: grown to the longest table checked
        self._handles: dict[int, LockHandle] = {}
        self._ids = itertools.count(1)
        self._clock = 0
        self._mutex = threading.RLock()
        self._num_nodes = 0
        self._evictable_tokens = 0
        self._locked_tokens = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._evictions = 0
        self._evicted_tokens = 0
        self._evicted_blocks = 0
        self._self_hit_tokens = 0
        self._window: deque[tuple[int, int]] = deque(maxlen=hit_rate_window)
        self._window_query_tokens = 0
        self._window_hit_tokens = 0
        self.hash_seed = hash_seed
        self._listeners: list[EventListener] = []
        if event_listener is not None:
            self.subscribe(event_listener)

    @property
    def policy(self) -> EvictionPolicy:
        return self._evictor.policy

    # ---- lookup -------------------------------------------------------------------------------------------

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
        self-hits).

        Raises:
            InvalidTokensError, NamespaceError: bad input (nothing changes).
        """
        q = as_token_array(token_ids)
        namespace = check_namespace(namespace)
        with self._mutex:
            return self._match(q, namespace, len(q) - 1 if for_prefill else len(q), record=True, request_id=request_id)

    def _match(
        self, q: array, namespace: str | None, limit: int, *, record: bool, request_id: str | None = None
    ) -> MatchResult:
        root = self._roots.get(namespace)
        if root is None:
            if record:
                self._query_tokens += len(q)
            return MatchResult(0, _EMPTY_BLOCKS, namespace, _detached_root(namespace), self)
        self._clock += 1
        tick = self._clock
        node = root
        pos = 0
        parts: list[np.ndarray] = []
        bs = self.block_size
        while pos < limit:
            child = node.children.get(q[pos])
            if child is None:
                break
            edge = child.tokens
            end = pos + len(edge)
            if end <= limit and edge == q[pos:end]:
                matched = len(edge)
            else:
                matched = _common_prefix_length(edge, q, pos, min(len(edge), limit - pos))
            if child.start % bs and parts:
                parts[-1] = parts[-1][:-1]
            parts.append(child.blocks)
            child.last_access = tick
            child.hit_count += 1
            node = child
            pos += matched
            if matched < len(edge):
                break
        if node.evict_key is not None:
            self._evictor.refresh(node)
        # Only the final node can be a candidate (a leaf); its ancestors are re-filed when they become leaves.
        table = np.concatenate(parts)[: -(-pos // bs)] if parts else _EMPTY_BLOCKS
        if record:
            own = self._own_tokens(node, pos, request_id) if request_id is not None else 0
            self._query_tokens += len(q)
            self._hit_tokens += pos - own
            self._self_hit_tokens += own
        return MatchResult(pos, table, namespace, node, self)

    def _own_tokens(self, node: _Node, pos: int, request_id: str) -> int:
        """Of the ``pos`` matched tokens ending in ``node``, those on nodes ``request_id`` inserted.  O(depth)."""
        own = 0
        while node.parent is not None:
            if node.origin == request_id:
                own += min(node.start + len(node.tokens), pos) - node.start
            node = node.parent
        return own

    # ---- locks --------------------------------------------------------------------------------------------

    def lock(self, match: MatchResult) -> LockHandle:
        """Lock the matched path so none of its nodes (the match's node and every ancestor) can be evicted.

        O(depth).  Raises:
            LockError: the match is stale (its node was evicted since).
        """
        with self._mutex:
            if not isinstance(match, MatchResult) or match.owner is not self:
                raise LockError("lock takes a MatchResult returned by this cache's match()")
            return self._lock_node(match.node)

    def _lock_node(self, node: _Node) -> LockHandle:
        if node.evicted:
            raise LockError("cannot lock a stale match: its node was evicted after the match; match again")
        handle = LockHandle(next(self._ids), node, self)
        while node.parent is not None:
            if node.lock_count == 0:
                size = len(node.tokens)
                self._evictable_tokens -= size
                self._locked_tokens += size
                if node.evict_key is not None:
                    self._evictor.discard(node)
            node.lock_count += 1
            node = node.parent
        self._handles[handle.handle_id] = handle
        return handle

    def unlock(self, handle: LockHandle) -> None:
        """Release a lock taken by :meth:`lock`.  O(depth).

        Raises:
            LockError: the handle was already released (nothing changes).
        """
        with self._mutex:
            self._unlock(handle)

    def _unlock(self, handle: LockHandle) -> None:
        if not isinstance(handle, LockHandle):
            raise LockError(f"unlock takes the LockHandle returned by lock(), got {type(handle).__name__}")
        if handle.owner is not self:
            raise LockError("this lock handle was issued by another cache")
        if handle.released or handle.handle_id not in self._handles:
            raise LockError("lock handle released twice")
        handle.released = True
        del self._handles[handle.handle_id]
        node = handle.node
        while node.parent is not None:
            node.lock_count -= 1
            if node.lock_count == 0:
                size = len(node.tokens)
                self._locked_tokens -= size
                self._evictable_tokens += size
                if not node.children:
                    self._evictor.add(node)
            node = node.parent

    # ---- blocks -------------------------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> np.ndarray:
        """Take ``num_blocks`` blocks for the caller, evicting least valuable unlocked leaves if the pool is short.

        The caller owns the returned blocks (int32 ids) until it passes them to :meth:`insert` or :meth:`free`.

        Raises:
            CapacityError: more blocks than the pool has at all (nothing is evicted).
            OutOfBlocksError: not enough blocks even after evicting every unlocked leaf; what was evicted stays
                evicted (the cache stays consistent), nothing is allocated.
        """
        with self._mutex:
            return self._allocate(num_blocks)

    def _allocate(self, num_blocks: int) -> np.ndarray:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        pool = self.pool
        if num_blocks > pool.num_blocks:
            raise CapacityError(
                f"{num_blocks} blocks needed but the pool only has {pool.num_blocks} blocks of {self.block_size} tokens"
            )
        if num_blocks > pool.num_free_blocks:
            self._evict(num_blocks - pool.num_free_blocks)
        if num_blocks > pool.num_free_blocks:
            raise OutOfBlocksError(
                f"{num_blocks} blocks needed, {pool.num_free_blocks} free after evicting every unlocked leaf "
                f"({self._locked_tokens} tokens locked by running requests, "
                f"{int(self._owned.sum())} blocks owned by requests)"
            )
        blocks = pool.allocate(num_blocks)
        self._owned[blocks.astype(np.intp)] = True
        return blocks

    def free(self, block_ids: BlockIds) -> int:
        """Give back blocks the caller owns (from :meth:`allocate`) without caching them.  Returns blocks freed.

        Raises:
            LockError: a block is not owned by a caller (already freed, or held by the tree); nothing changes.
        """
        with self._mutex:
            index = self._as_block_ids(block_ids)
            if np.count_nonzero(self._owned[index]) != index.size or not self._distinct(index):
                raise LockError(_NOT_OWNED)
            self._owned[index] = False
            return self.pool.free_exclusive(index)

    def _as_block_ids(self, block_ids: BlockIds) -> np.ndarray:
        """``block_ids`` checked to be 1-D ints in range, as an intp array.

        intp because numpy converts any other index type on every fancy-indexing call, which costs more than the
        indexing itself on a request's short arrays.  For the same reason the checks here and below use
        ``argmin``/``argmax`` and ``count_nonzero`` rather than ufunc reductions (``min()``, ``.all()``).
        """
        try:
            ids = np.asarray(block_ids)
        except (TypeError, ValueError):
            raise InvalidArgumentError("block ids must be a 1-D sequence of ints") from None
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"block ids must be a 1-D sequence of ints, got shape {ids.shape} {ids.dtype}")
        index = ids.astype(np.intp, copy=False)
        # One range check for both ends: read as unsigned, a negative id (or a uint64 id past the intp range,
        # wrapped negative by the cast) is larger than any block id.
        unsigned = index.view(np.uintp)
        if index.size and unsigned[unsigned.argmax()] >= self.pool.num_blocks:
            raise InvalidArgumentError(f"block ids must be in 0..{self.pool.num_blocks - 1}")
        return index

    def _distinct(self, index: np.ndarray) -> bool:
        """Whether no block id is listed twice.  O(len(index)) without sorting (``np.unique`` costs ~20x more): each
        id writes its position into its scratch slot; an id listed twice keeps only one of its positions there, so
        the other one reads back wrong."""
        if len(self._positions) < index.size:
            self._positions = np.arange(index.size, dtype=np.int32)
        positions = self._positions[: index.size]
        self._slot[index] = positions
        # Comparing the bytes is one memcmp, a third of the cost of a ufunc comparison on a request's table.
        return self._slot[index].tobytes() == positions.tobytes()

    # ---- insert -------------------------------------------------------------------------------------------

    def insert(
        self, token_ids: TokenIds, block_ids: BlockIds, namespace: str | None = None, *, request_id: str | None = None
    ) -> InsertResult:
        """Cache ``token_ids`` whose KV the caller has written into ``block_ids`` (its block table).

        ``block_ids[j]`` holds positions ``j * block_size ..``; at least ``ceil(len(token_ids) / block_size)``
        ids are needed.  Leading ids may be the tree's own blocks of a prefix the caller matched and locked; the
        rest must be owned by the caller (from :meth:`allocate`).  Insert takes over the caller's ownership: the
        blocks of the new suffix move into a new leaf (splitting a node where the sequences diverge); owned blocks
        of the part that was already cached, and any beyond the sequence, are released.  The new leaf remembers
        ``request_id`` (see :attr:`CacheStats.self_hit_tokens`).

        Raises:
            InvalidTokensError, NamespaceError, InvalidArgumentError, LockError: bad input; the cache is unchanged.
        """
        q = as_token_array(token_ids)
        namespace = check_namespace(namespace)
        with self._mutex:
            return self._insert(q, self._as_block_ids(block_ids), None, namespace, request_id)

    def _insert(
        self,
        q: array,
        table: np.ndarray,
        first_owned: int | None,
        namespace: str | None,
        origin: str | None = None,
    ) -> InsertResult:
        """Insert with ``table`` from :meth:`_as_block_ids`; ``first_owned`` is found from the ownership flags when
        None (the caller's blocks follow the borrowed ones)."""
        bs = self.block_size
        n = len(q)
        need = -(-n // bs)
        if len(table) < need:
            raise InvalidArgumentError(
                f"{n} tokens need {need} blocks of {bs} tokens, but the block table has {len(table)}"
            )
        owned = self._owned[table]
        if first_owned is None:
            first = int(owned.argmax()) if owned.size else 0
            first_owned = first if owned.size and owned[first] else len(table)
        num_owned = len(table) - first_owned
        if np.count_nonzero(owned[first_owned:]) != num_owned or not self._distinct(table[first_owned:]):
            raise LockError(_NOT_OWNED)
        if first_owned:
            counts = self.pool._ref[table[:first_owned]]
            if counts[counts.argmin()] <= 0:
                raise LockError("the block table starts with blocks that are neither owned by the caller nor cached")
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node(0, None, array(TOKEN_TYPECODE), 0, _EMPTY_BLOCKS)
            root.namespace = namespace
        self._clock += 1
        tick = self._clock
        node = root
        pos = 0
        while pos < n:
            child = node.children.get(q[pos])
            if child is None:
                break
            edge = child.tokens
            end = pos + len(edge)
            if end <= n and edge == q[pos:end]:
                matched = len(edge)
            else:
                matched = _common_prefix_length(edge, q, pos, min(len(edge), n - pos))
            if matched < len(edge) and pos + matched < n:
                self._check_borrowed(pos + matched, first_owned, root)
                child = self._split(child, matched)
            child.last_access = tick
            if child.evict_key is not None:
                self._evictor.refresh(child)
            node = child
            pos += matched
            if matched < len(edge):
                break
        num_cached = pos
        if pos < n:
            self._check_borrowed(pos, first_owned, root)
            first_new = pos // bs
            leaf = _Node(next(self._ids), node, q[pos:], pos, table[first_new:need].astype(BLOCK_ID_DTYPE))
            leaf.last_access = tick
            leaf.namespace = namespace
            leaf.origin = origin
            if node.evict_key is not None:
                self._evictor.discard(node)
            node.children[q[pos]] = leaf
            self._num_nodes += 1
            self._evictable_tokens += n - pos
            self._evictor.add(leaf)
            if self._listeners:
                self._announce_leaf(leaf, q)
            released = table[first_owned:first_new]
            if need < len(table):
                released = np.concatenate((released, table[need:]))
        else:
            released = table[first_owned:]
        # Every block the caller owned now belongs to the new leaf or goes back to the pool.  Owned blocks have
        # one holder (the caller; checked above), so they are freed without decref's checks.
        self._owned[table[first_owned:]] = False
        num_released = self.pool.free_exclusive(released)
        return InsertResult(n - num_cached, num_cached, num_released)

    def _check_borrowed(self, divergence: int, first_owned: int, root: _Node) -> None:
        # The new leaf takes the caller's blocks from index divergence // block_size on; those must be owned.
        if divergence // self.block_size < first_owned:
            if root is not None and not root.children:
                del self._roots[root.namespace]
            raise InvalidArgumentError(
                f"the sequence leaves the cached path at token {divergence}, inside the borrowed (tree-owned) "
                f"blocks of the block table; blocks from index {divergence // self.block_size} must be the caller's"
            )

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node``'s edge after ``at`` tokens; return the new upper node.  ``node`` keeps its identity (and any
        lock handles pointing at it) as the lower half."""
        bs = self.block_size
        start = node.start
        first_index = start // bs
        new_start = start + at
        upper_blocks = node.blocks[: (new_start - 1) // bs - first_index + 1].copy()
        lower_blocks = node.blocks[new_start // bs - first_index :].copy()
        upper = _Node(next(self._ids), node.parent, node.tokens[:at], start, upper_blocks)
        upper.lock_count = node.lock_count
        upper.last_access = node.last_access
        upper.hit_count = node.hit_count
        upper.namespace = node.namespace
        upper.origin = node.origin
        if node.block_hashes is not None:
            owned_by_upper = new_start // bs - first_index
            upper.block_hashes = node.block_hashes[:owned_by_upper]
            node.block_hashes = node.block_hashes[owned_by_upper:]
        upper.children[node.tokens[at]] = node
        node.parent.children[node.tokens[0]] = upper
        if new_start % bs:
            self.pool.incref(lower_blocks[:1])
        node.parent = upper
        node.tokens = node.tokens[at:]
        node.start = new_start
        node.blocks = lower_blocks
        self._num_nodes += 1
        return upper

    # ---- eviction -----------------------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> EvictResult:
        """Evict unlocked leaves in policy order until ``num_blocks`` blocks were freed or none is left.

        A parent whose last child goes becomes a candidate in turn.  O(log c) per evicted leaf.
        """
        with self._mutex:
            return self._evict(num_blocks)

    def evict_all(self) -> EvictResult:
        """Evict every unlocked node."""
        with self._mutex:
            return self._evict(self.pool.num_blocks + 1)

    def _evict(self, num_blocks: int) -> EvictResult:
        freed = nodes = tokens = 0
        evictor = self._evictor
        pool = self.pool
        bs = self.block_size
        events: list[KVEvent] = []
        while freed < num_blocks and len(evictor):
            # Unlink leaves until their blocks should cover what is asked, then release all their blocks in one
            # decref: a decref per leaf would cost more than the rest of the eviction.  A leaf's blocks have no other
            # holder, except that a leaf starting inside a block may share that first block with its parent; such a
            # block is released at once and not counted.  The outer loop goes by what decref actually freed, so the
            # count here only sizes the batch.
            batch: list[np.ndarray] = []
            expected = 0
            while freed + expected < num_blocks and len(evictor):
                leaf = evictor.pop()
                parent = leaf.parent
                del parent.children[leaf.tokens[0]]
                if self._listeners and leaf.block_hashes:
                    events.append(BlockRemoved(leaf.namespace, tuple(leaf.block_hashes)))
                blocks = leaf.blocks
                if leaf.start % bs and pool.ref_count(blocks.item(0)) > 1:
                    pool.decref(blocks[:1])
                    blocks = blocks[1:]
                batch.append(blocks)
                expected += len(blocks)
                size = len(leaf.tokens)
                tokens += size
                nodes += 1
                self._evictable_tokens -= size
                self._num_nodes -= 1
                leaf.evicted = True
                if parent.parent is not None:
                    if not parent.children and parent.lock_count == 0:
                        evictor.add(parent)
                elif not parent.children:
                    del self._roots[parent.namespace]
            freed += pool.decref(batch[0] if len(batch) == 1 else np.concatenate(batch))
        self._evictions += nodes
        self._evicted_tokens += tokens
        self._evicted_blocks += freed
        if nodes:
            logger.debug("evicted %d nodes: %d tokens, %d blocks freed (%d asked)", nodes, tokens, freed, num_blocks)
            if self._listeners:
                if not self._roots:
                    events.append(AllCleared())
                self._emit(events)
        return EvictResult(freed, nodes, tokens)

    # ---- request-level ------------------------------------------------------------------------------------

    def acquire(self, token_ids: TokenIds, namespace: str | None = None, *, request_id: str | None = None) -> Lease:
        """Admit a request: match at most ``len - 1`` prompt tokens, lock their whole blocks, and copy the rows of a
        partially matched last block into a block the request owns (copy-on-write).  The copy is made at once, so
        the partial block's node stays evictable; if not even one block can be found for it, those rows are left
        to be recomputed (``num_cached_tokens`` drops to the block boundary) rather than failing the request.

        ``request_id`` names the request in the stats: tokens it finds that it inserted itself (a retry) count as
        self-hits, and :meth:`commit` marks what it inserts with it.  Each call counts as one request in the
        recent hit rate window.

        Raises:
            InvalidTokensError, NamespaceError: bad input.
        It never runs out of blocks: the copy falls back to recomputation as said above.
        """
        q = as_token_array(token_ids)
        namespace = check_namespace(namespace)
        with self._mutex:
            match = self._match(q, namespace, len(q) - 1, record=False)
            bs = self.block_size
            table = match.block_table.copy()
            num_cached = match.num_tokens
            copied = num_cached % bs
            aligned = num_cached - copied
            own = self._own_tokens(match.node, num_cached, request_id) if request_id is not None else 0
            end = self._lock_point(match.node, aligned)
            handle = self._lock_node(end)
            first_owned = len(table)
            if copied:
                private = self._copy_partial_block(int(table[-1]), copied, handle)
                if private is None:
                    # Too tight to copy: recompute those rows instead of failing the request.
                    table = table[:-1]
                    own = self._own_tokens(end, aligned, request_id) if request_id is not None else 0
                    num_cached, copied = aligned, 0
                else:
                    table[-1] = private
                first_owned -= 1
            self._query_tokens += len(q)
            self._hit_tokens += num_cached - own
            self._self_hit_tokens += own
            self._record_request(len(q), num_cached - own)
            lease = Lease(q, namespace, num_cached, copied, table, first_owned, handle, self.block_size)
            lease.request_id = request_id
            return lease

    def _copy_partial_block(self, source: int, num_rows: int, handle: LockHandle) -> int | None:
        """Copy-on-write: a block owned by the caller holding the first ``num_rows`` rows of ``source``, or None
        if no block can be had.  Only the block-aligned prefix of a match is locked, so finding the block may
        evict ``source``'s node: a temporary reference keeps its rows alive meanwhile, and if that reference is
        all that is left of it, the block itself is taken over (nothing to copy).  On any other error the lock
        ``handle`` is released."""
        pool = self.pool
        pool.incref([source])
        try:
            private = self._allocate(1)
        except OutOfBlocksError:
            if pool.ref_count(source) == 1:
                self._owned[source] = True
                return source
            pool.decref([source])
            return None
        except BaseException:
            pool.decref([source])
            self._unlock(handle)
            raise
        try:
            pool.copy_rows(source, int(private[0]), num_rows)
        except BaseException:
            self._owned[private] = False
            pool.decref(private)
            pool.decref([source])
            self._unlock(handle)
            raise
        pool.decref([source])
        return int(private[0])

    def _lock_point(self, node: _Node, aligned: int) -> _Node:
        """The node whose lock protects exactly the first ``aligned`` tokens (the whole blocks of a match): the node
        holding token ``aligned - 1``, split at ``aligned`` if its edge goes on, so the lock pins neither an
        unmatched tail nor the partial block the request has copied (a lone request that fits the pool must be
        able to evict them).  Lookup never splits; admission does.  The root when ``aligned == 0``."""
        while node.parent is not None and node.start >= aligned:
            node = node.parent
        if node.parent is not None and node.end > aligned:
            node = self._split(node, aligned - node.start)
        return node

    def _record_request(self, query_tokens: int, hit_tokens: int) -> None:
        window = self._window
        if len(window) == window.maxlen:
            old_query, old_hit = window[0]
            self._window_query_tokens -= old_query
            self._window_hit_tokens -= old_hit
        window.append((query_tokens, hit_tokens))
        self._window_query_tokens += query_tokens
        self._window_hit_tokens += hit_tokens

    def reserve(self, lease: Lease, num_tokens: int) -> np.ndarray:
        """Grow the lease's block table to address ``num_tokens`` tokens (evicting if needed); returns the table.

        Raises:
            CapacityError: ``num_tokens`` exceed the whole pool.  OutOfBlocksError: as :meth:`allocate`.
            LockError: the lease is closed.
        """
        with self._mutex:
            self._check_lease(lease, "reserve")
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
                raise InvalidArgumentError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
            need = -(-num_tokens // self.block_size) - len(lease.block_table)
            if need > 0:
                if -(-num_tokens // self.block_size) > self.pool.num_blocks:
                    raise CapacityError(
                        f"{num_tokens} tokens need {-(-num_tokens // self.block_size)} blocks; "
                        f"the pool holds {self.pool.num_blocks} blocks of {self.block_size} tokens"
                    )
                lease.block_table = np.concatenate((lease.block_table, self._allocate(need)))
            return lease.block_table

    def commit(self, lease: Lease, token_ids: TokenIds) -> InsertResult:
        """Insert the request's tokens (prompt and anything generated after it, all with KV written) and close the
        lease: the new suffix is cached, duplicate blocks released, the lock dropped.

        Raises:
            InvalidTokensError: ``token_ids`` do not start with the lease's matched prefix (the lease stays open:
                call :meth:`release`).
            InvalidArgumentError: the tokens need more blocks than the lease holds (call :meth:`reserve` first;
                the lease stays open).
            LockError: the lease is closed.
        """
        q = as_token_array(token_ids)
        with self._mutex:
            self._check_lease(lease, "commit")
            m = lease.num_cached_tokens
            prompt = lease.token_ids
            shared = min(len(q), len(prompt))
            if len(q) < m or q[:shared] != prompt[:shared]:
                raise InvalidTokensError(
                    "committed tokens must start with the prefix the lease matched and agree with its prompt: the "
                    "prompt (or a prefix of it at least as long as the match) followed by tokens computed after it"
                )
            table = self._as_block_ids(lease.block_table)
            result = self._insert(q, table, lease.first_owned_block, lease.namespace, lease.request_id)
            lease.closed = True
            self._unlock(lease.lock)
            return result

    def release(self, lease: Lease) -> None:
        """Drop a lease without caching anything: free its own blocks and unlock its prefix.

        Raises:
            LockError: the lease is already closed.
        """
        with self._mutex:
            self._check_lease(lease, "release", closed_message="lease released twice")
            lease.closed = True
            owned = lease.block_table[lease.first_owned_block :].astype(np.intp)
            if not self._owned[owned].all():
                self._unlock(lease.lock)
                raise LockError(
                    "the lease's own blocks were already given away (inserted or freed directly); its lock is "
                    "released, its blocks left with their holders"
                )
            self._owned[owned] = False
            self.pool.decref(owned)
            self._unlock(lease.lock)

    def _check_lease(self, lease: Lease, what: str, closed_message: str | None = None) -> None:
        if not isinstance(lease, Lease) or lease.lock.owner is not self:
            raise LockError(f"{what} takes a Lease returned by this cache's acquire()")
        if lease.closed:
            raise LockError(closed_message or f"{what} on a closed lease")
        if lease.lock.released:
            raise LockError(f"{what} on a lease whose lock was released directly; release() it")

    # ---- observation --------------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """A consistent snapshot of sizes and counters.  O(1)."""
        with self._mutex:
            pool = self.pool
            return CacheStats(
                num_blocks=pool.num_blocks,
                block_size=self.block_size,
                free_blocks=pool.num_free_blocks,
                used_blocks=pool.num_used_blocks,
                cached_tokens=self._evictable_tokens + self._locked_tokens,
                evictable_tokens=self._evictable_tokens,
                locked_tokens=self._locked_tokens,
                num_nodes=self._num_nodes,
                query_tokens=self._query_tokens,
                hit_tokens=self._hit_tokens,
                evictions=self._evictions,
                evicted_tokens=self._evicted_tokens,
                evicted_blocks=self._evicted_blocks,
                self_hit_tokens=self._self_hit_tokens,
                window_requests=len(self._window),
                window_query_tokens=self._window_query_tokens,
                window_hit_tokens=self._window_hit_tokens,
            )

    # ---- KV events ----------------------------------------------------------------------------------------

    def subscribe(self, callback: EventListener) -> None:
        """Send KV events (:mod:`prefixcache.events`) to ``callback`` from now on, starting with a
        :class:`~prefixcache.events.BlockStored` for every full block already cached, so its view is complete.

        O(cached tokens): every node's block hashes are recomputed.
        """
        with self._mutex:
            self._listeners.append(callback)
            self._emit(self._hash_tree(), [callback])

    def unsubscribe(self, callback: EventListener) -> None:
        """Stop sending events to ``callback``.

        Raises:
            InvalidArgumentError: ``callback`` is not subscribed.
        """
        with self._mutex:
            if callback not in self._listeners:
                raise InvalidArgumentError("unsubscribe: that callback is not subscribed")
            self._listeners.remove(callback)

    def _emit(self, events: list[KVEvent], listeners: list[EventListener] | None = None) -> None:
        for event in events:
            for callback in listeners if listeners is not None else tuple(self._listeners):
                try:
                    callback(event)
                except BaseException:  # noqa: B036 - a listener must never leave the tree half-updated
                    logger.exception("KV event listener %r failed on %s", callback, type(event).__name__)

    def _announce_leaf(self, leaf: _Node, q: array) -> None:
        """Hash the full blocks a new leaf owns (those ending inside it) and announce them."""
        bs = self.block_size
        first = leaf.start // bs
        parent_hash = self._hash_before(leaf.parent, first)
        leaf.block_hashes = chain_hashes(q, bs, parent_hash, self.hash_seed, first, len(q) // bs)
        if leaf.block_hashes:
            self._emit([self._stored_event(leaf, q, parent_hash)])

    def _hash_before(self, node: _Node, block: int) -> int:
        """The hash of block ``block - 1`` on the path ending at ``node`` (the root hash for block 0).  O(depth)."""
        if block == 0:
            return namespace_root_hash(node.namespace, self.hash_seed)
        last = block * self.block_size - 1
        while node.start > last:
            node = node.parent
        return node.block_hashes[block - 1 - node.start // self.block_size]

    def _stored_event(self, node: _Node, path: array, parent_hash: int) -> BlockStored:
        bs = self.block_size
        first = node.start // bs
        tokens = tuple(path[first * bs : (first + len(node.block_hashes)) * bs])
        return BlockStored(node.namespace, tuple(node.block_hashes), parent_hash, first, tokens, bs)

    def _hash_tree(self) -> list[BlockStored]:
        """Recompute every node's block hashes; return a BlockStored event per node owning full blocks."""
        bs, seed = self.block_size, self.hash_seed
        events: list[BlockStored] = []
        for namespace, root in self._roots.items():
            stack = [(child, root.tokens, namespace_root_hash(namespace, seed)) for child in root.children.values()]
            while stack:
                node, prefix, parent_hash = stack.pop()
                path = prefix + node.tokens
                node.block_hashes = chain_hashes(path, bs, parent_hash, seed, node.start // bs, node.end // bs)
                if node.block_hashes:
                    events.append(self._stored_event(node, path, parent_hash))
                last = node.block_hashes[-1] if node.block_hashes else parent_hash
                stack.extend((child, path, last) for child in node.children.values())
        return events

    def cached_sequences(self, namespace: str | None = None) -> list[list[int]]:
        """Every root-to-leaf token sequence cached in ``namespace`` (for tests and debugging; O(tokens))."""
        with self._mutex:
            root = self._roots.get(namespace)
            out: list[list[int]] = []
            stack = [(root, [])] if root is not None else []
            while stack:
                node, prefix = stack.pop()
                path = prefix + node.tokens.tolist()
                if not node.children and node.parent is not None:
                    out.append(path)
                stack.extend((child, path) for child in node.children.values())
            return out

    def check_invariants(self) -> None:
        """Recompute every piece of bookkeeping from scratch and compare.  O(total tokens).

        Checks: the pool's free list holds exactly the blocks of count 0; every count equals its holders (tree
        nodes holding the block plus one if a caller owns it); node blocks are in range and never caller-owned;
        edges are non-empty, keyed by first token, at the right positions, with the right number of blocks;
        lock counts equal the live handles through each node; locked and evictable token totals; the eviction
        candidates are exactly the unlocked leaves, filed under their current priority; the node count.

        Raises:
            AssertionError: naming the first broken invariant.
        """
        with self._mutex:
            self._check_invariants()

    def _check_invariants(self) -> None:
        def fail(message: str) -> None:
            raise AssertionError(message)

        pool = self.pool
        bs = self.block_size
        pool.check_invariants()
        expected_locks: dict[int, int] = {}
        for handle in self._handles.values():
            if handle.released:
                fail("a released handle is still registered")
            node = handle.node
            if node.evicted:
                fail("a locked node was evicted")
            while node.parent is not None:
                expected_locks[node.node_id] = expected_locks.get(node.node_id, 0) + 1
                node = node.parent
        held: list[np.ndarray] = []
        locked = evictable = count = 0
        candidates = set()
        for namespace, root in self._roots.items():
            if root.parent is not None or root.namespace != namespace or len(root.tokens) or root.start:
                fail("malformed root")
            if not root.children:
                fail(f"empty root kept for namespace {namespace!r}")
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                count += 1
                parent = node.parent
                size = len(node.tokens)
                if size == 0:
                    fail(f"node {node.node_id} has an empty edge")
                if parent.children.get(node.tokens[0]) is not node:
                    fail(f"node {node.node_id} is not filed under its first token")
                if node.start != parent.start + len(parent.tokens):
                    fail(f"node {node.node_id} starts at {node.start}, its parent ends at {parent.end}")
                if node.namespace != namespace or node.evicted:
                    fail(f"node {node.node_id} has the wrong namespace or is marked evicted")
                if len(node.blocks) != (node.end - 1) // bs - node.start // bs + 1:
                    fail(f"node {node.node_id} holds {len(node.blocks)} blocks for positions {node.start}..{node.end}")
                if node.lock_count != expected_locks.get(node.node_id, 0):
                    fail(f"node {node.node_id} lock count {node.lock_count} != {expected_locks.get(node.node_id, 0)}")
                if node.lock_count:
                    locked += size
                else:
                    evictable += size
                    if not node.children:
                        candidates.add(node.node_id)
                if (node.evict_key is not None) != (not node.children and node.lock_count == 0):
                    fail(f"node {node.node_id} candidate status is wrong")
                if self._listeners and len(node.block_hashes or ()) != node.end // bs - node.start // bs:
                    fail(f"node {node.node_id} keeps {len(node.block_hashes or ())} block hashes")
                if node.evict_key is not None and node.evict_key != (*self.policy.priority(node), node.node_id):
                    fail(f"node {node.node_id} is filed under a stale eviction key")
                held.append(node.blocks)
                stack.extend(node.children.values())
        all_blocks = np.concatenate(held) if held else _EMPTY_BLOCKS
        if all_blocks.size and (all_blocks.min() < 0 or all_blocks.max() >= pool.num_blocks):
            fail("a node refers to a block outside the pool")
        holders = np.bincount(all_blocks, minlength=pool.num_blocks)
        if (holders[self._owned] > 0).any():
            fail("a block is both owned by a caller and held by the tree")
        holders += self._owned
        if not np.array_equal(holders, pool._ref):
            bad = np.flatnonzero(holders != pool._ref)[:5].tolist()
            fail(f"reference counts differ from holders for blocks {bad}")
        if pool.num_free_blocks + int((holders > 0).sum()) != pool.num_blocks:
            fail("free + referenced != capacity")
        if count != self._num_nodes:
            fail(f"node count {self._num_nodes} != {count}")
        if (locked, evictable) != (self._locked_tokens, self._evictable_tokens):
            fail(
                f"token totals locked/evictable {self._locked_tokens}/{self._evictable_tokens} != {locked}/{evictable}"
            )
        if {node.node_id for node in self._evictor.members()} != candidates or len(self._evictor) != len(candidates):
            fail("eviction candidates differ from the unlocked leaves")


def _detached_root(namespace: str | None) -> _Node:
    root = _Node(0, None, array(TOKEN_TYPECODE), 0, _EMPTY_BLOCKS)
    root.namespace = namespace
    return root


def _common_prefix_length(edge: array, q: array, pos: int, limit: int) -> int:
    """Length of the common prefix of ``edge[:limit]`` and ``q[pos:pos + limit]``; O(limit) C-speed work in
    O(log limit) slice comparisons."""
    lo, hi = 0, limit
    if edge[:hi] == q[pos : pos + hi]:
        return hi
    mv_edge, mv_q = memoryview(edge), memoryview(q)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mv_edge[lo:mid] == mv_q[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
