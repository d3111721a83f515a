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
import threading
from array import array
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
from prefixcache.evictor import EvictionPolicy, Evictor
from prefixcache.pool import BLOCK_ID_DTYPE, BlockIds, KVBlockPool
from prefixcache.tokens import TOKEN_TYPECODE, TokenIds, as_token_array

_EMPTY_BLOCKS = np.zeros(0, dtype=BLOCK_ID_DTYPE)


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
    :meth:`RadixCache.acquire`; ``hit_rate = hit_tokens / query_tokens``.
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

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class LockHandle:
    """Proof that a matched path is locked; give it back to :meth:`RadixCache.unlock` exactly once."""

    __slots__ = ("handle_id", "node", "released")

    def __init__(self, handle_id: int, node: _Node) -> None:
        self.handle_id = handle_id
        self.node = node
        self.released = False


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
    """

    def __init__(self, pool: KVBlockPool, policy: str | EvictionPolicy = "lru") -> None:
        if not isinstance(pool, KVBlockPool):
            raise InvalidArgumentError(f"pool must be a KVBlockPool, got {type(pool).__name__}")
        self.pool = pool
        self.block_size = pool.block_size
        self._evictor = Evictor(policy)
        self._roots: dict[str | None, _Node] = {}
        self._owned = np.zeros(pool.num_blocks, dtype=bool)
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

    @property
    def policy(self) -> EvictionPolicy:
        return self._evictor.policy

    # ---- lookup -------------------------------------------------------------------------------------------

    def match(self, token_ids: TokenIds, namespace: str | None = None, *, for_prefill: bool = False) -> MatchResult:
        """Longest cached prefix of ``token_ids`` in ``namespace``.

        With ``for_prefill=True`` at most ``len(token_ids) - 1`` tokens are matched: a request must compute at
        least its last token to get logits.  With ``for_prefill=False`` (pure lookup) a fully cached sequence
        matches in full.  Does not change the tree's shape; refreshes the access time (and LFU hit count) of the
        matched path; counts the query in :meth:`stats`.

        Raises:
            InvalidTokensError, NamespaceError: bad input (nothing changes).
        """
        q = as_token_array(token_ids)
        namespace = check_namespace(namespace)
        with self._mutex:
            return self._match(q, namespace, len(q) - 1 if for_prefill else len(q), record=True)

    def _match(self, q: array, namespace: str | None, limit: int, *, record: bool) -> MatchResult:
        root = self._roots.get(namespace)
        if root is None:
            if record:
                self._query_tokens += len(q)
            return MatchResult(0, _EMPTY_BLOCKS, namespace, _detached_root(namespace))
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
            self._query_tokens += len(q)
            self._hit_tokens += pos
        return MatchResult(pos, table, namespace, node)

    # ---- locks --------------------------------------------------------------------------------------------

    def lock(self, match: MatchResult) -> LockHandle:
        """Lock the matched path so none of its nodes (the match's node and every ancestor) can be evicted.

        O(depth).  Raises:
            LockError: the match is stale (its node was evicted since).
        """
        with self._mutex:
            return self._lock_node(match.node)

    def _lock_node(self, node: _Node) -> LockHandle:
        if node.evicted:
            raise LockError("cannot lock a stale match: its node was evicted after the match; match again")
        handle = LockHandle(next(self._ids), node)
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
        self._owned[blocks] = True
        return blocks

    def free(self, block_ids: BlockIds) -> int:
        """Give back blocks the caller owns (from :meth:`allocate`) without caching them.  Returns blocks freed.

        Raises:
            LockError: a block is not owned by a caller (already freed, or held by the tree); nothing changes.
        """
        with self._mutex:
            ids = self._check_owned(block_ids)
            self._owned[ids] = False
            return self.pool.decref(ids)

    def _as_block_ids(self, block_ids: BlockIds) -> np.ndarray:
        try:
            ids = np.asarray(block_ids)
        except (TypeError, ValueError):
            raise InvalidArgumentError("block ids must be a 1-D sequence of ints") from None
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"block ids must be a 1-D sequence of ints, got shape {ids.shape} {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.pool.num_blocks):
            raise InvalidArgumentError(f"block ids must be in 0..{self.pool.num_blocks - 1}")
        return ids.astype(BLOCK_ID_DTYPE, copy=False)

    def _check_owned(self, block_ids: BlockIds) -> np.ndarray:
        ids = self._as_block_ids(block_ids)
        if ids.size == 0:
            return ids
        if not self._owned[ids].all() or np.unique(ids).size != ids.size:
            raise LockError("block(s) not owned by the caller: freed already, held by the tree, or listed twice")
        return ids

    # ---- insert -------------------------------------------------------------------------------------------

    def insert(self, token_ids: TokenIds, block_ids: BlockIds, namespace: str | None = None) -> InsertResult:
        """Cache ``token_ids`` whose KV the caller has written into ``block_ids`` (its block table).

        ``block_ids[j]`` holds positions ``j * block_size ..``; at least ``ceil(len(token_ids) / block_size)``
        ids are needed.  Leading ids may be the tree's own blocks of a prefix the caller matched and locked; the
        rest must be owned by the caller (from :meth:`allocate`).  Insert takes over the caller's ownership: the
        blocks of the new suffix move into a new leaf (splitting a node where the sequences diverge); owned blocks
        of the part that was already cached, and any beyond the sequence, are released.

        Raises:
            InvalidTokensError, NamespaceError, InvalidArgumentError, LockError: bad input; the cache is unchanged.
        """
        q = as_token_array(token_ids)
        namespace = check_namespace(namespace)
        with self._mutex:
            table = self._as_block_ids(block_ids)
            owned = self._owned[table]
            first_owned = int(np.argmax(owned)) if owned.any() else len(table)
            return self._insert(q, table, first_owned, namespace)

    def _insert(self, q: array, table: np.ndarray, first_owned: int, namespace: str | None) -> InsertResult:
        bs = self.block_size
        n = len(q)
        need = -(-n // bs)
        if len(table) < need:
            raise InvalidArgumentError(
                f"{n} tokens need {need} blocks of {bs} tokens, but the block table has {len(table)}"
            )
        self._check_owned(table[first_owned:])
        if first_owned and (self.pool._ref[table[:first_owned]] <= 0).any():
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
            leaf = _Node(next(self._ids), node, q[pos:], pos, table[first_new:need].copy())
            leaf.last_access = tick
            leaf.namespace = namespace
            if node.evict_key is not None:
                self._evictor.discard(node)
            node.children[q[pos]] = leaf
            self._num_nodes += 1
            self._evictable_tokens += n - pos
            self._evictor.add(leaf)
            self._owned[leaf.blocks] = False
            released = np.concatenate((table[first_owned:first_new], table[need:]))
        else:
            released = table[first_owned:]
        self._owned[released] = False
        num_released = self.pool.decref(released)
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
        while freed < num_blocks and len(evictor):
            leaf = evictor.pop()
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            freed += self.pool.decref(leaf.blocks)
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
        self._evictions += nodes
        self._evicted_tokens += tokens
        self._evicted_blocks += freed
        return EvictResult(freed, nodes, tokens)

    # ---- request-level ------------------------------------------------------------------------------------

    def acquire(self, token_ids: TokenIds, namespace: str | None = None) -> Lease:
        """Admit a request: match at most ``len - 1`` prompt tokens, lock them, and copy the rows of a partially
        matched last block into a block the request owns (copy-on-write).

        Raises:
            InvalidTokensError, NamespaceError: bad input.
            OutOfBlocksError: no block for the copy even after eviction (nothing is held afterwards).
        """
        q = as_token_array(token_ids)
        namespace = check_namespace(namespace)
        with self._mutex:
            match = self._match(q, namespace, len(q) - 1, record=True)
            handle = self._lock_node(match.node)
            table = match.block_table.copy()
            first_owned = len(table)
            copied = match.num_tokens % self.block_size
            if copied:
                try:
                    private = self._allocate(1)
                except BaseException:
                    self._unlock(handle)
                    raise
                self.pool.copy_rows(int(table[-1]), int(private[0]), copied)
                table[-1] = private[0]
                first_owned -= 1
            return Lease(q, namespace, match.num_tokens, copied, table, first_owned, handle, self.block_size)

    def reserve(self, lease: Lease, num_tokens: int) -> np.ndarray:
        """Grow the lease's block table to address ``num_tokens`` tokens (evicting if needed); returns the table.

        Raises:
            CapacityError: ``num_tokens`` exceed the whole pool.  OutOfBlocksError: as :meth:`allocate`.
            LockError: the lease is closed.
        """
        with self._mutex:
            if lease.closed:
                raise LockError("reserve on a closed lease")
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
            InvalidTokensError: ``token_ids`` do not start with the lease's matched prefix, or need more blocks than
                the lease holds (the lease stays open: call :meth:`release`).
            LockError: the lease is closed.
        """
        q = as_token_array(token_ids)
        with self._mutex:
            if lease.closed:
                raise LockError("commit on a closed lease")
            m = lease.num_cached_tokens
            if len(q) < m or q[:m] != lease.token_ids[:m]:
                raise InvalidTokensError("committed tokens must start with the prefix the lease matched")
            result = self._insert(q, lease.block_table, lease.first_owned_block, lease.namespace)
            lease.closed = True
            self._unlock(lease.lock)
            return result

    def release(self, lease: Lease) -> None:
        """Drop a lease without caching anything: free its own blocks and unlock its prefix.

        Raises:
            LockError: the lease is already closed.
        """
        with self._mutex:
            if lease.closed:
                raise LockError("lease released twice")
            lease.closed = True
            owned = lease.block_table[lease.first_owned_block :]
            self._owned[owned] = False
            self.pool.decref(owned)
            self._unlock(lease.lock)

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
            )

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
