"""The structure check of a snapshot's manifest (see :mod:`prefixcache.cache.snapshot`).

A manifest whose checksum is right can still be written wrong (a buggy writer, an edit with the checksum redone):
restore relies on field types, indices in range and a tree shape, and checking them all before the first block is
allocated is what lets a refused snapshot leave the cache exactly as it was.
"""

from __future__ import annotations

from typing import Any

from prefixcache.cache.tokens import MAX_TOKEN_ID

__all__ = ["check_structure"]


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
