"""The radix tree: every cached token-id prefix, mapped to the pool blocks that hold its KV.

The idea is SGLang's RadixAttention (Zheng et al., "SGLang: Efficient Execution of Structured Language Model
Programs", 2024): a compressed trie keyed on exact token ids whose edges carry the KV of their tokens, shared by
every request that starts with them, with reference-counted blocks and eviction of unlocked leaves.

How tokens map to blocks.  A node's edge holds the tokens at absolute positions ``[start, start + len)`` of every
sequence through it, and ``blocks`` holds the pool blocks for block indices ``start // block_size`` up to
``(end - 1) // block_size``.  The KV of position ``p`` lives in row ``p % block_size`` of the block of index
``p // block_size``.  When an edge starts inside a block, its first block also holds (valid copies of) the rows of
the earlier positions in that block; that block is shared with the parent when it came from splitting a node, and
private to the edge when a request computed or copied it.  So the block table of a path is the concatenation of
its nodes' blocks where a deeper node's first block replaces its parent's last one.

Matches are token-exact (longest common prefix, not rounded down to blocks), and a lookup never changes the tree's
shape; only :meth:`RadixTree.insert` and :meth:`RadixTree.lock_point` (admission) split nodes.

This module is the tree alone: search, insert, split, lock counts on paths, evicting leaves.  Who owns which block
(:mod:`prefixcache.cache.blocks`), request admission (:mod:`prefixcache.cache.admission`), hit accounting
(:mod:`prefixcache.cache.stats`) and the public, thread-safe face of it all (:mod:`prefixcache.cache.radix_cache`)
live beside it.  Nothing here takes a lock: callers hold the cache's mutex.
"""

from __future__ import annotations

import itertools
import logging
from array import array
from dataclasses import dataclass, field

import numpy as np

from prefixcache.cache.events import AllCleared, BlockRemoved, EventPublisher, KVEvent
from prefixcache.cache.evictor import Evictor
from prefixcache.cache.node import EMPTY_BLOCKS, Node, common_prefix_length, new_root
from prefixcache.cache.pool import BLOCK_ID_DTYPE, KVBlockPool
from prefixcache.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached prefix of a query.

    ``num_tokens`` is exact (not rounded to blocks).  ``block_table`` (int32, ``ceil(num_tokens / block_size)``
    block ids) addresses the KV of those tokens; when ``num_tokens % block_size != 0`` its last block is shared and
    only its first ``num_tokens % block_size`` rows belong to this prefix.  ``node`` is what
    :meth:`~prefixcache.RadixCache.lock` takes; the result goes stale if that node is evicted before it is locked.
    """

    num_tokens: int
    block_table: np.ndarray
    namespace: str | None
    node: Node = field(repr=False)
    owner: object = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What an insert did: tokens newly cached, tokens that were cached already, blocks released."""

    num_new_tokens: int
    num_cached_tokens: int
    num_released_blocks: int


@dataclass(frozen=True, slots=True)
class EvictResult:
    """What one eviction call freed: blocks, tree nodes (leaves), tokens."""

    num_blocks: int
    num_nodes: int
    num_tokens: int


