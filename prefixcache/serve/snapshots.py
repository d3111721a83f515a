"""Snapshots for the server: restore the cache at start, save it every few minutes and on a clean shutdown.

A restore runs on the :class:`~prefixcache.engine.batching.BatchEngine` thread
(:meth:`~prefixcache.engine.batching.BatchEngine.load_snapshot`), between two steps, so it never races a forward pass; a
save copies the cache there between two steps and writes its files on a writer thread
(:meth:`~prefixcache.engine.batching.BatchEngine.save_snapshot`), so streams never wait for the disk.  A snapshot
that is missing, refused (another model, block size, dtype) or damaged leaves the server to start cold, and the log
says why; a failed save is logged and the previous snapshot stays current.
"""

from __future__ import annotations

import asyncio
import logging
import os

from prefixcache.cache.snapshot import SnapshotSummary
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.process import EngineProcess
from prefixcache.errors import InvalidArgumentError, SnapshotError, SnapshotNotFoundError

__all__ = ["SHUTDOWN_SAVE_TIMEOUT_S", "SnapshotKeeper"]

SHUTDOWN_SAVE_TIMEOUT_S = 600.0
"""How long a server's shutdown waits for its last snapshot save (10 minutes: a large pool's files written and
fsynced) before it stops waiting and ends."""

logger = logging.getLogger(__name__)


class SnapshotKeeper:
    """The snapshot folder ``directory`` of a server's cache: :meth:`restore` at start, :meth:`save` every ``every_s``
    seconds (:meth:`run_periodic`; never when None) and at shutdown, each through ``engine`` (a
    :class:`~prefixcache.engine.batching.BatchEngine` or an :class:`~prefixcache.engine.process.EngineProcess`).

    ``restored`` is what the start loaded (None when it started cold, ``restore_error`` then says why);
    ``last_saved`` the latest save and ``save_errors`` the number of failed ones.

    Raises:
        InvalidArgumentError: ``every_s`` is not a positive number, or ``directory`` is a file.
    """

    def __init__(
        self,
        engine: BatchEngine | EngineProcess,
        directory: str | os.PathLike[str],
        every_s: float | None = None,
    ) -> None:
        if every_s is not None and (isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or every_s <= 0):
            raise InvalidArgumentError(f"the snapshot interval must be a positive number of seconds, got {every_s!r}")
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise InvalidArgumentError(f"the snapshot folder {os.fspath(directory)} is a file, not a folder")
        self.engine = engine
        self.directory = os.fspath(directory)
        self.every_s = every_s
        self.restored: SnapshotSummary | None = None
        self.restore_error: str | None = None
        self.last_saved: SnapshotSummary | None = None
        self.save_errors = 0

    async def restore(self) -> SnapshotSummary | None:
        """Load the snapshot into the runner's cache; on any failure start cold and log why (``restore_error``).
        Never raises for what the folder holds: an error that is not a :class:`SnapshotError` (a bug a snapshot
        reached) is logged too, and the device cache is emptied in case the load left part of it.  Returns what
        loaded."""
        try:
            self.restored = await asyncio.wrap_future(self.engine.load_snapshot(self.directory))
        except SnapshotNotFoundError:
            self.restore_error = f"no snapshot in {self.directory} yet"
            logger.info("starting with an empty cache: %s", self.restore_error)
        except (SnapshotError, OSError) as error:
            self.restore_error = str(error)
            logger.warning("starting with an empty cache: the snapshot was refused: %s", error)
        except Exception as error:  # a snapshot must never keep the server from starting, whatever it holds
            self.restore_error = f"{type(error).__name__}: {error}"
            logger.warning("starting with an empty cache: loading the snapshot failed: %s", self.restore_error)
            await asyncio.wrap_future(self.engine.evict_all())
        else:
            loaded = self.restored
            skipped = f"; {loaded.skipped_tokens:,} tokens did not fit the pool" if loaded.skipped_tokens else ""
            if loaded.host_tokens or loaded.skipped_host_tokens:
                skipped += f"; host tier: {loaded.host_tokens:,} tokens back, {loaded.skipped_host_tokens:,} left out"
            logger.info(
                "restored %s tokens (%s nodes, %s blocks) from %s%s",
                f"{loaded.num_tokens:,}",
                f"{loaded.num_nodes:,}",
                f"{loaded.num_blocks:,}",
                loaded.path,
                skipped,
            )
        return self.restored

    async def save(self, timeout_s: float | None = None) -> SnapshotSummary | None:
        """Save the cache now; a failure is logged (the previous snapshot stays current).  Returns what was saved.
        After ``timeout_s`` seconds (None: no limit) it stops waiting, logs it as a failure and returns None; the save
        itself goes on (an engine process that stopped answering must not hold the server's shutdown forever)."""
        try:
            saving = asyncio.wrap_future(self.engine.save_snapshot(self.directory))
            saved = await asyncio.wait_for(asyncio.shield(saving), timeout_s)
        except asyncio.TimeoutError:  # before OSError: TimeoutError is one since Python 3.11
            self.save_errors += 1
            logger.error("saving the cache snapshot to %s: no answer in %s s; not waiting", self.directory, timeout_s)
            return None
        except (SnapshotError, OSError, InvalidArgumentError, RuntimeError) as error:  # the last two: engine closed
            self.save_errors += 1
            logger.error("saving the cache snapshot to %s failed: %s", self.directory, error)
            return None
        except Exception as error:  # a bug, a MemoryError: never the end of the periodic saves or of the shutdown
            self.save_errors += 1
            logger.exception(
                "saving the cache snapshot to %s failed: %s: %s", self.directory, type(error).__name__, error
            )
            return None
        self.last_saved = saved
        logger.info("saved %s cached tokens (%s nodes) to %s", f"{saved.num_tokens:,}", saved.num_nodes, saved.path)
        return saved

    async def run_periodic(self) -> None:
        """Save every ``every_s`` seconds until cancelled (returns at once when ``every_s`` is None)."""
        if self.every_s is None:
            return
        while True:
            await asyncio.sleep(self.every_s)
            await self.save()
