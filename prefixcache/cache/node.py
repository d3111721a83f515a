"""A node of the radix tree: one edge of token ids, the pool blocks holding their KV, and the node below it.

The layout is the one :mod:`prefixcache.cache.tree` describes: an edge holds the tokens at absolute positions
``[start, start + len(tokens))`` of every sequence through it, and ``blocks`` the pool blocks for block indices
``start // block_size`` up to ``(end - 1) // block_size``.
"""

from __future__ import annotations

from array import array

import numpy as np

from prefixcache.cache.pool import BLOCK_ID_DTYPE
from prefixcache.cache.tokens import TOKEN_TYPECODE

EMPTY_BLOCKS = np.zeros(0, dtype=BLOCK_ID_DTYPE)


class Node:
    """One edge of the tree and the node below it.  ``children`` is keyed by each child's first token.

    ``lock_count`` is the number of live locks on paths through the node (never evicted while > 0);
    ``last_access`` the tree's logical clock at its last match or insert and ``hit_count`` its matches (read by
    eviction policies); ``evict_key`` the key it is filed under while it is an eviction candidate, else None.
    ``shares_first`` says whether the first block is also held by the parent (a split inside a block, or a seam
    healed by :meth:`~prefixcache.cache.seams.SeamHealing.heal_seam`): that block is freed only with the parent, so the
    node's *own* blocks, the ones evicting it frees, are ``num_own_blocks == len(blocks) - shares_first``, kept as a
    field wherever either changes because lock and unlock add it up on every node they pass.  ``priority`` and
    ``retain_until`` are its retention (:mod:`prefixcache.cache.retention`): 0 and None when not retained.
    ``states`` maps positions ``start < p <= end`` to the recurrent states kept there (:mod:`prefixcache.cache.resume`),
    None when it keeps none; ``marks`` the branch positions marked there (:mod:`prefixcache.cache.marks`).
    """

    __slots__ = (
        "node_id",
        "parent",
        "children",
        "tokens",
        "start",
        "end",
        "blocks",
        "lock_count",
        "last_access",
        "hit_count",
        "evict_key",
        "namespace",
        "evicted",
        "origin",
        "block_hashes",
        "shares_first",
        "num_own_blocks",
        "sharing_child",
        "priority",
        "retain_until",
        "states",
        "marks",
    )

    def __init__(self, node_id: int, parent: Node | None, tokens: array, start: int, blocks: np.ndarray) -> None:
        self.node_id = node_id
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.tokens = tokens
        self.start = start
        self.end = start + len(tokens)  # kept as a field: the lock of every match compares it
        self.blocks = blocks
        self.lock_count = 0
        self.last_access = 0
        self.hit_count = 0
        self.evict_key: tuple | None = None
        self.namespace: str | None = None
        self.evicted = False
        # The request id that inserted these tokens, so its retries count as self-hits, not hits.
        self.origin: str | None = None
        # Chained hashes of the full blocks this node owns (see prefixcache.cache.events); kept only while listened to.
        self.block_hashes: list[int] | None = None
        self.shares_first = False
        self.num_own_blocks = len(blocks)
        self.sharing_child: Node | None = None  # the child whose first block is this node's last, if any
        self.priority = 0
        self.retain_until: float | None = None
        # Recurrent states kept at positions start < p <= end (prefixcache.cache.resume); None when there are none.
        self.states: dict[int, object] | None = None
        # Branch marks at positions start < p <= end, position -> serial (prefixcache.cache.marks); None when none.
        self.marks: dict[int, int] | None = None


def new_root(namespace: str | None) -> Node:
    """An empty root for ``namespace``: no tokens, no blocks, node id 0."""
    root = Node(0, None, array(TOKEN_TYPECODE), 0, EMPTY_BLOCKS)
    root.namespace = namespace
    return root


def common_prefix_length(edge: array, q: array, pos: int, limit: int) -> int:
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
