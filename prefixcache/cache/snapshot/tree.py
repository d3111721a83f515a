"""Snapshots: the cached tree and its K/V on disk, so a restarted process starts warm.

llama.cpp saves and restores a slot's KV to a file; LMCache and SGLang's HiCache keep KV on disk beside the device.
Here the whole radix tree is saved: its K/V blocks in one safetensors file, the tree and its metadata in JSON.

Layout of a snapshot folder ``DIR`` (made by the first save)::

    DIR/CURRENT                 the name of the complete version below (one line)
    DIR/snapshot-<time>-<id>/snapshot.json   format version, pool shape, identity, namespaces, nodes, checksums
    DIR/snapshot-<time>-<id>/kv.safetensors  "kv": [num_layers, 2, num_saved_blocks, block_size, num_kv_heads,
                                             head_dim]; "host_kv" likewise for the host tier's blocks

Atomic writes.  A save writes a new version into a temporary folder inside ``DIR``, fsyncs its files and the folder,
renames it to its version name, then replaces ``CURRENT`` (``os.replace`` of a fsynced file: atomic on POSIX and
Windows) and fsyncs ``DIR``.  That sync is the commit point: a save returns only once the new version is durable.
Any failed write, fsync or rename raises :class:`~prefixcache.errors.SnapshotWriteError` and keeps the previous
version: before the replace it stays current; when only the last sync fails, ``CURRENT`` names the new (complete)
version, but a power loss may undo the replace, so the previous one is kept too.  Older versions and stale temporary
folders are removed only after the commit (a failure there is only logged); the next save removes what a crash or a
failed save left behind.

Capture, then write.  A save is two steps: :func:`capture` copies the tree and the K/V its nodes hold into host
memory under the cache's mutex (a consistent picture: later inserts, evictions and reused blocks do not reach it),
and :func:`~prefixcache.cache.snapshot.writer.write` writes the files, on another thread if the caller likes (an
engine copies between two of its steps and writes while it goes on).

Several processes.  A save holds an exclusive ``flock`` on the snapshot folder itself and a read a shared one (POSIX;
no lock file is made), so two processes saving into one folder take turns instead of removing each other's new
version, and a reader never sees the version it is reading removed under it.  Within a process a mutex serializes
saves as well (and is all there is on Windows, which has no ``flock``).

Integrity.  ``snapshot.json`` holds its own checksum (xxh3-128 of the canonical JSON of the rest) and the size and
checksum of ``kv.safetensors``, so a truncated, edited or damaged file is refused before anything is loaded
(:class:`~prefixcache.errors.SnapshotCorruptError`).  A sound snapshot of another block size, KV dtype, KV shape or
model/tokenizer identity is refused too (:class:`~prefixcache.errors.SnapshotMismatchError`).

What is saved: every node of the tree (locked ones included: a lock only pins a prefix that running requests read;
restored nodes are unlocked), with its tokens, blocks, access time and hits (the LRU/LFU order), retention priority
and what is left of its retention time, the request id that inserted it, and the recurrent states kept on it
(:mod:`~prefixcache.cache.snapshot.states`; their tensors in ``kv.safetensors`` beside the K/V).  Blocks requests own
privately are not in the tree and are never saved.  Saving reads the tree and copies the K/V it holds; it changes
nothing.

Restoring fills an empty cache.  When the snapshot holds more blocks than the pool has free, it loads the most
recently used part that fits, whole prefixes only (a node is loaded only with its parent): nodes are taken in order
of retention priority, then last access, from the roots down, and a node that does not fit is skipped with its
subtree.

The host-memory tier (:mod:`prefixcache.cache.snapshot.host`): a cache with one saves its host-resident runs too
(tokens, namespace, key and LRU order in ``host_runs``, their K/V in ``host_kv``), under the same checksums.  A cache
loading it with a host tier puts back the most recently used runs that fit its host pool; one without a host tier
drops them, and :class:`SnapshotSummary` counts what was left out either way.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixcache.cache.node import Node, new_root
from prefixcache.cache.pool import BLOCK_ID_DTYPE, KVBlockPool
from prefixcache.cache.snapshot import states as saved_states
from prefixcache.cache.snapshot.folder import canonical, digest, folder_lock, read_bytes, safetensors_module
from prefixcache.cache.snapshot.manifest import check_nodes as check_manifest_nodes
from prefixcache.cache.snapshot.manifest import choose
from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.errors import (
    SnapshotCorruptError,
    SnapshotError,
    SnapshotMismatchError,
    SnapshotNotFoundError,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    import torch

    from prefixcache.cache.snapshot.staging import StagingBuffer
    from prefixcache.cache.tree import RadixTree

FORMAT = "prefixcache-snapshot"
FORMAT_VERSION = 1
CURRENT = "CURRENT"
MANIFEST = "snapshot.json"
KV_FILE = "kv.safetensors"
VERSION_PREFIX = "snapshot-"
TEMP_PREFIX = ".snapshot-tmp-"
COPY_CHUNK_BLOCKS = 256
MAX_CURRENT_BYTES = 200
"""The longest version name ``CURRENT`` may hold; a longer one is refused as corrupt unread."""
_VERSION_NAME = re.compile(re.escape(VERSION_PREFIX) + r"[A-Za-z0-9_.-]+")
"""Blocks copied between the device pool and host memory at a time."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SnapshotSummary:
    """What a save wrote or a restore loaded: ``num_nodes`` tree nodes holding ``num_tokens`` tokens in
    ``num_blocks`` blocks (``kv_bytes`` bytes of K/V), in the version folder ``path``.  A restore into a pool too small
    for the whole snapshot counts what it left out in ``skipped_nodes`` and ``skipped_tokens``.  The host tier's part:
    ``host_runs`` runs of ``host_tokens`` tokens in ``host_blocks`` blocks saved or put back into the host tier, and
    ``skipped_host_runs`` / ``skipped_host_tokens`` left out (the new host pool is smaller, or there is none).
    ``num_states`` recurrent states of ``state_bytes`` bytes saved, or put back (:mod:`~prefixcache.cache.snapshot.
    states`)."""

    path: str
    num_nodes: int
    num_tokens: int
    num_blocks: int
    kv_bytes: int
    skipped_nodes: int = 0
    skipped_tokens: int = 0
    host_runs: int = 0
    host_tokens: int = 0
    host_blocks: int = 0
    skipped_host_runs: int = 0
    skipped_host_tokens: int = 0
    num_states: int = 0
    state_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A snapshot in memory: the manifest (the JSON of ``snapshot.json`` less its checksum) and the saved K/V
    (``[num_layers, 2, num_saved_blocks, block_size, num_kv_heads, head_dim]`` on the CPU, None for a metadata-only
    pool).  ``path`` is the version folder it was read from ("" before it is written).  ``host_kv``: the host tier's
    saved blocks, shaped as ``kv`` (None without host runs or for a metadata-only pool).  ``states``: the recurrent
    states' tensors by name (:mod:`~prefixcache.cache.snapshot.states`; held, not copied, by a capture)."""

    manifest: dict[str, Any]
    kv: torch.Tensor | None
    path: str = ""
    host_kv: torch.Tensor | None = None
    states: dict[str, Any] = field(default_factory=dict)


