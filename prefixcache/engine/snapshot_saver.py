"""Snapshot saves beside a running engine: the copy between two steps, the files written on a thread of their own.

A save (:meth:`SnapshotSaver.save`) is two steps.  The copy runs on the engine thread between two steps (through
the ``call_soon`` of :class:`~prefixcache.engine.batching.BatchEngine`): the runner's
:meth:`~prefixcache.engine.runner.PrefixCachingRunner.capture_snapshot`, a walk of the tree and one gather of the
saved blocks into host memory that the writer thread has allocated and written once beforehand
(:func:`~prefixcache.cache.snapshot.staging.staging_for`), so the engine pays a memcpy, not page faults.  The copy is
the snapshot: blocks freed or reused by later steps do not change it.  Then the writer thread writes and fsyncs the
files (:func:`~prefixcache.cache.snapshot.writer.write`, commit semantics unchanged) while the engine steps on, and
the caller's future gets the :class:`~prefixcache.cache.snapshot.SnapshotSummary` or the exception
(:class:`~prefixcache.errors.SnapshotWriteError`: the previous version is kept).

One save at a time, so at most one copy of the cache is in host memory: a save asked for while another is being
copied or written waits for it, and its copy is taken once that one's files are committed (or it failed).  A save
asked for while one into the same folder still waits for its copy joins it (a future of its own, the same save):
that copy is taken after both calls, so it covers everything cached before either.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache.snapshot import Snapshot, SnapshotSummary
from prefixcache.cache.snapshot import writer as snapshot_write
from prefixcache.cache.snapshot.staging import StagingBuffer, staging_for
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.errors import InvalidArgumentError

__all__ = ["SnapshotSaver"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SaveJob:
    """One save: its folder, the futures of the calls it answers, and whether its copy has been taken (then no
    later call joins it)."""

    directory: str
    futures: list[Future[SnapshotSummary]] = field(default_factory=list)
    copied: bool = False


class SnapshotSaver:
    """Saves of ``runner``'s cache whose copy ``call_soon`` runs between two engine steps and whose files a writer
    thread writes (see the module docstring).  The writer thread runs while saves are queued and ends after the last.
    Thread-safe."""

    def __init__(self, runner: PrefixCachingRunner, call_soon: Callable[[Callable[[], Any]], Future[Any]]) -> None:
        self._runner = runner
        self._call_soon = call_soon
        self._lock = threading.Lock()
        self._jobs: deque[SaveJob] = deque()  # the first is being copied or written
        self._thread: threading.Thread | None = None
        self._closed = False

    def save(self, directory: str | os.PathLike[str]) -> Future[SnapshotSummary]:
        """Queue a save of the runner's cache into the snapshot folder ``directory``; returns at once.  The future
        holds what was written, or the error: :class:`~prefixcache.errors.SnapshotWriteError` (a write or sync
        failed; the previous version is kept), :class:`~prefixcache.errors.SnapshotError` (safetensors missing, the
        folder is a file), or a ``RuntimeError`` / :class:`~prefixcache.errors.InvalidArgumentError` when the engine
        closed before the copy was taken.  Cancelling the future drops only this call's interest in the save.

        Raises:
            InvalidArgumentError: ``directory`` is not a path, or the saver is closed (the engine closed).
        """
        if not isinstance(directory, (str, os.PathLike)):
            raise InvalidArgumentError(f"a snapshot folder must be a path, got {type(directory).__name__}")
        folder = os.fspath(directory)
        future: Future[SnapshotSummary] = Future()
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("the engine is closed")
            job = next((job for job in self._jobs if not job.copied and job.directory == folder), None)
            if job is None:
                job = SaveJob(folder)
                self._jobs.append(job)
            job.futures.append(future)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prefixcache-snapshot-writer", daemon=True)
                self._thread.start()
        return future

    def close(self) -> None:
        """Refuse new saves and fail those not started (``RuntimeError``); the one under way finishes (its copy
        fails if the engine closes first).  Returns at once; :meth:`join` waits for the writer."""
        with self._lock:
            self._closed = True
            dropped = [self._jobs.pop() for _ in range(len(self._jobs) - 1)]
        for job in dropped:
            _settle(job.futures, error=RuntimeError("the engine closed before the snapshot's copy was taken"))

    def join(self) -> None:
        """Wait until the writer thread has no save left (not when called on that thread, from a future's
        callback: it would wait on itself)."""
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs[0]
            summary, error = None, None
            try:
                summary = self._save(job)
            except BaseException as raised:  # noqa: BLE001 - handed to the callers, as call_soon hands its errors
                error = raised
            with self._lock:
                job.copied = True  # a copy that failed is joined no more either
                futures = list(job.futures)
                self._jobs.popleft()
            _settle(futures, summary, error)

    def _save(self, job: SaveJob) -> SnapshotSummary:
        cache = self._runner.cache
        staging = staging_for(cache.pool, cache.host_pool)  # the page faults here, beside the engine
        captured = self._call_soon(lambda: self._copy(job, staging)).result()
        return snapshot_write.write(captured, job.directory)

    def _copy(self, job: SaveJob, staging: StagingBuffer | None) -> Snapshot:
        """On the engine thread, between two steps."""
        with self._lock:
            job.copied = True
        start = time.perf_counter()
        captured = self._runner.capture_snapshot(staging)
        logger.debug(
            "copied %s cached tokens for a snapshot in %.1f ms on the engine thread",
            f"{captured.manifest['num_tokens']:,}",
            1e3 * (time.perf_counter() - start),
        )
        return captured


def _settle(
    futures: list[Future[SnapshotSummary]], result: SnapshotSummary | None = None, error: BaseException | None = None
) -> None:
    """Give every future not cancelled ``result`` or ``error``."""
    for future in futures:
        try:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        except InvalidStateError:  # cancelled by its caller
            pass
