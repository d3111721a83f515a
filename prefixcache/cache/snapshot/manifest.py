"""The complete check of a snapshot's manifest, and the choice of the nodes a pool has room for (see
:mod:`prefixcache.cache.snapshot.tree`).

A manifest whose checksum is right can still be written wrong (a buggy writer, an edit with the checksum redone).
Restore relies on every field's type and range and on the tree's shape, so all of it is checked before the first
block is allocated or anything cached is dropped: that is what lets a refused snapshot leave the cache exactly as it
was.  What a node must be:

- ``parent`` an earlier node's index (or -1 for a root's child) in the same ``namespace`` (an index into the
  manifest's ``namespaces``: distinct, each a str or null); ``start`` the parent's end (0 under a root);
- ``tokens`` a non-empty list of token ids (``0 .. MAX_TOKEN_ID``), siblings starting with distinct tokens;
- ``blocks`` the saved block indices (``0 .. num_blocks - 1``) covering its positions, one per block touched;
  each held by one node only, except the first block of a node with ``shares_first``: its parent's last, where the
  node starts inside that block, and for at most one child of that parent;
- ``last_access``, ``hit_count``, ``priority`` non-negative ints; ``retain_s`` null or a positive number;
  ``origin`` a str or null.
"""

from __future__ import annotations

import heapq
import math
import sys
from typing import Any

from prefixcache.cache.tokens import MAX_TOKEN_ID
from prefixcache.errors import SnapshotCorruptError

__all__ = ["MAX_COUNT", "Malformed", "check_nodes", "check_structure", "choose", "is_count", "is_token_list"]

MAX_COUNT = 2**63 - 1
"""The largest clock, access time, hit count, priority, position or block count a manifest may hold (int64)."""


class Malformed(ValueError):
    """What :func:`check_structure` raises: a field of the manifest is missing, mistyped or out of range."""


def is_count(value: object, below: int = MAX_COUNT + 1) -> bool:
    """Whether ``value`` is an int (not a bool) in ``0 .. below - 1``."""
    return type(value) is int and 0 <= value < below


def is_token_list(value: object) -> bool:
    """Whether ``value`` is a non-empty list of token ids."""
    return type(value) is list and bool(value) and all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value)