def pool_shape(pool: KVBlockPool) -> dict[str, Any]:
    """The pool facts a snapshot must share with the pool it is loaded into (the block count may differ)."""
    return {
        "block_size": pool.block_size,
        "dtype": str(pool.dtype).removeprefix("torch."),
        "num_layers": pool.num_layers,
        "num_kv_heads": pool.num_kv_heads,
        "head_dim": pool.head_dim,
    }


# ---- capture ------------------------------------------------------------------------------------------------


def capture(
    tree: RadixTree,
    identity: Mapping[str, str] | None = None,
    keep_namespace: Callable[[str | None], bool] | None = None,
    staging: StagingBuffer | None = None,
) -> Snapshot:
    """Copy the tree (namespaces ``keep_namespace`` accepts, all when None) and its K/V into memory, into ``staging``
    when given (:mod:`prefixcache.cache.snapshot.staging`: then the copy is a memcpy, with no page faults).  Reads
    only: no access time, hit count, counter or block changes; nothing the cache does later changes the copy.  The
    caller holds the cache's mutex.  O(cached tokens) in memcpy (the manifest holds copies of the nodes' token arrays
    and NumPy block lists, which :func:`~prefixcache.cache.snapshot.writer.write` encodes as JSON lists) plus one
    gather of the saved blocks to the host (in chunks of ``COPY_CHUNK_BLOCKS`` from a GPU, so the device never
    holds a second copy of its cached K/V)."""
    pool = tree.pool
    retention_now = tree.retention.clock()
    namespaces: list[str | None] = []
    nodes: list[dict[str, Any]] = []
    node_blocks: list[np.ndarray] = []
    state_tensors: dict[str, Any] = {}
    num_tokens = 0
    for namespace, root in tree.roots.items():
        if keep_namespace is not None and not keep_namespace(namespace):
            continue
        ns = len(namespaces)
        namespaces.append(namespace)
        stack: list[tuple[Node, int]] = [(child, -1) for child in root.children.values()]
        while stack:
            node, parent = stack.pop()
            index = len(nodes)
            node_blocks.append(node.blocks)
            remaining = None
            priority = node.priority
            if priority and node.retain_until is not None:
                remaining = node.retain_until - retention_now
                if remaining <= 0:
                    priority, remaining = 0, None
            nodes.append(
                {
                    "parent": parent,
                    "namespace": ns,
                    "start": node.start,
                    "tokens": node.tokens[:],  # a copy: eviction shortens a node's array in place
                    "blocks": None,
                    "shares_first": node.shares_first,
                    "last_access": node.last_access,
                    "hit_count": node.hit_count,
                    "priority": priority,
                    "retain_s": remaining,
                    "origin": node.origin,
                }
            )
            if node.states is not None:
                nodes[-1]["states"] = saved_states.capture_node(tree.states, node, index, state_tensors)
            num_tokens += len(node.tokens)
            stack.extend((child, index) for child in node.children.values())
    saved, numbered = number_blocks(node_blocks)
    for record, blocks in zip(nodes, numbered, strict=True):
        record["blocks"] = blocks
    kv = None
    if pool.kv is not None:
        import torch

        ids = torch.from_numpy(saved).to(pool.kv.device)
        shape = list(pool.kv.shape)
        shape[2] = len(ids)
        kv = torch.empty(shape, dtype=pool.kv.dtype) if staging is None else staging.take(shape, pool.kv.dtype)
        if pool.kv.device.type == "cpu":
            torch.index_select(pool.kv, 2, ids, out=kv)
        else:
            for first in range(0, len(ids), COPY_CHUNK_BLOCKS):
                chunk = ids[first : first + COPY_CHUNK_BLOCKS]
                kv[:, :, first : first + len(chunk)] = pool.kv.index_select(2, chunk)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "created_unix_s": time.time(),
        "identity": dict(identity or {}),
        "pool": {**pool_shape(pool), "num_blocks": pool.num_blocks},
        "clock": tree.clock,
        "namespaces": namespaces,
        "num_blocks": len(saved),
        "num_tokens": num_tokens,
        "nodes": nodes,
    }
    return Snapshot(manifest, kv, states=state_tensors)


