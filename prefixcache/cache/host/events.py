"""Announcing the host runs no listener has heard of: blocks demoted while nobody listened, and restored runs.

A host run (:class:`~prefixcache.cache.host.tier.HostRun`) keeps only its own tokens, but the chained hashes that name
its blocks in KV events (:mod:`prefixcache.cache.events`) need every token before it.  Those tokens are where a
promotion finds them: a run starts where a device path, or another run, holds its prefix, and its key is the digest
of that prefix and its own first block.  :func:`announce_held` therefore walks the device tree and, at every block
boundary a device path reaches, tries the unannounced runs that start there; a run whose key matches gets its events
(``run.stored``) and is announced, and the runs starting inside it or at its end are tried in turn.  A run whose
prefix is held nowhere cannot be promoted by any prompt, so it stays unannounced and a router does not count it.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from prefixcache.cache.events import HOST_MEDIUM, BlockStored, chain_hashes, namespace_root_hash
from prefixcache.cache.tokens import TOKEN_TYPECODE

if TYPE_CHECKING:
    from prefixcache.cache.host.tier import HostRun, HostTier
    from prefixcache.cache.node import Node

__all__ = ["announce_held"]

# (namespace, first block) -> the unannounced runs starting at that block.
_Waiting = dict[tuple[str | None, int], list["HostRun"]]
# A place a run may start: namespace, the tokens before block ``j``, ``j``, and the hash of block ``j - 1``.
_Start = tuple[str | None, array, int, int]


def announce_held(host: HostTier | None, roots: dict[str | None, Node], *, hashed: bool = False) -> list[BlockStored]:
    """Give every unannounced run of ``host`` its events and announce them to the cache's listeners; return the
    events of every announced host block (what a new subscriber is sent, :meth:`HostTier.stored_events`).

    ``roots`` are the device tree's roots; their nodes must carry their block hashes, as they do while anyone
    listens or right after :meth:`~prefixcache.cache.events.EventPublisher.hash_tree` (say so with ``hashed``).
    With neither, nothing is done (nobody would hear it) and ``[]`` is returned.  The caller holds the cache's
    mutex.  O(device blocks + the tokens of the runs tried and of their prefixes).
    """
    if host is None or not (hashed or host.events.listeners):
        return []
    waiting: _Waiting = {}
    for run in host.runs.values():
        if run.stored is None:
            waiting.setdefault((run.namespace, run.first), []).append(run)
    if waiting:
        _resolve(host, _device_starts(host, roots, waiting), waiting)
        host.send_pending()
    return host.stored_events()


def _device_starts(host: HostTier, roots: dict[str | None, Node], waiting: _Waiting) -> list[_Start]:
    """The block boundaries the device tree reaches where an unannounced run starts (block 0 of a namespace too)."""
    bs, seed = host.block_size, host.events.hash_seed
    empty = array(TOKEN_TYPECODE)
    starts = [(ns, empty, 0, namespace_root_hash(ns, seed)) for ns, first in waiting if first == 0]
    for namespace, root in roots.items():
        nodes = [(child, root.tokens) for child in root.children.values()]
        while nodes:
            node, prefix = nodes.pop()
            path = prefix + node.tokens
            hashes = node.block_hashes or []
            first = node.start // bs
            # Block j - 1 ends inside this node (it owns it) when start < j * bs <= end.
            for j in range(first + 1, min(node.end // bs, first + len(hashes)) + 1):
                if (namespace, j) in waiting:
                    starts.append((namespace, path[: j * bs], j, hashes[j - 1 - first]))
            nodes.extend((child, path) for child in node.children.values())
    return starts


def _resolve(host: HostTier, starts: list[_Start], waiting: _Waiting) -> None:
    bs, seed = host.block_size, host.events.hash_seed
    while starts:
        namespace, prefix, j, parent_hash = starts.pop()
        for run in list(waiting.get((namespace, j), ())):
            path = prefix + run.tokens
            if host.run_key(path, namespace, j) != run.key:
                continue  # a run of another prefix that starts at the same block
            waiting[(namespace, j)].remove(run)
            hashes = chain_hashes(path, bs, parent_hash, seed, j, j + len(run.block_ids))
            run.stored = [
                BlockStored(
                    namespace,
                    (h,),
                    hashes[i - 1] if i else parent_hash,
                    j + i,
                    tuple(run.tokens[i * bs : (i + 1) * bs]),
                    bs,
                    HOST_MEDIUM,
                )
                for i, h in enumerate(hashes)
            ]
            host.announce(run.stored)
            for k in range(j + 1, j + len(hashes) + 1):
                if waiting.get((namespace, k)):
                    starts.append((namespace, path[: k * bs], k, hashes[k - 1 - j]))
