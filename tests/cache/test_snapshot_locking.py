"""Specification of snapshot saves under file-system failures and from several processes: a failed write is a
SnapshotWriteError (an OSError too, with its errno) that leaves the previous version current, and processes saving
into one folder take turns (a folder lock), so every save lands whole and the folder ends with one version."""

from __future__ import annotations

import errno
import fcntl
import multiprocessing
import os
import threading
from pathlib import Path

import pytest
from test_snapshot import busy_cache, describe, make_pool, saved_and_changed, serve

from prefixcache import RadixCache, SnapshotWriteError
from prefixcache.cache.snapshot import tree as snapshot
from prefixcache.errors import SnapshotError

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")


def _versions(folder: Path) -> list[str]:
    return sorted(entry for entry in os.listdir(folder) if entry.startswith(snapshot.VERSION_PREFIX))


@pytest.mark.parametrize("step", ["mkdir", "rename", "replace"])
def test_a_failed_write_is_a_snapshot_write_error_and_the_old_version_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    folder = tmp_path / "snap"
    old, new = saved_and_changed(folder)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(os, step, disk_full)
        with pytest.raises(SnapshotWriteError, match="No space left") as raised:
            new.save(folder)
    assert isinstance(raised.value, OSError) and isinstance(raised.value, SnapshotError)
    assert raised.value.errno == errno.ENOSPC
    assert describe(RadixCache.load(folder, make_pool())) == describe(old)
    assert sorted(os.listdir(folder)) == sorted([snapshot.CURRENT, *_versions(folder)]) and len(_versions(folder)) == 1


def test_a_folder_that_cannot_be_made_is_a_snapshot_write_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "makedirs", denied)
    with pytest.raises(SnapshotWriteError, match="Permission denied") as raised:
        busy_cache().save(tmp_path / "snap")
    assert raised.value.errno == errno.EACCES
    assert not (tmp_path / "snap").exists()


def test_a_save_waits_while_another_process_holds_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "snap"
    busy_cache().save(folder)
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what another process's save holds
    saved = threading.Event()

    def save() -> None:
        cache = busy_cache()
        serve(cache, [3] * 20, seed=5)
        cache.save(folder)
        saved.set()

    thread = threading.Thread(target=save)
    thread.start()
    try:
        assert not saved.wait(0.5), "a save went ahead while the folder was locked"
    finally:
        os.close(fd)  # releases the lock
    thread.join(30)
    assert saved.is_set()
    assert len(_versions(folder)) == 1


def _save_many(folder: str, seed: int, times: int) -> None:
    cache = busy_cache()
    serve(cache, [seed] * 20, seed=seed)
    for _ in range(times):
        cache.save(folder)


def test_two_processes_saving_into_one_folder_leave_one_whole_version(tmp_path: Path) -> None:
    folder = tmp_path / "snap"
    context = multiprocessing.get_context("spawn")
    savers = [context.Process(target=_save_many, args=(str(folder), seed, 10)) for seed in (7, 8)]
    for saver in savers:
        saver.start()
    for saver in savers:
        saver.join(120)
    assert [saver.exitcode for saver in savers] == [0, 0]
    assert sorted(os.listdir(folder)) == sorted([snapshot.CURRENT, *_versions(folder)]) and len(_versions(folder)) == 1
    loaded = RadixCache.load(folder, make_pool())
    loaded.check_invariants()
    expected = []
    for seed in (7, 8):
        cache = busy_cache()
        serve(cache, [seed] * 20, seed=seed)
        expected.append(describe(cache))
    assert describe(loaded) in expected