def number_blocks(node_blocks: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The saved blocks of nodes holding ``node_blocks`` (pool ids): their pool ids (int64) in order of first
    appearance, and each node's blocks as indices into that order (a block a child shares with its parent gets one
    index).  O(b log b) in NumPy for b block ids, so a capture under the cache's mutex does no Python work per block."""
    if not node_blocks:
        return np.zeros(0, dtype=np.int64), []
    flat = np.concatenate(node_blocks).astype(np.int64)
    unique, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(unique), dtype=np.int64)
    rank[order] = np.arange(len(unique))
    ends = np.cumsum([len(blocks) for blocks in node_blocks])[:-1]
    return unique[order], np.split(rank[inverse.reshape(-1)], ends)


# ---- read and check ---------------------------------------------------------------------------------------------


def read(directory: str | os.PathLike[str]) -> Snapshot:
    """Read and verify the current version of the snapshot folder ``directory`` (or a version folder itself).

    Every checksum and size is checked before anything is returned.  O(snapshot bytes).

    Raises:
        SnapshotNotFoundError: no snapshot there (no folder, or no ``CURRENT`` and no ``snapshot.json``).
        SnapshotCorruptError: a file is missing, truncated, edited or damaged.
        SnapshotMismatchError: written by another format version.
        SnapshotError: safetensors is not installed.
    """
    folder = Path(directory)
    with folder_lock(folder, exclusive=False):
        return _read_locked(folder)