class RadixTree:
    """The nodes of every namespace (one root each), their lock counts and the eviction candidates.

    Sizes kept incrementally (O(1) to read): ``num_nodes``, ``evictable_tokens`` (on unlocked nodes),
    ``locked_tokens``, and the eviction totals ``evictions`` (leaves), ``evicted_tokens``, ``evicted_blocks``.
    Complexities: :meth:`match` and :meth:`insert` cost O(depth) dict lookups plus O(n) C-speed token comparison;
    evicting one leaf costs O(log c) in the number ``c`` of eviction candidates.
    """

    def __init__(self, pool: KVBlockPool, evictor: Evictor, events: EventPublisher) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.evictor = evictor
        self.events = events
        self.roots: dict[str | None, Node] = {}
        self.clock = 0
        self.num_nodes = 0
        self.evictable_tokens = 0
        self.locked_tokens = 0
        self.evictions = 0
        self.evicted_tokens = 0
        self.evicted_blocks = 0
        self._ids = itertools.count(1)

    # ---- lookup -------------------------------------------------------------------------------------------

    def match(self, q: array, namespace: str | None, limit: int, owner: object) -> MatchResult:
        """Longest cached prefix of ``q[:limit]``: refreshes the matched path's access time and hit count, never
        changes the tree's shape.  ``owner`` is stamped on the result (the cache that may lock it)."""
        root = self.roots.get(namespace)
        if root is None:
            return MatchResult(0, EMPTY_BLOCKS, namespace, new_root(namespace), owner)
        self.clock += 1
        tick = self.clock
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
                matched = common_prefix_length(edge, q, pos, min(len(edge), limit - pos))
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
            self.evictor.refresh(node)
        # Only the final node can be a candidate (a leaf); its ancestors are re-filed when they become leaves.
        table = np.concatenate(parts)[: -(-pos // bs)] if parts else EMPTY_BLOCKS
        return MatchResult(pos, table, namespace, node, owner)

    @staticmethod
    def own_tokens(node: Node, pos: int, request_id: str) -> int:
        """Of the ``pos`` matched tokens ending in ``node``, those on nodes ``request_id`` inserted.  O(depth)."""
        own = 0
        while node.parent is not None:
            if node.origin == request_id:
                own += min(node.start + len(node.tokens), pos) - node.start
            node = node.parent
        return own

    # ---- lock counts --------------------------------------------------------------------------------------

    def lock_path(self, node: Node) -> None:
        """Add one lock to ``node`` and every ancestor: none of them can be evicted until :meth:`unlock_path`."""
        while node.parent is not None:
            if node.lock_count == 0:
                size = len(node.tokens)
                self.evictable_tokens -= size
                self.locked_tokens += size
                if node.evict_key is not None:
                    self.evictor.discard(node)
            node.lock_count += 1
            node = node.parent

    def unlock_path(self, node: Node) -> None:
        """Take one lock off ``node`` and every ancestor; unlocked leaves become eviction candidates."""
        while node.parent is not None:
            node.lock_count -= 1
            if node.lock_count == 0:
                size = len(node.tokens)
                self.locked_tokens -= size
                self.evictable_tokens += size
                if not node.children:
                    self.evictor.add(node)
            node = node.parent

    def lock_point(self, node: Node, aligned: int) -> Node:
        """The node whose lock protects exactly the first ``aligned`` tokens (the whole blocks of a match): the node
        holding token ``aligned - 1``, split at ``aligned`` if its edge goes on, so the lock pins neither an
        unmatched tail nor the partial block the request has copied (a lone request that fits the pool must be
        able to evict them).  Lookup never splits; admission does.  The root when ``aligned == 0``."""
        while node.parent is not None and node.start >= aligned:
            node = node.parent
        if node.parent is not None and node.end > aligned:
            node = self.split(node, aligned - node.start)
        return node

    # ---- insert -------------------------------------------------------------------------------------------

    def insert(
        self, q: array, table: np.ndarray, first_owned: int, namespace: str | None, origin: str | None
    ) -> tuple[int, np.ndarray]:
        """Cache ``q`` whose KV is in ``table`` (at least ``ceil(len(q) / block_size)`` ids, checked by the
        caller); ``table[first_owned:]`` are the caller's blocks, which the new leaf takes where it needs them.

        Returns the number of tokens that were cached already and the caller's blocks the tree did not take
        (the caller releases them).

        Raises:
            InvalidArgumentError: the sequence leaves the cached path inside the borrowed blocks
                ``table[:first_owned]``; the tree is unchanged.
        """
        bs = self.block_size
        n = len(q)
        need = -(-n // bs)
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = new_root(namespace)
        self.clock += 1
        tick = self.clock
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
                matched = common_prefix_length(edge, q, pos, min(len(edge), n - pos))
            if matched < len(edge) and pos + matched < n:
                self._check_borrowed(pos + matched, first_owned, root)
                child = self.split(child, matched)
            child.last_access = tick
            if child.evict_key is not None:
                self.evictor.refresh(child)
            node = child
            pos += matched
            if matched < len(edge):
                break
        num_cached = pos
        if pos < n:
            self._check_borrowed(pos, first_owned, root)
            first_new = pos // bs
            leaf = Node(next(self._ids), node, q[pos:], pos, table[first_new:need].astype(BLOCK_ID_DTYPE))
            leaf.last_access = tick
            leaf.namespace = namespace
            leaf.origin = origin
            if node.evict_key is not None:
                self.evictor.discard(node)
            node.children[q[pos]] = leaf
            self.num_nodes += 1
            self.evictable_tokens += n - pos
            self.evictor.add(leaf)
            if self.events.listeners:
                self.events.announce_leaf(leaf, q)
            released = table[first_owned:first_new]
            if need < len(table):
                released = np.concatenate((released, table[need:]))
        else:
            released = table[first_owned:]
        return num_cached, released

    def _check_borrowed(self, divergence: int, first_owned: int, root: Node) -> None:
        # The new leaf takes the caller's blocks from index divergence // block_size on; those must be owned.
        if divergence // self.block_size < first_owned:
            if not root.children:
                del self.roots[root.namespace]
            raise InvalidArgumentError(
                f"the sequence leaves the cached path at token {divergence}, inside the borrowed (tree-owned) "
                f"blocks of the block table; blocks from index {divergence // self.block_size} must be the caller's"
            )

    def split(self, node: Node, at: int) -> Node:
        """Cut ``node``'s edge after ``at`` tokens; return the new upper node.  ``node`` keeps its identity (and any
        lock handles pointing at it) as the lower half."""
        bs = self.block_size
        start = node.start
        first_index = start // bs
        new_start = start + at
        upper_blocks = node.blocks[: (new_start - 1) // bs - first_index + 1].copy()
        lower_blocks = node.blocks[new_start // bs - first_index :].copy()
        upper = Node(next(self._ids), node.parent, node.tokens[:at], start, upper_blocks)
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
        self.num_nodes += 1
        return upper

    # ---- eviction -----------------------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> EvictResult:
        """Evict unlocked leaves in policy order until ``num_blocks`` blocks were freed or none is left.

        A parent whose last child goes becomes a candidate in turn.  O(log c) per evicted leaf.
        """
        freed = nodes = tokens = 0
        evictor = self.evictor
        pool = self.pool
        bs = self.block_size
        listening = bool(self.events.listeners)
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
                if listening and leaf.block_hashes:
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
                self.evictable_tokens -= size
                self.num_nodes -= 1
                leaf.evicted = True
                if parent.parent is not None:
                    if not parent.children and parent.lock_count == 0:
                        evictor.add(parent)
                elif not parent.children:
                    del self.roots[parent.namespace]
            freed += pool.decref(batch[0] if len(batch) == 1 else np.concatenate(batch))
        self.evictions += nodes
        self.evicted_tokens += tokens
        self.evicted_blocks += freed
        if nodes:
            logger.debug("evicted %d nodes: %d tokens, %d blocks freed (%d asked)", nodes, tokens, freed, num_blocks)
            if listening:
                if not self.roots:
                    events.append(AllCleared())
                self.events.emit(events)
        return EvictResult(freed, nodes, tokens)

    # ---- inspection ---------------------------------------------------------------------------------------

    def cached_sequences(self, namespace: str | None) -> list[list[int]]:
        """Every root-to-leaf token sequence cached in ``namespace``.  O(depth x tokens)."""
        root = self.roots.get(namespace)
        out: list[list[int]] = []
        stack = [(root, [])] if root is not None else []
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.tokens.tolist()
            if not node.children and node.parent is not None:
                out.append(path)
            stack.extend((child, path) for child in node.children.values())
        return out
