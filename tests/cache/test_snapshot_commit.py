"""Snapshot commit semantics: a save returns only once its new version is durable; any failed write, fsync or
rename raises ``SnapshotWriteError`` and the previous version is kept, whichever version ``CURRENT`` names after a
power loss."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_snapshot import _version, busy_cache, describe, make_pool, node_kv, saved_and_changed

from prefixcache import RadixCache
from prefixcache.cache.snapshot import tree as snapshot
from prefixcache.cache.snapshot import writer as snapshot_write
from prefixcache.errors import SnapshotError, SnapshotWriteError

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")


class Injected(Exception):
    """A fault that is not a file-system error (a bug, an interrupt), raised inside a save."""


class FaultInjector:
    """Counts every file-system step of a save (and raises ``fault`` at step ``fail_at``): the snapshot module's
    file writes and folder syncs, and the os calls that sync, make, rename and remove."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None, fault: type = Injected) -> None:
        self.calls: list[str] = []
        self.fail_at = fail_at
        self.fault = fault
        targets = [
            (snapshot_write, "_write_file"),
            (snapshot_write, "_fsync_dir"),
            (os, "fsync"),
            (os, "makedirs"),
            (os, "mkdir"),
            (os, "rename"),
            (os, "replace"),
            (shutil, "rmtree"),
        ]
        for owner, name in targets:
            monkeypatch.setattr(owner, name, self.wrap(name, getattr(owner, name)))

    def wrap(self, name: str, original):
        def step(*args, **kwargs):
            self.calls.append(name)
            if len(self.calls) - 1 == self.fail_at:
                if self.fault is OSError:
                    raise OSError(errno.EIO, f"injected I/O error at step {self.fail_at} ({name})")
                raise self.fault(f"fault at step {self.fail_at} ({name})")
            return original(*args, **kwargs)

        return step


def assert_loads_as(folder: Path, expected: RadixCache) -> None:
    loaded = RadixCache.load(folder, make_pool())
    loaded.check_invariants()
    assert describe(loaded) == describe(expected)
    for key, value in node_kv(loaded).items():
        assert torch.equal(value, node_kv(expected)[key])


def test_a_save_touches_the_files_in_the_expected_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    busy_cache().save(tmp_path / "snap")
    with monkeypatch.context() as patch:
        injector = FaultInjector(patch)
        busy_cache(48).save(tmp_path / "snap")
    # Every kind of step is exercised below; the folder is synced after the replace, the old version removed last.
    assert {"_write_file", "fsync", "_fsync_dir", "mkdir", "rename", "replace", "rmtree"} <= set(injector.calls)
    replace = injector.calls.index("replace")
    assert "_fsync_dir" in injector.calls[replace : injector.calls.index("rmtree")]


@pytest.mark.parametrize("fault", [OSError, Injected], ids=["os_error", "other_exception"])
def test_a_fault_at_every_step_of_a_save_keeps_the_previous_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: type
) -> None:
    folder = tmp_path / "snap"
    old, new = saved_and_changed(folder)
    old.save(tmp_path / "count")
    with monkeypatch.context() as patch:
        counting = FaultInjector(patch)
        new.save(tmp_path / "count")
    outcomes = set()

    for fail_at in range(len(counting.calls)):
        old.save(folder)  # a clean start: the old content is current
        previous = _version(folder).name
        with monkeypatch.context() as patch:
            injector = FaultInjector(patch, fail_at, fault)
            try:
                new.save(folder)
            except (SnapshotWriteError, Injected) as error:
                failed = True
                if fault is OSError:
                    assert isinstance(error, SnapshotWriteError) and error.errno == errno.EIO
            else:
                failed = False
        step = injector.calls[fail_at]
        outcomes.add((step, failed))
        current = _version(folder).name
        names = sorted(os.listdir(folder))
        if not failed:  # only a fault while removing the old version, after the commit, is merely logged
            inside_makedirs = injector.calls[fail_at - 1] == "makedirs"  # an existing folder: makedirs ignores it
            assert step == "rmtree" or inside_makedirs, step
            assert_loads_as(folder, new)
            continue
        assert_loads_as(folder / previous, old)
        if current == previous:  # failed before the replace: nothing of the failed save is left
            assert names == sorted([snapshot.CURRENT, previous]), step
            assert_loads_as(folder, old)
        else:  # only the sync after the replace failed: both complete versions are kept
            assert names == sorted([snapshot.CURRENT, previous, current]), step
            assert_loads_as(folder, new)
            (folder / snapshot.CURRENT).write_text(previous + "\n")  # what a power loss may leave
            assert_loads_as(folder, old)
    assert ("replace", True) in outcomes and ("rmtree", False) in outcomes
    assert ("_fsync_dir", True) in outcomes and ("fsync", True) in outcomes
    new.save(folder)
    assert sorted(os.listdir(folder)) == sorted([snapshot.CURRENT, _version(folder).name])


def test_a_failed_sync_after_the_replace_fails_the_save_and_keeps_the_previous_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "snap"
    old, new = saved_and_changed(folder)
    previous = _version(folder).name
    real_fsync_dir, replaced = snapshot_write._fsync_dir, []

    def fsync_dir(path: Path) -> None:
        if path == folder and replaced:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync_dir(path)

    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda *a: (real_replace(*a), replaced.append(1)))
    monkeypatch.setattr(snapshot_write, "_fsync_dir", fsync_dir)

    with pytest.raises(SnapshotWriteError, match="previous version is kept") as raised:
        new.save(folder)

    assert isinstance(raised.value, SnapshotError) and isinstance(raised.value, OSError)
    assert raised.value.errno == errno.EIO
    assert (folder / previous).is_dir()
    monkeypatch.undo()
    assert_loads_as(folder / previous, old)
    new.save(folder)  # the next save that commits removes both older versions
    assert sorted(os.listdir(folder)) == sorted([snapshot.CURRENT, _version(folder).name])


def test_a_crash_mid_save_leaves_stale_folders_that_the_next_save_removes(tmp_path: Path) -> None:
    folder = tmp_path / "snap"
    busy_cache().save(folder)
    (folder / f"{snapshot.TEMP_PREFIX}snapshot-1").mkdir()
    (folder / "snapshot-0000-half").mkdir()
    (folder / "notes.txt").write_text("a user's file")

    assert RadixCache.load(folder, make_pool()).stats().num_nodes == len(describe(busy_cache()))
    busy_cache().save(folder)

    assert sorted(os.listdir(folder)) == sorted([snapshot.CURRENT, "notes.txt", _version(folder).name])