def _read_locked(folder: Path) -> Snapshot:
    pointer = folder / CURRENT
    if pointer.is_file():
        name = read_bytes(pointer, MAX_CURRENT_BYTES + 1).decode(errors="replace").strip()
        if len(name) > MAX_CURRENT_BYTES or not _VERSION_NAME.fullmatch(name):
            raise SnapshotCorruptError(f"{pointer} names no snapshot version ({name[:80]!r})")
        version = folder / name
        if not (version / MANIFEST).is_file():
            raise SnapshotCorruptError(f"{pointer} names {name}, which has no {MANIFEST}")
    elif (folder / MANIFEST).is_file():
        version = folder
    else:
        raise SnapshotNotFoundError(f"no snapshot in {folder} (no {CURRENT} file)")
    manifest = _read_manifest(version / MANIFEST)
    kv = host_kv = None
    states: dict[str, Any] = {}
    if KV_FILE in manifest["files"]:
        blob = read_bytes(version / KV_FILE)
        expected = manifest["files"][KV_FILE]
        if len(blob) != expected.get("bytes") or digest(blob) != expected.get("xxh3_128"):
            raise SnapshotCorruptError(
                f"{version / KV_FILE}: {len(blob)} bytes whose checksum does not match the {expected.get('bytes')} "
                "bytes written (truncated or damaged)"
            )
        try:
            tensors = safetensors_module().load(blob)
            kv, host_kv = tensors.get("kv"), tensors.get("host_kv")
            states = {name: t for name, t in tensors.items() if name.startswith(saved_states.PREFIX)}
        except SnapshotError:
            raise
        except Exception as error:  # a checksummed file that safetensors still refuses: written wrong
            raise SnapshotCorruptError(f"{version / KV_FILE} does not parse: {error}") from None
    return Snapshot(manifest, kv, str(version), host_kv, states)


def check_compatible(snapshot: Snapshot, pool: KVBlockPool, identity: Mapping[str, str] | None = None) -> None:
    """Refuse a snapshot whose K/V cannot be used in ``pool``: another block size, dtype or KV shape, or, for each
    key of ``identity`` (a model or tokenizer fingerprint), another value or none saved.

    Raises:
        SnapshotMismatchError: naming what differs, saved and here.
        SnapshotCorruptError: the saved K/V do not have the shape the manifest says.
    """
    manifest = snapshot.manifest
    saved_pool = manifest["pool"]
    here = pool_shape(pool)
    for key, value in here.items():
        if saved_pool.get(key) != value:
            raise SnapshotMismatchError(
                f"the snapshot {snapshot.path} was saved with {key} {saved_pool.get(key)!r}, this pool has {value!r}"
            )
    saved_identity = manifest["identity"]
    for key, value in (identity or {}).items():
        if saved_identity.get(key) != value:
            saved = saved_identity.get(key)
            raise SnapshotMismatchError(
                f"the snapshot {snapshot.path} was saved for {key} {saved!r}, this one is {value!r}"
                if saved is not None
                else f"the snapshot {snapshot.path} was saved without a {key}; refusing it for {value!r}"
            )
    for name, kv, num_blocks in (
        ("K/V", snapshot.kv, manifest["num_blocks"]),
        ("host K/V", snapshot.host_kv, manifest.get("host_num_blocks", 0)),
    ):
        if kv is not None:
            shape = (pool.num_layers, 2, num_blocks, pool.block_size, pool.num_kv_heads, pool.head_dim)
            if tuple(kv.shape) != shape or kv.dtype != pool.dtype:
                raise SnapshotCorruptError(
                    f"the snapshot's {name} are {tuple(kv.shape)} {kv.dtype}, its manifest says {shape}"
                )
        elif pool.kv is not None and num_blocks:
            raise SnapshotCorruptError(f"the snapshot {snapshot.path} has no {name} for its blocks")


