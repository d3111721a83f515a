"""The sending end of an engine process's socket, on the parent's side: :class:`Outbox`, a queue of framed messages
that one sender thread writes, so that no caller of :class:`~prefixcache.engine.process.EngineProcess` (a server's
event loop cancelling a request, its worker thread submitting one) ever waits for the child to read.

Why: a socket's send blocks once the kernel's buffer (some hundreds of KiB) is full and the reader does not read.  A
child that is stopped (SIGSTOP, a debugger, a frozen cgroup) or stuck reads nothing, and a large prompt written by
the caller's own thread held that thread, and the lock every later sender queued on, for as long as the child did
not read: a server's event loop froze at its next cancel (issue 44).  Here a put is O(1) under a lock that is never
held across a write, and the bytes not yet written are bounded: a request that would pass :data:`MAX_UNSENT_BYTES`
is refused at once with EngineDeadError instead of growing the queue for as long as the child does not read.

A message put for a job can be taken back until its write begins (:meth:`Outbox.discard`): a request that failed or
was cancelled while it waited here is never sent, and its bytes are freed at once, so a child that stops reading and
then reads again is not handed work that its callers have already given up on.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from prefixcache.errors import EngineDeadError

__all__ = ["MAX_UNSENT_BYTES", "Outbox"]

MAX_UNSENT_BYTES = 256 << 20
"""The most bytes of requests (256 MiB: eight of a server's largest bodies) queued for a child that has not read
them; a child that reads takes them in milliseconds, so only one that stopped reading fills it."""


@dataclass(slots=True)
class _Message:
    job: int | None
    data: bytes | None  # None once discarded: the sender skips it


class Outbox:
    """Messages (already pickled bytes) written in order to ``conn`` by a daemon thread named ``name``.  :meth:`put`
    never blocks on the child; :meth:`discard` takes back a job's messages not yet being written; :meth:`close` lets
    the thread end once it has written what was put before.  Thread safe.  A write that fails (the child is gone)
    ends the thread and drops what was queued; every later put raises EngineDeadError."""

    def __init__(self, conn: Connection, name: str, max_unsent_bytes: int = MAX_UNSENT_BYTES) -> None:
        self._conn = conn
        self._queue: deque[_Message | None] = deque()  # None: the thread ends there
        self._waiting: dict[int, _Message] = {}  # job -> its message, until its write begins
        self._ready = threading.Condition()
        self.max_unsent_bytes = max_unsent_bytes
        self.unsent_bytes = 0
        """Bytes put and not yet written whole (the message being written included; discarded ones not)."""
        self.writing: int | None = None
        """The job of the message being written, if it was put for one."""
        self.failure: str | None = None
        """Why the last write failed (the connection's error), or None."""
        self._thread = threading.Thread(target=self._send_all, name=name, daemon=True)
        self._thread.start()

    def put(self, message: bytes, *, job: int | None = None, bounded: bool = False) -> None:
        """Queue ``message`` after every message put before it, as ``job``'s (which :meth:`discard` can take back;
        one message per job at a time).  O(1).  A ``bounded`` one (a request: cancels and the close are never
        refused, they free the child's work) is refused when the unsent bytes would pass ``max_unsent_bytes``.
        Raises EngineDeadError: the write of an earlier message failed, the outbox is closed, or a ``bounded``
        message does not fit."""
        with self._ready:
            if self.failure is not None:
                raise EngineDeadError(f"the engine process is gone ({self.failure})")
            if self._queue and self._queue[-1] is None:
                raise EngineDeadError("the engine process's connection is closed")
            if bounded and self.unsent_bytes + len(message) > self.max_unsent_bytes:
                mib = self.unsent_bytes / (1 << 20)
                raise EngineDeadError(f"the engine process is not reading: {mib:.0f} MiB sent to it are still unread")
            entry = _Message(job, message)
            if job is not None:
                self._waiting[job] = entry
            self._queue.append(entry)
            self.unsent_bytes += len(message)
            self._ready.notify()

    def discard(self, jobs: Iterable[int]) -> set[int]:
        """Take back the messages of ``jobs`` whose write has not begun: they are never written and their bytes no
        longer count.  Returns the jobs whose message was taken back (not those being written or written already,
        nor jobs never put).  O(number of ``jobs``)."""
        taken: set[int] = set()
        with self._ready:
            for job in jobs:
                entry = self._waiting.pop(job, None)
                if entry is not None and entry.data is not None:
                    self.unsent_bytes -= len(entry.data)
                    entry.data = None  # its bytes go now; the sender skips the empty entry
                    taken.add(job)
        return taken

    def close(self) -> None:
        """End the sender thread once it has written what was put before (at once if it is not writing); later
        puts raise EngineDeadError.  Idempotent."""
        with self._ready:
            if not self._queue or self._queue[-1] is not None:
                self._queue.append(None)
                self._ready.notify()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the sender thread to end (see :meth:`close`), at most ``timeout_s`` seconds; not from itself."""
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _send_all(self) -> None:
        queue, ready = self._queue, self._ready
        while True:
            with ready:
                while not queue or (queue[0] is not None and queue[0].data is None):
                    if queue:
                        queue.popleft()  # discarded
                    else:
                        ready.wait()
                entry = queue[0]  # left queued, and counted, until it is written whole
                if entry is None:
                    return
                data = entry.data
                assert data is not None
                if entry.job is not None and self._waiting.get(entry.job) is entry:
                    del self._waiting[entry.job]  # from now on it cannot be taken back
                self.writing = entry.job
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError) as error:  # a broken pipe, or the connection closed
                with ready:
                    self.failure = str(error) or type(error).__name__
                    queue.clear()
                    self._waiting.clear()
                    self.unsent_bytes = 0
                    self.writing = None
                return
            with ready:
                queue.popleft()
                self.unsent_bytes -= len(data)
                self.writing = None
