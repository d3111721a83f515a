"""The snapshot folder on disk (see :mod:`prefixcache.cache.snapshot.tree`): its lock, reads and removals that fail with
the package's errors, and the checksum of a manifest.

A save holds an exclusive ``flock`` on the folder itself and a read a shared one (POSIX advisory locks, as SQLite and
pip's cache use; no lock file is left beside the versions), so processes sharing a folder take turns.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from array import array
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from prefixcache.errors import SnapshotCorruptError, SnapshotError, SnapshotWriteError, install_command

__all__ = [
    "canonical",
    "canonical_parts",
    "check_folder",
    "digest",
    "digest_parts",
    "entries",
    "folder_lock",
    "read_bytes",
    "remove",
    "safetensors_module",
    "write_error",
]

logger = logging.getLogger(__name__)


def check_folder(folder: Path) -> None:
    """Refuse a snapshot folder that is a file, or lies under one, before any work (a wrong path, not a disk fault)."""
    for path in (folder, *folder.parents):
        if path.exists():
            if not path.is_dir():
                where = "is" if path == folder else f"lies under {path}, which is"
                raise SnapshotError(f"the snapshot folder {folder} {where} a file, not a folder")
            return


def write_error(folder: Path, error: OSError) -> SnapshotWriteError:
    """``error`` of a save into ``folder`` as the package's :class:`SnapshotWriteError`, keeping its ``errno``."""
    return SnapshotWriteError(f"saving a snapshot into {folder} failed: {error}", error.errno)


@contextmanager
def folder_lock(folder: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold a ``flock`` on the folder itself (exclusive to save, shared to read) where the platform has one; a folder
    that cannot be opened (missing: nothing to read yet) is not locked."""
    try:
        import fcntl
    except ImportError:  # Windows: the in-process mutex only
        yield
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def read_bytes(path: Path, limit: int | None = None) -> bytes:
    """The file's bytes (at most ``limit`` of them); raises :class:`SnapshotCorruptError` when it cannot be read."""
    try:
        if limit is not None:
            with open(path, "rb") as file:
                return file.read(limit)
        return path.read_bytes()
    except OSError as error:
        raise SnapshotCorruptError(f"cannot read {path}: {error}") from None


def entries(folder: Path) -> list[str]:
    """The folder's entry names; ``[]`` (logged) when it cannot be listed."""
    try:
        return os.listdir(folder)
    except OSError as error:
        logger.warning("cannot list snapshot folder %s to remove old versions: %s", folder, error)
        return []


def remove(path: Path) -> None:
    """Remove a file or folder if it is there; a failure is only logged (the next save tries again)."""
    try:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    except Exception as error:  # cleaning up must not turn a finished save (or the original error) into another
        logger.warning("cannot remove %s: %s", path, error)


def canonical(manifest: dict[str, Any]) -> bytes:
    """The bytes a manifest's checksum covers: sorted keys, no spaces."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


LONG_LISTS = ("nodes", "host_runs")
"""The manifest's lists that grow with the cache, which :func:`canonical_parts` encodes an item at a time."""


def _as_list(value: Any) -> list[Any]:
    """A captured manifest's arrays (token arrays, NumPy block lists) as the JSON lists the file holds."""
    if isinstance(value, (array, np.ndarray)):
        return value.tolist()
    raise TypeError(f"a snapshot manifest cannot hold {type(value).__name__}")


_encode = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=_as_list).encode


def canonical_parts(manifest: dict[str, Any]) -> Iterator[bytes]:
    """:func:`canonical` of ``manifest`` in pieces that join to the same bytes (arrays in it encoded as lists, as
    :func:`~prefixcache.cache.snapshot.tree.capture` leaves them): the long lists (:data:`LONG_LISTS`) an item at a
    time, so a writer thread gives up the GIL between items (one call of the C encoder holds it for the whole value:
    80 ms for the nodes of a million tokens).  O(manifest size)."""
    yield b"{"
    for index, key in enumerate(sorted(manifest)):
        value = manifest[key]
        yield (b"," if index else b"") + _encode(key).encode() + b":"
        if key in LONG_LISTS and isinstance(value, list):
            yield b"["
            for position, item in enumerate(value):
                yield (b"," if position else b"") + _encode(item).encode()
            yield b"]"
        else:
            yield _encode(value).encode()
    yield b"}"


def digest(data: bytes) -> str:
    """xxh3-128 of ``data`` as hex."""
    return xxhash.xxh3_128_hexdigest(data)


def digest_parts(parts: Iterable[Any]) -> str:
    """:func:`digest` of the buffers ``parts`` joined, without joining them.  O(bytes)."""
    hasher = xxhash.xxh3_128()
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


def safetensors_module():
    """``safetensors.torch``; raises :class:`SnapshotError` naming the extra when it is not installed."""
    try:
        import safetensors.torch
    except ImportError:
        raise SnapshotError(f"snapshots of K/V need safetensors: {install_command('snapshot')}") from None
    return safetensors.torch