# ---- restore ----------------------------------------------------------------------------------------------------


def restore(snapshot: Snapshot, tree: RadixTree, states: dict[int, list[tuple]] | None = None) -> SnapshotSummary:
    """Build the snapshot's nodes into ``tree``, which must be empty, with fresh pool blocks holding the saved K/V.

    Loads the most recently used part that fits the free blocks (see the module docstring).  Restored nodes keep
    their access times, hits, origin and retention (within the cap), and the recurrent ``states`` rebuilt for them
    (:func:`~prefixcache.cache.snapshot.states.load`; kept only by a cache that keeps states).  The caller holds the
    cache's mutex and has checked :func:`check_compatible` and :func:`check_nodes` (before dropping anything the cache
    held).
    O(restored tokens) plus one host-to-device copy.

    Raises:
        SnapshotError: the tree is not empty or blocks are in use.
    Nothing changes when it raises.
    """
    pool = tree.pool
    if tree.roots or pool.num_used_blocks:
        raise SnapshotError(
            f"a snapshot is restored into an empty cache; this one has {tree.num_nodes} nodes and "
            f"{pool.num_used_blocks} blocks in use (evict_all() first, with no request running)"
        )
    manifest = snapshot.manifest
    records = manifest["nodes"]
    chosen, skipped_nodes, skipped_tokens = choose(records, pool.num_free_blocks, pool.block_size)
    new_id: dict[int, int] = {}
    for index in chosen:
        for block in records[index]["blocks"]:
            new_id.setdefault(block, len(new_id))
    allocated = pool.allocate(len(new_id))
    built: dict[int, Node] = {}
    shared: list[np.ndarray] = []
    try:
        if pool.kv is not None and new_id:
            import torch

            source = torch.tensor(list(new_id), dtype=torch.long)
            target = torch.from_numpy(allocated.astype(np.int64)).to(pool.kv.device)
            for first in range(0, len(source), COPY_CHUNK_BLOCKS):
                rows = snapshot.kv.index_select(2, source[first : first + COPY_CHUNK_BLOCKS]).to(pool.kv.device)
                pool.kv.index_copy_(2, target[first : first + COPY_CHUNK_BLOCKS], rows)
        num_tokens = _link(tree, records, chosen, manifest["namespaces"], allocated, new_id, built, shared)
        tree.clock = max(tree.clock, int(manifest["clock"]))
    except BaseException:
        _unlink(tree, built, shared, allocated)
        raise
    if tree.events.listeners:
        tree.events.emit(tree.events.hash_tree(tree.roots))
    num_states, state_bytes = saved_states.put_back(tree.states, built, states or {})
    kv_bytes = 0 if pool.kv is None else len(new_id) * pool.block_size * pool.bytes_per_token
    return SnapshotSummary(
        snapshot.path,
        len(chosen),
        num_tokens,
        len(new_id),
        kv_bytes,
        skipped_nodes,
        skipped_tokens,
        num_states=num_states,
        state_bytes=state_bytes,
    )


def check_nodes(snapshot: Snapshot, block_size: int) -> None:
    """:func:`~prefixcache.cache.snapshot.manifest.check_nodes` of ``snapshot``: a restore that replaces a cache's
    content calls it before dropping anything.  Raises :class:`SnapshotCorruptError` for a malformed node."""
    check_manifest_nodes(snapshot.manifest, block_size, snapshot.path)


