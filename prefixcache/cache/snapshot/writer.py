"""Writing a captured snapshot (:func:`~prefixcache.cache.snapshot.tree.capture`) as the new current version of a
snapshot folder: the commit protocol of :mod:`prefixcache.cache.snapshot.tree` (a new version fsynced beside the old
one, then ``CURRENT`` replaced and the folder fsynced), and the bytes of the two files.

The writer may run on a thread of its own beside an engine that goes on stepping, so it never holds the GIL for long:
the K/V file is written straight from the captured tensors in ``WRITE_CHUNK_BYTES`` pieces (a safetensors header,
then the raw bytes; not one ``bytes`` copy of the K/V as ``safetensors.torch.save`` makes, which held the GIL 4.9 s
for 512 MiB), its checksum computed piece by piece, and the manifest's JSON encoded node by node
(:func:`~prefixcache.cache.snapshot.folder.canonical_parts`).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixcache.cache.snapshot.folder import (
    canonical_parts,
    check_folder,
    digest,
    digest_parts,
    entries,
    folder_lock,
    remove,
    safetensors_module,
    write_error,
)
from prefixcache.cache.snapshot.tree import (
    CURRENT,
    FORMAT,
    KV_FILE,
    MANIFEST,
    TEMP_PREFIX,
    VERSION_PREFIX,
    Snapshot,
    SnapshotSummary,
)
from prefixcache.errors import SnapshotError, SnapshotWriteError

if TYPE_CHECKING:
    import torch

__all__ = ["SAFETENSORS_DTYPES", "WRITE_CHUNK_BYTES", "kv_file_parts", "write"]

WRITE_CHUNK_BYTES = 8 << 20
"""Bytes of K/V written or checksummed at a time (each piece a few ms of GIL at most)."""

SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
"""The safetensors names of the tensor dtypes a snapshot's K/V may have, by the torch dtype's name (``float32`` for
``torch.float32``: the names, so that importing the cache imports no torch)."""

# One save at a time in this process: two savers racing on CURRENT could each remove the other's new version.
_write_lock = threading.Lock()


def kv_file_parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[Any]:
    """The bytes of a safetensors file of ``tensors`` (CPU) with ``metadata``, as pieces to write in order: the
    header (its length as a little-endian u64, then JSON padded with spaces to 8 bytes), then each tensor's raw
    bytes in views of at most :data:`WRITE_CHUNK_BYTES` (no copy of the tensors).  ``safetensors.torch.load`` reads
    the pieces joined.  O(number of pieces).

    Raises:
        SnapshotError: a dtype safetensors has no name for.
    """
    import torch

    header: dict[str, Any] = {"__metadata__": metadata}
    views = []
    offset = 0
    for name, tensor in tensors.items():
        dtype = SAFETENSORS_DTYPES.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None:
            raise SnapshotError(f"a snapshot cannot store K/V of dtype {tensor.dtype} (no safetensors name)")
        flat = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        header[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(flat)],
        }
        offset += len(flat)
        views += [flat[first : first + WRITE_CHUNK_BYTES] for first in range(0, len(flat), WRITE_CHUNK_BYTES)]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [len(text).to_bytes(8, "little") + text, *views]


def write(snapshot: Snapshot, directory: str | os.PathLike[str]) -> SnapshotSummary:
    """Write ``snapshot`` as the new current version of the snapshot folder ``directory`` (made if missing), atomically
    (see :mod:`prefixcache.cache.snapshot.tree`).  Returns what was written.  Thread-safe (saves take turns); reads
    ``snapshot`` only.  O(snapshot bytes), in pieces that hold the GIL a few ms at most.

    Raises:
        SnapshotError: safetensors is not installed (the ``snapshot`` extra), or ``directory`` (or
            a folder above it) is a file.
        SnapshotWriteError: a write, fsync or rename failed, the last sync of the folder included (also an
            ``OSError``, with the operating system's ``errno``); the previous version is kept (see
            :mod:`prefixcache.cache.snapshot`).
    """
    folder = Path(directory)
    check_folder(folder)
    manifest = dict(snapshot.manifest)
    files: dict[str, dict[str, Any]] = {}
    blobs: dict[str, Sequence[Any]] = {}
    tensors = {name: t for name, t in (("kv", snapshot.kv), ("host_kv", snapshot.host_kv)) if t is not None}
    # Recurrent states never change once cached: read here, off the cache's mutex, onto the CPU.
    tensors.update((name, t.detach().cpu()) for name, t in snapshot.states.items())
    if tensors:
        safetensors_module()  # the reader needs it: refuse to write what could not be read back
        blobs[KV_FILE] = kv_file_parts(tensors, {"format": FORMAT})
        files[KV_FILE] = {"bytes": sum(len(part) for part in blobs[KV_FILE]), "xxh3_128": digest_parts(blobs[KV_FILE])}
    manifest["files"] = files
    body = b"".join(canonical_parts(manifest))
    document = b'{"checksum":{"xxh3_128":"%s"},"manifest":%s}' % (digest(body).encode(), body)
    with _write_lock:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as error:
            raise write_error(folder, error) from error
        with folder_lock(folder, exclusive=True):
            return _write_locked(folder, document, blobs, tensors, manifest)


def _write_locked(
    folder: Path,
    document: bytes,
    blobs: dict[str, Sequence[Any]],
    tensors: dict[str, torch.Tensor],
    manifest: dict[str, Any],
) -> SnapshotSummary:
    name = f"{VERSION_PREFIX}{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
    temp = folder / f"{TEMP_PREFIX}{name}"
    final = folder / name
    committed = False  # CURRENT names the new version (in memory: durable only once the folder is synced)
    try:
        os.mkdir(temp)
        for file_name, parts in blobs.items():
            _write_file(temp / file_name, parts)
        _write_file(temp / MANIFEST, document)
        _fsync_dir(temp)
        os.rename(temp, final)
        _fsync_dir(folder)
        pointer = folder / f"{TEMP_PREFIX}{CURRENT}"
        _write_file(pointer, (name + "\n").encode())
        os.replace(pointer, folder / CURRENT)
        committed = True
        _fsync_dir(folder)
    except OSError as error:
        if not committed:
            raise write_error(folder, error) from error
        # After a power loss CURRENT may still name the previous version: it is kept, and the save has failed (as
        # SQLite returns the I/O error of a failed sync).  The new version is complete; the next save removes one.
        raise SnapshotWriteError(
            f"saving a snapshot into {folder}: {CURRENT} names the new version {name}, but syncing the folder failed "
            f"({error}), so the replace may not survive a crash; the previous version is kept",
            error.errno,
        ) from error
    finally:
        if not committed:
            for leftover in (temp, final, folder / f"{TEMP_PREFIX}{CURRENT}"):
                remove(leftover)
    for entry in entries(folder):
        # Only what saves make: other files a user keeps in the folder stay.
        stale = entry.startswith(TEMP_PREFIX) or (entry.startswith(VERSION_PREFIX) and (folder / entry).is_dir())
        if entry != name and stale:
            remove(folder / entry)
    state_records = [entry for node in manifest["nodes"] for entry in node.get("states", ())]
    state_bytes = sum(entry["nbytes"] for entry in state_records)
    kv_bytes = sum(t.numel() * t.element_size() for name, t in tensors.items() if name in ("kv", "host_kv"))
    host_runs = manifest.get("host_runs", [])
    return SnapshotSummary(
        str(final),
        len(manifest["nodes"]),
        manifest["num_tokens"],
        manifest["num_blocks"],
        kv_bytes,
        host_runs=len(host_runs),
        host_tokens=sum(len(run["tokens"]) for run in host_runs),
        host_blocks=manifest.get("host_num_blocks", 0),
        num_states=len(state_records),
        state_bytes=state_bytes,
    )


def _write_file(path: Path, data: bytes | Sequence[Any]) -> None:
    """Write ``data`` (bytes, or buffers in order) to a new file and fsync it."""
    with open(path, "wb") as file:
        for part in (data,) if isinstance(data, bytes) else data:
            file.write(part)
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a folder's entries (renames, new files) durable; Windows has no fsync of a folder."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