def check_structure(manifest: dict[str, Any], block_size: int) -> None:
    """Check every field restore reads (see the module docstring).  O(saved tokens).

    Raises:
        Malformed: naming the first field that does not hold.
    """
    namespaces, num_blocks, records = manifest["namespaces"], manifest["num_blocks"], manifest["nodes"]
    if not is_count(manifest.get("clock")) or not is_count(num_blocks):
        raise Malformed("the clock and num_blocks must be non-negative ints")
    if not all(n is None or type(n) is str for n in namespaces) or len(set(namespaces)) != len(namespaces):
        raise Malformed("the namespaces must be distinct, each a str or null")
    owner: dict[int, int] = {}
    first_tokens: set[tuple[int, int, int]] = set()
    sharing_parents: set[int] = set()
    num_tokens = 0
    for index, record in enumerate(records):
        if type(record) is not dict:
            raise Malformed(f"node {index} is not a record")
        parent, ns, start = record["parent"], record["namespace"], record["start"]
        if type(parent) is not int or not -1 <= parent < index:
            raise Malformed(f"node {index} names parent {parent!r}")
        if not is_count(ns, len(namespaces)) or (parent >= 0 and records[parent]["namespace"] != ns):
            raise Malformed(f"node {index} names namespace {ns!r}")
        tokens, blocks, shares = record["tokens"], record["blocks"], record["shares_first"]
        if not is_token_list(tokens):
            raise Malformed(f"node {index} holds a token that is not an id, or none")
        expected_start = records[parent]["start"] + len(records[parent]["tokens"]) if parent >= 0 else 0
        if start != expected_start or type(start) is not int or start + len(tokens) > MAX_COUNT:
            raise Malformed(f"node {index} starts at {start!r}, its parent ends at {expected_start}")
        if (parent, ns, tokens[0]) in first_tokens:
            raise Malformed(f"node {index} starts with the same token as a sibling")
        first_tokens.add((parent, ns, tokens[0]))
        num_tokens += len(tokens)
        expected_blocks = (start + len(tokens) - 1) // block_size - start // block_size + 1
        if type(blocks) is not list or len(blocks) != expected_blocks:
            raise Malformed(f"node {index} holds {blocks!r} for {expected_blocks} blocks of positions {start}..")
        if not all(is_count(b, num_blocks) for b in blocks) or len(set(blocks)) != len(blocks):
            raise Malformed(f"node {index} names a block outside the {num_blocks} saved, or one twice")
        if type(shares) is not bool:
            raise Malformed(f"node {index} has shares_first {shares!r}")
        if shares:
            if parent < 0 or not start % block_size or blocks[0] != records[parent]["blocks"][-1]:
                raise Malformed(f"node {index} says it shares its parent's last block, where it cannot or does not")
            if parent in sharing_parents:
                raise Malformed(f"node {index} shares its parent's last block with a sibling")
            sharing_parents.add(parent)
        for block in blocks[1:] if shares else blocks:
            if owner.setdefault(block, index) != index:
                raise Malformed(f"node {index} holds block {block}, which node {owner[block]} holds too")
        for key in ("last_access", "hit_count", "priority"):
            if not is_count(record[key]):
                raise Malformed(f"node {index} has {key} {record[key]!r}")
        retain_s = record["retain_s"]
        if retain_s is not None and (type(retain_s) not in (int, float) or not retain_s > 0 or math.isnan(retain_s)):
            raise Malformed(f"node {index} has retain_s {retain_s!r}")
        if not (record["origin"] is None or type(record["origin"]) is str):
            raise Malformed(f"node {index} has origin {record['origin']!r}")
    if manifest.get("num_tokens") != num_tokens:
        raise Malformed(f"num_tokens is {manifest.get('num_tokens')!r}, the nodes hold {num_tokens}")


def check_nodes(manifest: dict[str, Any], block_size: int, where: str) -> None:
    """Check that the saved nodes form a tree a restore can build, without a pool: :func:`check_structure` and
    :func:`choose` over every node.  O(saved tokens).

    Raises:
        SnapshotCorruptError: a node is malformed (only a snapshot written wrong can hold one), naming ``where``.
    """
    try:
        check_structure(manifest, block_size)
        choose(manifest["nodes"], sys.maxsize, block_size)
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as error:
        raise SnapshotCorruptError(f"the snapshot {where} holds a malformed node: {error}") from None


def choose(records: list[dict[str, Any]], budget_blocks: int, block_size: int) -> tuple[list[int], int, int]:
    """Indices of the nodes to load, parents first: a frontier from the roots down, highest (priority, last access)
    first, taking each node whose own blocks still fit.  The records have passed :func:`check_structure`.  Also
    returns the nodes and tokens left out.  O(n log n) in the nodes."""
    children: dict[int, list[int]] = {}
    for index, record in enumerate(records):
        children.setdefault(record["parent"], []).append(index)
    frontier = [(-records[i]["priority"], -records[i]["last_access"], i) for i in children.get(-1, [])]
    heapq.heapify(frontier)
    chosen: list[int] = []
    while frontier:
        index = heapq.heappop(frontier)[2]
        record = records[index]
        own = len(record["blocks"]) - record["shares_first"]
        if own > budget_blocks:
            continue
        budget_blocks -= own
        chosen.append(index)
        for child in children.get(index, ()):
            heapq.heappush(frontier, (-records[child]["priority"], -records[child]["last_access"], child))
    taken = set(chosen)
    left_out = [r for i, r in enumerate(records) if i not in taken]
    return chosen, len(left_out), sum(len(r["tokens"]) for r in left_out)
