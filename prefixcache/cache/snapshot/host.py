"""The host-memory tier's part of a snapshot: its runs saved beside the tree, and put back into a new host tier.

A restart should keep what the host tier held, as SGLang's HiCache keeps a storage tier below host memory: a run that
was demoted is as good a cache entry as a device node.  :func:`capture` adds the runs of a :class:`HostTier` (least
recently used first) to a captured :class:`~prefixcache.cache.snapshot.tree.Snapshot`: per run its key (the xxh3-128
digest that names it, a pure function of its namespace and tokens, so it holds across processes), namespace, first
block, tokens and the indices of its blocks in ``host_kv``.  :func:`plan` checks the saved runs and picks the most
recently used ones that fit the free host blocks (cutting the tail of the last one, as the host LRU does); :func:`apply`
puts them into the host tier.  Restored runs are announced to event listeners once the device tree is back
(:mod:`prefixcache.cache.host.events`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixcache.cache.host.tier import HostRun, HostTier
from prefixcache.cache.snapshot.manifest import Malformed, is_count, is_token_list
from prefixcache.cache.snapshot.tree import COPY_CHUNK_BLOCKS, Snapshot
from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.errors import SnapshotCorruptError, SnapshotError

if TYPE_CHECKING:
    from collections.abc import Callable

    from prefixcache.cache.snapshot.staging import StagingBuffer

_HEX_DIGITS = "0123456789abcdef"


@dataclass(frozen=True, slots=True)
class HostPlan:
    """The runs :func:`apply` will restore, least recently used first: ``(record, num_blocks)`` each, keeping the
    first ``num_blocks`` of the saved run; and what is left out."""

    runs: list[tuple[dict[str, Any], int]]
    skipped_runs: int
    skipped_tokens: int


def capture(
    snapshot: Snapshot,
    host: HostTier | None,
    keep_namespace: Callable[[str | None], bool] | None,
    staging: StagingBuffer | None = None,
) -> Snapshot:
    """``snapshot`` with the host tier's runs (namespaces ``keep_namespace`` accepts) added: ``host_runs`` and
    ``host_num_blocks`` in the manifest, their K/V (``[num_layers, 2, num_blocks, block_size, num_kv_heads,
    head_dim]``, CPU) as ``host_kv``, copied into ``staging`` when given.  Reads only.  The caller holds the cache's
    mutex.  O(host tokens)."""
    if host is None:
        return snapshot
    records: list[dict[str, Any]] = []
    ids: list[np.ndarray] = []
    num_blocks = 0
    for run in host.runs.values():
        if keep_namespace is not None and not keep_namespace(run.namespace):
            continue
        size = len(run.block_ids)
        records.append(
            {
                "key": f"{run.key:032x}",
                "namespace": run.namespace,
                "first": run.first,
                "tokens": run.tokens[:],  # arrays, as snapshot.capture leaves its nodes' (written as lists)
                "blocks": np.arange(num_blocks, num_blocks + size),
            }
        )
        ids.append(run.block_ids)
        num_blocks += size
    host_kv = None
    if host.pool.kv is not None and num_blocks:
        import torch

        shape = list(host.pool.kv.shape)
        shape[2] = num_blocks
        dtype = host.pool.kv.dtype
        host_kv = torch.empty(shape, dtype=dtype) if staging is None else staging.take(shape, dtype)
        torch.index_select(host.pool.kv, 2, torch.from_numpy(np.concatenate(ids).astype(np.int64)), out=host_kv)
    manifest = {**snapshot.manifest, "host_runs": records, "host_num_blocks": num_blocks}
    return replace(snapshot, manifest=manifest, host_kv=host_kv)


def plan(snapshot: Snapshot, host: HostTier | None, block_size: int) -> HostPlan:
    """Choose the saved runs to restore: the most recently used that fit ``host``'s free blocks (none without a host
    tier).  The caller has checked them with :func:`check`.  Changes nothing.

    Raises:
        SnapshotError: the host tier already holds runs.
    """
    records = snapshot.manifest.get("host_runs", [])
    if host is None:
        return HostPlan([], len(records), sum(len(r["tokens"]) for r in records))
    if host.runs:
        raise SnapshotError(
            f"a snapshot is restored into an empty host tier; this one holds {len(host.runs)} runs "
            "(restore with replace=True drops them)"
        )
    budget = host.pool.num_free_blocks
    chosen: list[tuple[dict[str, Any], int]] = []
    skipped_runs = skipped_tokens = 0
    for record in reversed(records):
        take = min(len(record["blocks"]), budget)
        if take:
            chosen.append((record, take))
            budget -= take
        skipped_tokens += (len(record["blocks"]) - take) * block_size
        skipped_runs += take == 0
    chosen.reverse()
    return HostPlan(chosen, skipped_runs, skipped_tokens)


def check(snapshot: Snapshot, block_size: int) -> None:
    """Check the saved host runs, without touching a host tier: a restore that replaces a cache's content calls it
    before dropping anything.  O(host tokens).

    Raises:
        SnapshotCorruptError: a run is malformed (only a snapshot written wrong can hold one).
    """
    records = snapshot.manifest.get("host_runs", [])
    num_saved = snapshot.manifest.get("host_num_blocks", 0)
    seen: set[int] = set()
    keys: set[str] = set()
    try:
        if type(records) is not list or not is_count(num_saved):
            raise Malformed("host_runs must be a list and host_num_blocks a non-negative int")
        for index, record in enumerate(records):
            if type(record) is not dict:
                raise Malformed(f"host run {index} is not a record")
            key, blocks, tokens = record["key"], record["blocks"], record["tokens"]
            if type(key) is not str or len(key) != 32 or key.strip(_HEX_DIGITS) or key in keys:
                raise Malformed(f"host run {index} has key {key!r}: not 32 hex digits, or another run's")
            keys.add(key)
            if type(blocks) is not list or not blocks or not is_token_list(tokens):
                raise Malformed(f"host run {index} has no blocks, or a token that is not an id")
            if len(tokens) != len(blocks) * block_size or not is_count(record["first"]):
                raise Malformed(f"host run {index} has {len(tokens)} tokens for {len(blocks)} blocks")
            if not all(is_count(b, num_saved) and b not in seen for b in blocks) or len(set(blocks)) != len(blocks):
                raise Malformed(f"host run {index} names blocks outside the saved ones, or another run's")
            seen.update(blocks)
            if record["namespace"] is not None and type(record["namespace"]) is not str:
                raise Malformed(f"host run {index} has namespace {record['namespace']!r}")
    except (KeyError, TypeError, ValueError) as error:
        raise SnapshotCorruptError(f"the snapshot {snapshot.path} holds a malformed host run: {error}") from None


def apply(snapshot: Snapshot, host: HostTier | None, chosen: HostPlan) -> dict[str, int]:
    """Put the planned runs into ``host`` (least recently used first, so the LRU order is the saved one) on fresh host
    blocks holding the saved K/V; returns the host counts of a
    :class:`~prefixcache.cache.snapshot.SnapshotSummary` (its field names).  Nothing changes when it raises; a caller
    whose next step fails takes the runs out again with :func:`discard`."""
    counts = {"skipped_host_runs": chosen.skipped_runs, "skipped_host_tokens": chosen.skipped_tokens}
    if host is None or not chosen.runs:
        return counts
    bs = host.block_size
    num = sum(take for _, take in chosen.runs)
    allocated = host.pool.allocate(num).astype(np.intp)
    try:
        if host.pool.kv is not None:
            import torch

            source = torch.tensor([b for record, take in chosen.runs for b in record["blocks"][:take]])
            target = torch.from_numpy(allocated.astype(np.int64))
            for first in range(0, num, COPY_CHUNK_BLOCKS):
                rows = snapshot.host_kv.index_select(2, source[first : first + COPY_CHUNK_BLOCKS])
                host.pool.kv.index_copy_(2, target[first : first + COPY_CHUNK_BLOCKS], rows)
        runs, offset = [], 0
        for record, take in chosen.runs:
            key = int(record["key"], 16)
            tokens = array(TOKEN_TYPECODE, record["tokens"][: take * bs])
            runs.append(
                HostRun(key, record["namespace"], record["first"], tokens, allocated[offset : offset + take], None)
            )
            offset += take
    except BaseException:
        host.pool.decref(allocated)
        raise
    for run in runs:
        host.runs[run.key] = run
    return {"host_runs": len(chosen.runs), "host_tokens": num * bs, "host_blocks": num, **counts}


def discard(host: HostTier | None) -> None:
    """Take out what :func:`apply` put into a host tier that was empty before it (not counted as dropped)."""
    if host is None:
        return
    while host.runs:
        _, run = host.runs.popitem()
        host.pool.decref(run.block_ids)
