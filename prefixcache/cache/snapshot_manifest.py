"""The structure check of a snapshot's manifest, and the choice of the nodes a pool has room for (see
:mod:`prefixcache.cache.snapshot`).

A manifest whose checksum is right can still be written wrong (a buggy writer, an edit with the checksum redone):
restore relies on field types, indices in range and a tree shape, and checking them all before the first block is
allocated is what lets a refused snapshot leave the cache exactly as it was.
"""

from __future__ import annotations

import heapq
import sys
from typing import Any

from prefixcache.cache.tokens import MAX_TOKEN_ID
from prefixcache.errors import SnapshotCorruptError

__all__ = ["check_nodes", "check_structure", "choose"]


def check_structure(manifest: dict[str, Any]) -> None:
    """Check what restore relies on, so that a manifest written wrong (checksum and all) fails before a block is
    taken: the field types, namespace and block indices in range, each saved block held by one node (plus the child
    that shares it), and distinct first tokens among siblings.  O(saved tokens)."""
    namespaces, num_blocks = manifest["namespaces"], manifest["num_blocks"]
    if not isinstance(manifest["clock"], int) or not all(n is None or isinstance(n, str) for n in namespaces):
        raise TypeError("the clock must be an int and every namespace a str or null")
    owner: dict[int, int] = {}
    first_tokens: set[tuple[int, int, int]] = set()
    for index, record in enumerate(manifest["nodes"]):
        tokens, blocks, parent, ns = record["tokens"], record["blocks"], record["parent"], record["namespace"]
        if not 0 <= ns < len(namespaces) or (parent >= 0 and manifest["nodes"][parent]["namespace"] != ns):
            raise ValueError(f"node {index} names namespace {ns!r}")
        if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens) or not tokens:
            raise ValueError(f"node {index} holds a token that is not an id")
        if (parent, ns, tokens[0]) in first_tokens:
            raise ValueError(f"node {index} starts with the same token as a sibling")
        first_tokens.add((parent, ns, tokens[0]))
        for position, block in enumerate(blocks):
            if type(block) is not int or not 0 <= block < num_blocks:
                raise ValueError(f"node {index} names block {block!r} of {num_blocks}")
            if (position or not record["shares_first"]) and owner.setdefault(block, index) != index:
                raise ValueError(f"node {index} holds block {block}, which node {owner[block]} holds too")
        for key in ("last_access", "hit_count", "priority"):
            if type(record[key]) is not int:
                raise TypeError(f"node {index} has {key} {record[key]!r}")
        if not (record["retain_s"] is None or isinstance(record["retain_s"], (int, float))):
            raise TypeError(f"node {index} has retain_s {record['retain_s']!r}")


def check_nodes(manifest: dict[str, Any], block_size: int, where: str) -> None:
    """Check that the saved nodes form a tree a restore can build, without a pool: :func:`check_structure` and
    :func:`choose` over every node.  O(saved tokens).

    Raises:
        SnapshotCorruptError: a node is malformed (only a snapshot written wrong can hold one), naming ``where``.
    """
    try:
        check_structure(manifest)
        choose(manifest["nodes"], sys.maxsize, block_size)
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as error:
        raise SnapshotCorruptError(f"the snapshot {where} holds a malformed node: {error!r}") from None


def choose(records: list[dict[str, Any]], budget_blocks: int, block_size: int) -> tuple[list[int], int, int]:
    """Indices of the nodes to load, parents first: a frontier from the roots down, highest (priority, last access)
    first, taking each node whose own blocks still fit.  Checks the structure the tree will rely on.  Also returns
    the nodes and tokens left out."""
    children: dict[int, list[int]] = {}
    for index, record in enumerate(records):
        parent = record["parent"]
        if not -1 <= parent < index:
            raise ValueError(f"node {index} names parent {parent}")
        children.setdefault(parent, []).append(index)
    frontier = [(-records[i]["priority"], -records[i]["last_access"], i) for i in children.get(-1, [])]
    heapq.heapify(frontier)
    chosen: list[int] = []
    while frontier:
        index = heapq.heappop(frontier)[2]
        record = records[index]
        tokens, blocks, start = record["tokens"], record["blocks"], record["start"]
        parent = records[record["parent"]] if record["parent"] >= 0 else None
        expected_start = parent["start"] + len(parent["tokens"]) if parent else 0
        if not tokens or start != expected_start:
            raise ValueError(f"node {index} starts at {start}, after its parent at {expected_start}")
        if len(blocks) != (start + len(tokens) - 1) // block_size - start // block_size + 1:
            raise ValueError(f"node {index} holds {len(blocks)} blocks for positions {start}..{start + len(tokens)}")
        if record["shares_first"] and (parent is None or blocks[0] != parent["blocks"][-1]):
            raise ValueError(f"node {index} says it shares its parent's last block, which it does not")
        own = len(blocks) - bool(record["shares_first"])
        if own > budget_blocks:
            continue
        budget_blocks -= own
        chosen.append(index)
        for child in children.get(index, ()):
            heapq.heappush(frontier, (-records[child]["priority"], -records[child]["last_access"], child))
    taken = set(chosen)
    left_out = [r for i, r in enumerate(records) if i not in taken]
    return chosen, len(left_out), sum(len(r["tokens"]) for r in left_out)
