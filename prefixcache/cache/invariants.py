"""Invariants of a cache, recomputed from scratch: what the property and fault tests call after every step.

Checks: the pool's free list holds exactly the blocks of count 0; every count equals its holders (tree nodes holding the
block plus one if a caller owns it); node blocks are in range and caller-owned only when a lease extends them in place
(``extending``); edges are non-empty, keyed by first token, at the right positions, with the right number of blocks;
lock counts equal the live handles through each node; locked and evictable token totals; the eviction candidates are
exactly the unlocked leaves, filed under their current priority (retention priority first); the node count; block hashes
while events are listened to; ``shares_first`` exactly where a node's first block is its parent's last; the evictable
block total (own blocks of unlocked nodes); retained token and block totals, within the cap; recurrent states
(:mod:`prefixcache.cache.resume`) only at positions their node covers, filed once in the LRU order, their byte total
the sum and within the budget, and none at all in a cache that does not resume states.

:func:`check_mirror` checks an event consumer against the cache: a :class:`~prefixcache.cache.events.BlockIndex` fed
every event holds exactly the device tree's full blocks (hashes recomputed from the tokens) and the host blocks that
were announced.
"""

from __future__ import annotations

import numpy as np

from prefixcache.cache.blocks import BlockLedger
from prefixcache.cache.events import DEVICE_MEDIUM, HOST_MEDIUM, BlockIndex, walk_block_hashes
from prefixcache.cache.locks import LockRegistry
from prefixcache.cache.node import EMPTY_BLOCKS
from prefixcache.cache.tree import RadixTree


def check_invariants(tree: RadixTree, blocks: BlockLedger, locks: LockRegistry) -> None:
    """Recompute every piece of bookkeeping of ``tree``, ``blocks`` and ``locks`` and compare.  O(total tokens).

    Raises:
        AssertionError: naming the first broken invariant.
    """

    def fail(message: str) -> None:
        raise AssertionError(message)

    pool = tree.pool
    bs = tree.block_size
    policy = tree.evictor.policy
    listening = bool(tree.events.listeners)
    pool.check_invariants()
    expected_locks: dict[int, int] = {}
    for handle in locks.handles.values():
        if handle.released:
            fail("a released handle is still registered")
        node = handle.node
        if node.evicted:
            fail("a locked node was evicted")
        while node.parent is not None:
            expected_locks[node.node_id] = expected_locks.get(node.node_id, 0) + 1
            node = node.parent
    held: list[np.ndarray] = []
    locked = evictable = evictable_blocks = count = retained_tokens = retained_blocks = 0
    candidates = set()
    all_nodes = []
    for namespace, root in tree.roots.items():
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
            if node.end != node.start + size:
                fail(f"node {node.node_id} ends at {node.end}, not at {node.start} + {size} tokens")
            if node.start != parent.start + len(parent.tokens):
                fail(f"node {node.node_id} starts at {node.start}, its parent ends at {parent.end}")
            if node.namespace != namespace or node.evicted:
                fail(f"node {node.node_id} has the wrong namespace or is marked evicted")
            if len(node.blocks) != (node.end - 1) // bs - node.start // bs + 1:
                fail(f"node {node.node_id} holds {len(node.blocks)} blocks for positions {node.start}..{node.end}")
            if node.lock_count != expected_locks.get(node.node_id, 0):
                fail(f"node {node.node_id} lock count {node.lock_count} != {expected_locks.get(node.node_id, 0)}")
            shares = parent.parent is not None and node.blocks.item(0) == parent.blocks.item(-1)
            if shares != node.shares_first or (shares and not node.start % bs):
                fail(f"node {node.node_id} shares_first is {node.shares_first}, its first block says {shares}")
            if (parent.sharing_child is node) != shares:
                fail(f"node {node.node_id} is {'' if shares else 'not '}its parent's sharing child")
            sharer = node.sharing_child
            if sharer is not None and (sharer.evicted or sharer.parent is not node):
                fail(f"node {node.node_id} names a sharing child that is not its child")
            own_blocks = len(node.blocks) - shares
            if node.num_own_blocks != own_blocks:
                fail(f"node {node.node_id} counts {node.num_own_blocks} own blocks, its blocks say {own_blocks}")
            if node.priority:
                retained_tokens += size
                retained_blocks += own_blocks
            elif node.retain_until is not None:
                fail(f"node {node.node_id} has a deadline but no priority")
            if node.lock_count:
                locked += size
            else:
                evictable += size
                evictable_blocks += own_blocks
                if not node.children:
                    candidates.add(node.node_id)
            if (node.evict_key is not None) != (not node.children and node.lock_count == 0):
                fail(f"node {node.node_id} candidate status is wrong")
            if listening and len(node.block_hashes or ()) != node.end // bs - node.start // bs:
                fail(f"node {node.node_id} keeps {len(node.block_hashes or ())} block hashes")
            if node.evict_key is not None and node.evict_key != tree.evictor.key(node):
                fail(f"node {node.node_id} is filed under a stale eviction key")
            if node.states is not None and tree.states is None:
                fail(f"node {node.node_id} keeps states in a cache that does not resume them")
            all_nodes.append(node)
            held.append(node.blocks)
            stack.extend(node.children.values())
    all_blocks = np.concatenate(held) if held else EMPTY_BLOCKS
    if all_blocks.size and (all_blocks.min() < 0 or all_blocks.max() >= pool.num_blocks):
        fail("a node refers to a block outside the pool")
    holders = np.bincount(all_blocks, minlength=pool.num_blocks)
    if (blocks.extending & ~blocks.owned).any():
        fail("a block is flagged as extended in place but no caller owns it")
    if (holders[blocks.owned & ~blocks.extending] > 0).any():
        fail("a block is both owned by a caller and held by the tree, and not extended in place")
    holders += blocks.owned
    if not np.array_equal(holders, pool._ref):
        bad = np.flatnonzero(holders != pool._ref)[:5].tolist()
        fail(f"reference counts differ from holders for blocks {bad}")
    if pool.num_free_blocks + int((holders > 0).sum()) != pool.num_blocks:
        fail("free + referenced != capacity")
    if count != tree.num_nodes:
        fail(f"node count {tree.num_nodes} != {count}")
    if evictable_blocks != tree.evictable_blocks:
        fail(f"evictable blocks {tree.evictable_blocks} != {evictable_blocks}")
    retention = tree.retention
    if (retained_tokens, retained_blocks) != (retention.retained_tokens, retention.retained_blocks):
        fail(
            f"retained tokens/blocks {retention.retained_tokens}/{retention.retained_blocks} != "
            f"{retained_tokens}/{retained_blocks}"
        )
    if retained_blocks > retention.cap_blocks:
        fail(f"{retained_blocks} retained blocks exceed the cap of {retention.cap_blocks}")
    if (locked, evictable) != (tree.locked_tokens, tree.evictable_tokens):
        fail(f"token totals locked/evictable {tree.locked_tokens}/{tree.evictable_tokens} != {locked}/{evictable}")
    members = tree.evictor.members()
    if {node.node_id for node in members} != candidates or len(tree.evictor) != len(candidates):
        fail("eviction candidates differ from the unlocked leaves")
    ranks = [(node.priority, *policy.priority(node), node.node_id) for node in members]
    if ranks != sorted(ranks):
        fail("eviction order is not (retention priority, policy priority, node id)")
    if tree.states is not None:
        tree.states.check(all_nodes)


