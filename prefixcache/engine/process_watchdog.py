"""The watchdog of an engine process: tells a child that is stopped from one that is busy, by its heartbeat."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

__all__ = ["Watchdog"]


class Watchdog:
    """A thread that, every ``interval_s`` seconds, calls ``on_silent()`` when nothing has been heard from the child
    (:meth:`heard`) for more than ``timeout_s`` seconds and nothing it sent waits unread on ``conn`` (this process's
    receiver may just not have had the GIL to read it); not while ``is_silent()`` says it is already taken as
    silent.  Ends with :meth:`stop`, or when ``conn`` is closed."""

    def __init__(
        self,
        conn: Connection,
        *,
        timeout_s: float,
        interval_s: float,
        is_silent: Callable[[], bool],
        on_silent: Callable[[], None],
    ) -> None:
        self.conn = conn
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.is_silent = is_silent
        self.on_silent = on_silent
        self.heard_at = time.monotonic()
        """``time.monotonic()`` when the child was last heard."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="prefixcache-engine-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def heard(self) -> None:
        """The child was heard now (any message, its heartbeat included).  O(1)."""
        self.heard_at = time.monotonic()

    def stop(self) -> None:
        """Ask the thread to end (at its next wake-up); never waits."""
        self._stopping.set()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the thread to end; nothing when called from the thread itself (an
        ``on_silent`` that closes the engine)."""
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _watch(self) -> None:
        while not self._stopping.wait(self.interval_s):
            if self.is_silent() or time.monotonic() - self.heard_at <= self.timeout_s:
                continue
            try:
                unread = self.conn.poll(0)  # sent, but this process's receiver has not had the GIL to read it
            except (OSError, ValueError):
                return  # closed
            if not unread:
                self.on_silent()
