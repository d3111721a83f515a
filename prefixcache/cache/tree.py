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

Eviction is block-granular by default, as vLLM frees single blocks from its LRU tail rather than SGLang's whole
leaves: :meth:`RadixTree.evict` takes blocks from the tail of the first candidate leaf in policy order, shortening
its edge at a block boundary, and removes the leaf only once nothing of it is left (its parent may then become a
candidate).  ``granularity="leaf"`` restores whole-leaf eviction.  Either way each block freed costs O(log c) in the
number ``c`` of candidates: trimming a leaf costs O(1) and keeps its place in the policy order (the policy ranks by
access time and hits, not size), removing one costs one O(log c) pop.  A leaf that shares its first block with its
parent keeps the tokens in that block when it gives up everything it owns: they cost no block.

With the ages kept at block precision (a lookup that ends inside a node's edge leaves the unmatched tail's age alone
when admission splits the node there, :meth:`RadixTree.match` and :meth:`RadixTree.lock_point`), partial blocks
extended in place and seams healed at eviction (:mod:`prefixcache.cache.seams`), the tree evicts as an LRU stack of
blocks does, so ``replay --sweep`` (Mattson's stack distances) predicts its hit rate at every pool size; what is left
between the two is described in :mod:`prefixcache.replay.sweep`.

Seams (a block held twice where an edge starts inside it) and their healing: :mod:`prefixcache.cache.seams`.

This module is the tree alone: search, insert, split, lock counts on paths, evicting blocks and leaves.  Who owns
which block (:mod:`prefixcache.cache.blocks`), request admission (:mod:`prefixcache.cache.admission`), hit accounting
(:mod:`prefixcache.cache.stats`) and the public, thread-safe face of it all (:mod:`prefixcache.cache.radix_cache`)
live beside it.  Nothing here takes a lock: callers hold the cache's mutex.
"""

from __future__ import annotations

import itertools
import logging
from array import array
from collections.abc import Callable

import numpy as np

from prefixcache.cache.events import AllCleared, BlockRemoved, EventPublisher, KVEvent
from prefixcache.cache.evictor import Evictor
from prefixcache.cache.node import EMPTY_BLOCKS, Node, common_prefix_length, new_root
from prefixcache.cache.pool import BLOCK_ID_DTYPE, KVBlockPool
from prefixcache.cache.results import EvictResult, MatchResult
from prefixcache.cache.resume import StateStore
from prefixcache.cache.retention import Retention
from prefixcache.cache.seams import SeamHealing
from prefixcache.errors import InvalidArgumentError

GRANULARITIES = ("block", "leaf")

logger = logging.getLogger(__name__)


class RadixTree(SeamHealing):
    """The nodes of every namespace (one root each), their lock counts and the eviction candidates.

    Sizes kept incrementally (O(1) to read): ``num_nodes``, ``cached_tokens``, ``evictable_tokens`` (on unlocked
    nodes), ``evictable_blocks`` (what evicting every unlocked node would free), ``locked_tokens`` (the difference of
    the first two), and the eviction totals ``evictions`` (leaves evicted, whole or in part), ``evicted_tokens``,
    ``evicted_blocks``.  ``states`` keeps recurrent states when the cache resumes them (split and eviction test it).
    Complexities: :meth:`match` and :meth:`insert` cost O(depth) dict lookups plus O(n) C-speed token comparison;
    each block evicted costs O(log c) in the number ``c`` of eviction candidates.

    Raises:
        InvalidArgumentError: ``granularity`` is not ``"block"`` or ``"leaf"``.
    """

    def __init__(
        self,
        pool: KVBlockPool,
        evictor: Evictor,
        events: EventPublisher,
        retention: Retention | None = None,
        granularity: str = "block",
    ) -> None:
        if granularity not in GRANULARITIES:
            raise InvalidArgumentError(f"eviction granularity must be one of {GRANULARITIES}, got {granularity!r}")
        self.granularity = granularity
        self.retention = retention if retention is not None else Retention(pool.num_blocks, evictor)
        self.pool = pool
        self.block_size = pool.block_size
        self.evictor = evictor
        self.events = events
        self.roots: dict[str | None, Node] = {}
        self.clock = 0
        self.num_nodes = 0
        self.evictable_tokens = 0
        self.evictable_blocks = 0
        self.cached_tokens = 0
        self.evictions = 0
        self.evicted_tokens = 0
        self.evicted_blocks = 0
        # The host tier's demote(leaf, first, block_ids), called before eviction frees leaf.blocks[first:] (or removes
        # the leaf, first == 0), returning the host's events of it, sent after the leaf's own BlockRemoved; None
        # without a host tier, so eviction pays one test per leaf for it.
        self.demote: Callable[[Node, int, np.ndarray], list[KVEvent]] | None = None
        # The host tier's cover(leaf, path), called once insert has linked a new leaf, returning the host's events of
        # the copies it dropped (the device now holds those blocks); None without a host tier.
        self.cover: Callable[[Node, array], list[KVEvent]] | None = None
        self.states: StateStore | None = None  # recurrent states on nodes (cache.resume), None when not kept
        self._ids = itertools.count(1)

    @property
    def locked_tokens(self) -> int:
        """Cached tokens on locked nodes.  Derived, so that lock and unlock move only the evictable sizes."""
        return self.cached_tokens - self.evictable_tokens

    # ---- lookup -------------------------------------------------------------------------------------------

    def match(
        self,
        q: array,
        namespace: str | None,
        limit: int,
        owner: object,
        touch: bool = True,
        refresh_partial: bool = True,
    ) -> MatchResult:
        """Longest cached prefix of ``q[:limit]``: refreshes the matched path's access time and hit count (unless
        ``touch`` is False: a scheduler's look-ahead), never changes the tree's shape.  ``owner`` is stamped on the
        result (the cache that may lock it).  A match that ends inside a node's edge refreshes that whole node,
        unless ``refresh_partial`` is False: admission then splits the node where its lock ends and stamps only the
        matched part (:meth:`lock_point`), so an unmatched tail keeps its own age, as a block-level LRU keeps it."""
        root = self.roots.get(namespace)
        if root is None:
            return MatchResult(0, EMPTY_BLOCKS, namespace, new_root(namespace), owner)
        if touch:
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
            node = child
            pos += matched
            partial = matched < len(edge)
            touch = touch and (refresh_partial or not partial)
            if touch:
                child.last_access = tick
                child.hit_count += 1
            if partial:
                break
        if touch and node.evict_key is not None:
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
                self.evictable_tokens -= len(node.tokens)
                self.evictable_blocks -= node.num_own_blocks
                if node.evict_key is not None:
                    self.evictor.discard(node)
            node.lock_count += 1
            node = node.parent

    def unlock_path(self, node: Node) -> None:
        """Take one lock off ``node`` and every ancestor; unlocked leaves become eviction candidates."""
        while node.parent is not None:
            node.lock_count -= 1
            if node.lock_count == 0:
                self.evictable_tokens += len(node.tokens)
                self.evictable_blocks += node.num_own_blocks
                if not node.children:
                    self.evictor.add(node)
            node = node.parent

    def lock_point(self, node: Node, aligned: int, stamp: int | None = None) -> Node:
        """The node whose lock protects exactly the first ``aligned`` tokens (the whole blocks of a match): the node
        holding token ``aligned - 1``, split at ``aligned`` if its edge goes on, so the lock pins neither an
        unmatched tail nor the partial block the request has copied (a lone request that fits the pool must be
        able to evict them).  Lookup never splits; admission does.  The root when ``aligned == 0``.  When it
        splits, the upper half takes the access time ``stamp`` if given (the match's, which left the node as it
        was: see :meth:`match`) and one hit; the lower half keeps the node's."""
        while node.parent is not None and node.start >= aligned:
            node = node.parent
        if node.parent is not None and node.end > aligned:
            node = self.split(node, aligned - node.start)
            if stamp is not None:
                node.last_access = stamp
                node.hit_count += 1
        return node

    # ---- insert -------------------------------------------------------------------------------------------

    def insert(
        self,
        q: array,
        owned: np.ndarray,
        first_owned: int,
        namespace: str | None,
        origin: str | None,
        start: Node | None = None,
    ) -> tuple[int, np.ndarray]:
        """Cache ``q``, whose KV from block index ``first_owned`` on is in the caller's blocks ``owned`` (intp, up to
        at least block ``ceil(len(q) / block_size) - 1``, checked by the caller); the new leaf takes those it needs.
        The blocks before ``first_owned`` are borrowed (the tree's own, on the cached path) and never read here.

        ``start``, a node locked by the caller whose path spells ``q[:start.end]`` (the lock of a lease whose tokens
        these are), is where the walk begins: the same result as from the root, whose walk would pass through it,
        without comparing the locked path's tokens again (its nodes' access times are refreshed all the same).

        Returns the number of tokens that were cached already and the caller's blocks the tree did not take
        (the caller releases them).  O(depth) dict lookups plus O(n) C-speed token comparison, from ``start``.

        Raises:
            InvalidArgumentError: the sequence leaves the cached path inside the borrowed blocks; the tree is
                unchanged.
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
        if start is not None and start.parent is not None:
            node, pos = start, start.end
            while start.parent is not None:
                # Locked, so none of them is an eviction candidate to re-rank.
                start.last_access = tick
                start = start.parent
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
            # Heal the seam before linking the leaf, so that a failure leaves the tree as it was.  A block the
            # caller extended in place is already the parent's last: the caller's hold on it becomes the leaf's.
            first, last = first_new - first_owned, need - first_owned  # indices into owned
            block = int(owned[first])
            healed = bool(pos % bs) and (
                (block == node.blocks.item(-1) and self.check_unshared(node)) or self.share_parent_block(node, block)
            )
            leaf = Node(next(self._ids), node, q[pos:], pos, owned[first:last].astype(BLOCK_ID_DTYPE))
            if healed:
                self.link_sharing(node, leaf)
            leaf.last_access = tick
            leaf.namespace = namespace
            leaf.origin = origin
            if node.evict_key is not None:
                self.evictor.discard(node)
            node.children[q[pos]] = leaf
            self.num_nodes += 1
            self.evictable_tokens += n - pos
            self.cached_tokens += n - pos
            self.evictable_blocks += leaf.num_own_blocks
            self.evictor.add(leaf)
            if self.events.listeners:
                self.events.announce_leaf(leaf, q)
            if self.cover is not None:
                covered = self.cover(leaf, q)
                if covered:
                    self.events.emit(covered)
            released = owned[:first]
            if last < len(owned):
                released = np.concatenate((released, owned[last:]))
        else:
            released = owned
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
        if new_start % bs:
            # The block holding the cut becomes both halves'.  First: should it raise, nothing has changed yet.
            self.pool.incref(lower_blocks[:1])
        upper = Node(next(self._ids), node.parent, node.tokens[:at], start, upper_blocks)
        upper.lock_count = node.lock_count
        upper.last_access = node.last_access
        upper.hit_count = node.hit_count
        upper.namespace = node.namespace
        upper.origin = node.origin
        upper.shares_first = node.shares_first
        upper.num_own_blocks = len(upper_blocks) - upper.shares_first
        node.shares_first = new_start % bs != 0
        node.num_own_blocks = len(lower_blocks) - node.shares_first
        upper.sharing_child = node if node.shares_first else None
        if upper.shares_first:
            node.parent.sharing_child = upper
        if node.priority:
            upper.priority = node.priority
            upper.retain_until = node.retain_until
            self.retention.split(upper)
        if node.block_hashes is not None:
            owned_by_upper = new_start // bs - first_index
            upper.block_hashes = node.block_hashes[:owned_by_upper]
            node.block_hashes = node.block_hashes[owned_by_upper:]
        upper.children[node.tokens[at]] = node
        node.parent.children[node.tokens[0]] = upper
        node.parent = upper
        node.tokens = node.tokens[at:]
        node.start = new_start
        node.blocks = lower_blocks
        if node.states is not None or node.marks is not None:
            self.states.split(node, upper)
        self.num_nodes += 1
        return upper

    # ---- eviction -----------------------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> EvictResult:
        """Free ``num_blocks`` blocks in policy order, or as many as unlocked nodes hold.  Block granularity (the
        default) cuts whole blocks off the tail of the first candidate leaf and removes it only when nothing of it is
        left; leaf granularity removes whole leaves.  A parent whose last child goes becomes a candidate in turn.
        Expired retentions are dropped first; recurrent states go with their positions.  O(log c) per block freed."""
        if self.retention.deadlines:
            self.retention.expire()
        freed = nodes = trims = tokens = own_blocks = 0  # own_blocks: the unlocked blocks that left the tree
        evictor = self.evictor
        pool = self.pool
        bs = self.block_size
        by_block = self.granularity == "block"
        listening = bool(self.events.listeners)
        demote = self.demote
        events: list[KVEvent] = []
        try:
            while freed < num_blocks and len(evictor):
                # Unlink (or trim) leaves until their blocks should cover what is asked, then release all their
                # blocks in one decref: a decref per leaf would cost more than the rest of the eviction.  A leaf's own
                # blocks have no other holder (a shared first block is the parent's too and is released at once, not
                # counted), but a block under copy-on-write holds a temporary reference, so the outer loop goes by
                # what decref actually freed and the count here only sizes the batch.
                batch: list[np.ndarray] = []
                shared: list[int] = []  # leaves' shared first blocks (their parents keep them), released last
                orphans: list[Node] = []  # parents whose shared last block lost its sharing child: heal after release
                expected = 0
                while freed + expected < num_blocks and len(evictor):
                    # Popped at once, as a whole leaf mostly goes; a trimmed one is filed back under its key.
                    leaf = evictor.pop()
                    blocks = leaf.blocks
                    own = leaf.num_own_blocks
                    want = num_blocks - freed - expected
                    # A leaf that shares its first block keeps the tokens in it when it has to give up all it owns:
                    # they cost nothing (the parent holds that block), as a block-level LRU keeps that block.
                    if by_block and want < len(blocks):
                        keep = len(blocks) - want
                        new_end = (leaf.start // bs + keep) * bs
                        cut = leaf.end - new_end
                        demoted = demote(leaf, keep, blocks[keep:]) if demote is not None else None
                        if listening and leaf.block_hashes:
                            gone = leaf.end // bs - new_end // bs
                            if gone:
                                events.append(BlockRemoved(leaf.namespace, tuple(leaf.block_hashes[-gone:])))
                                del leaf.block_hashes[-gone:]
                        if demoted:
                            events.extend(demoted)
                        batch.append(blocks[keep:])
                        leaf.blocks = blocks[:keep]
                        leaf.num_own_blocks = own - want
                        del leaf.tokens[new_end - leaf.start :]
                        leaf.end = new_end
                        if leaf.states is not None or leaf.marks is not None:
                            self.states.trim(leaf)
                        if leaf.priority:
                            self.retention.removed(leaf, cut, want)
                        expected += want
                        tokens += cut
                        own_blocks += want
                        trims += 1
                        evictor.add(leaf)
                        break
                    # A shared first block stays with the parent, but its later rows are this leaf's: demote it too.
                    demoted = demote(leaf, 0, blocks) if demote is not None else None
                    parent = leaf.parent
                    del parent.children[leaf.tokens[0]]
                    if listening and leaf.block_hashes:
                        events.append(BlockRemoved(leaf.namespace, tuple(leaf.block_hashes)))
                    if demoted:
                        events.extend(demoted)
                    if leaf.shares_first:
                        shared.append(blocks[0])
                        blocks = blocks[1:]
                        parent.sharing_child = None
                        if self.a_child_can_heal(parent):
                            orphans.append(parent)
                            expected += 1
                    batch.append(blocks)
                    expected += own
                    size = len(leaf.tokens)
                    if leaf.priority:
                        self.retention.removed(leaf, size, own)
                    tokens += size
                    own_blocks += own
                    nodes += 1
                    leaf.evicted = True
                    if leaf.states is not None or leaf.marks is not None:
                        self.states.remove(leaf)
                    if parent.parent is not None:
                        if not parent.children and parent.lock_count == 0:
                            evictor.add(parent)
                    elif not parent.children:
                        del self.roots[parent.namespace]
                released = batch[0] if len(batch) == 1 else np.concatenate(batch)
                try:
                    freed += pool.release(released)
                finally:
                    # After the batch, one at a time: a parent evicted in the same batch releases the same block, and
                    # a chain of nested leaves inside one block shares that block at every level.
                    error: BaseException | None = None
                    for block in shared:
                        try:
                            freed += pool.release(np.array([block], dtype=np.intp))
                        except BaseException as exc:  # noqa: BLE001 - released on the retry; the rest go too
                            error = error or exc
                    if error is not None:
                        raise error
                # The parent's copy duplicates a remaining child's: heal that seam, so the copy goes with the leaf
                # as a block-level LRU drops it (after the release: a heal that raises changes nothing).
                for parent in orphans:
                    if not parent.evicted:
                        before = pool.num_free_blocks
                        self.heal_a_child(parent)
                        freed += pool.num_free_blocks - before
        finally:
            # Even when interrupted: count and announce what left the tree.  The sizes are updated here, once, not
            # per leaf: the evicted nodes are unlocked, so evictable and cached sizes drop alike.
            self.num_nodes -= nodes
            self.cached_tokens -= tokens
            self.evictable_tokens -= tokens
            self.evictable_blocks -= own_blocks
            self.evictions += nodes + trims
            self.evicted_tokens += tokens
            self.evicted_blocks += freed
            if tokens:
                logger.debug(
                    "evicted %d nodes: %d tokens, %d blocks freed (%d asked)", nodes, tokens, freed, num_blocks
                )
                if listening and not self.roots:
                    events.append(AllCleared())
            if events:
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