def device_block_hashes(tree: RadixTree, seed: int) -> set[tuple[str | None, int]]:
    """``(namespace, hash)`` of every full block the device tree holds, recomputed from its tokens (not from the hashes
    kept on nodes).  O(cached tokens)."""
    walk = walk_block_hashes(tree.roots, tree.block_size, seed)
    return {(node.namespace, h) for node, _, _, hashes in walk for h in hashes}


def check_mirror(
    tree: RadixTree, host_announced: set[tuple[str | None, int]] | None, index: BlockIndex, seed: int
) -> None:
    """``index``, fed every event of the cache since it was empty (or since ``index`` subscribed), mirrors it: the
    blocks it holds on the device (medium ``"GPU"``, or none without a host tier) are exactly the device tree's full
    blocks, and those it holds on host (``"CPU"``) exactly ``host_announced``, the ``(namespace, hash)`` of the host
    blocks that were announced (:meth:`~prefixcache.cache.host.tier.HostTier.announced_blocks`; None without a host
    tier).  O(cached tokens).

    Raises:
        AssertionError: naming the blocks that differ.
    """
    device = device_block_hashes(tree, seed)
    if host_announced is None:
        held_device, held_host = set(index.hashes), set()
        announced: set[tuple[str | None, int]] = set()
    else:
        held_device = {key for key, media in index.media.items() if DEVICE_MEDIUM in media}
        held_host = {key for key, media in index.media.items() if HOST_MEDIUM in media}
        announced = host_announced
        if {key for key in index.hashes if key not in index.media}:
            raise AssertionError("the index holds blocks without a medium from a cache with a host tier")
    if held_device != device:
        raise AssertionError(
            f"the index's device blocks differ from the tree's: {len(device - held_device)} missing, "
            f"{len(held_device - device)} not held"
        )
    if held_host != announced:
        raise AssertionError(
            f"the index's host blocks differ from the announced host runs: {len(announced - held_host)} missing, "
            f"{len(held_host - announced)} not held"
        )