def _link(
    tree: RadixTree,
    records: list[dict[str, Any]],
    chosen: list[int],
    namespaces: list[str | None],
    allocated: np.ndarray,
    new_id: dict[int, int],
    built: dict[int, Node],
    shared: list[np.ndarray],
) -> int:
    """Create the chosen nodes (parents first) in ``tree`` on the ``allocated`` blocks; returns their tokens.  Fills
    ``built`` (record index -> node) and ``shared`` (each first block given one more holder) as it goes, so that
    :func:`_unlink` can take out what a failure midway left."""
    pool = tree.pool
    num_tokens = 0
    for index in chosen:
        record = records[index]
        namespace = namespaces[record["namespace"]]
        if record["parent"] >= 0:
            parent = built[record["parent"]]
        else:
            parent = tree.roots.get(namespace)
            if parent is None:
                parent = tree.roots[namespace] = new_root(namespace)
        blocks = np.array([allocated[new_id[b]] for b in record["blocks"]], dtype=BLOCK_ID_DTYPE)
        shares = bool(record["shares_first"])
        if shares:
            pool.incref(blocks[:1])  # the first block is the parent's last: one more holder
            shared.append(blocks[:1])
        tokens = array(TOKEN_TYPECODE, record["tokens"])
        # Restored nodes get fresh ids from the tree's own counter, as insert and split do.
        node = Node(next(tree._ids), parent, tokens, record["start"], blocks)
        node.namespace = namespace
        node.last_access = record["last_access"]
        node.hit_count = record["hit_count"]
        node.origin = record["origin"]
        if shares:
            tree.link_sharing(parent, node)
        parent.children[tokens[0]] = node
        built[index] = node
        num_tokens += len(tokens)
        tree.num_nodes += 1
        tree.cached_tokens += len(tokens)
        tree.evictable_tokens += len(tokens)
        tree.evictable_blocks += len(blocks) - shares
    for node in built.values():
        if not node.children:
            tree.evictor.add(node)
    retained: set[int] = set()
    for index in chosen:
        record = records[index]
        parent_retained = record["parent"] < 0 or record["parent"] in retained
        if record["priority"] and parent_retained:
            node = built[index]
            tree.retention.retain([node], record["priority"], record["retain_s"])
            if node.priority:
                retained.add(index)
    return num_tokens


def _unlink(tree: RadixTree, built: dict[int, Node], shared: list[np.ndarray], allocated: np.ndarray) -> None:
    """Undo a restore that failed after taking its blocks: the tree, empty before it, is emptied again (nodes,
    counters, eviction candidates, retention) and every block it took goes back to the pool."""
    for node in built.values():
        tree.evictor.discard(node)
        node.evicted = True  # a retention deadline left in the heap skips it
    tree.roots.clear()
    tree.num_nodes = tree.cached_tokens = tree.evictable_tokens = tree.evictable_blocks = 0
    tree.retention.retained_tokens = tree.retention.retained_blocks = 0
    for blocks in shared:
        tree.pool.decref(blocks)
    tree.pool.decref(allocated)


# ---- files ------------------------------------------------------------------------------------------------------


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(read_bytes(path))
        manifest = document["manifest"]
        checksum = document["checksum"]["xxh3_128"]
    except (ValueError, KeyError, TypeError, RecursionError) as error:  # RecursionError: nested past json's depth
        raise SnapshotCorruptError(f"{path} is not a snapshot manifest: {error}") from None
    if not isinstance(manifest, dict) or digest(canonical(manifest)) != checksum:
        raise SnapshotCorruptError(f"{path} does not match its checksum (edited or damaged)")
    if manifest.get("format") != FORMAT:
        raise SnapshotCorruptError(f"{path} is not a {FORMAT} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise SnapshotMismatchError(
            f"{path} has snapshot format version {manifest.get('version')!r}; this prefixcache reads {FORMAT_VERSION}"
        )
    kinds = {"pool": dict, "identity": dict, "files": dict, "namespaces": list, "nodes": list, "num_blocks": int}
    wrong = [key for key, kind in kinds.items() if not isinstance(manifest.get(key), kind)]
    if "files" not in wrong and not all(isinstance(entry, dict) for entry in manifest["files"].values()):
        wrong.append("files")
    if wrong:
        raise SnapshotCorruptError(f"{path} lacks or mistypes {', '.join(wrong)} (written wrong)")
    return manifest
