"""The model worker: one thread that runs every request's model work, so no two forward passes ever race on the pool.

Requests arrive as generator factories on a queue (:meth:`ModelWorker.submit`).  The thread keeps the started
generators in a list and advances each by one step in turn (a prefill, then one decode step per token), so
concurrent streams interleave token by token instead of waiting for each other to finish, as a continuous-batching
scheduler (Orca, vLLM) would interleave them, minus the batching.  Each step's outcome goes back through the job's
``on_event`` callback (the server forwards it to its event loop).  A cancelled job (the client went away) has its
generator closed, which releases every block and lock its request held.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Generator
from typing import Any

__all__ = ["Job", "ModelWorker"]

logger = logging.getLogger("prefixcache.serve")

JobStart = Callable[[], Generator[Any, None, Any]]
EventSink = Callable[[str, Any], None]
"""``on_event(kind, value)``: ``("delta", yielded value)``, ``("done", return value)``, ``("error", exception)``,
or ``("cancelled", None)``; called on the worker thread."""


class Job:
    """One submitted request: :meth:`cancel` from any thread stops it at its next step."""

    __slots__ = ("cancelled", "deltas", "on_event", "start")

    def __init__(self, start: JobStart, on_event: EventSink, deltas: bool = True) -> None:
        self.start = start
        self.on_event = on_event
        self.deltas = deltas
        # A plain flag, not a threading.Event: nobody waits on it, the worker only polls it between steps, and a
        # bool store is atomic under the GIL (an Event costs a Condition and a lock per request).
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ModelWorker:
    """A daemon thread stepping the generators of submitted jobs round-robin.  Thread-safe :meth:`submit`.

    ``name`` names the thread.  :meth:`close` stops the thread after closing every running generator.
    """

    def __init__(self, name: str = "prefixcache-model") -> None:
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._active: list[tuple[Job, Generator[Any, None, Any]]] = []
        self._busy = threading.Condition()
        self._pending = 0
        self._closed = False
        self.cancelled_jobs = 0
        """Jobs stopped by :meth:`Job.cancel` or :meth:`close` before they finished (their blocks were freed)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, start: JobStart, on_event: EventSink, *, deltas: bool = True) -> Job:
        """Queue a job; ``start()`` is called on the worker thread and must return a generator (an exception from
        it is reported as an ``"error"`` event).  ``deltas=False`` reports only the job's end (a non-streamed
        response needs no ``"delta"``, and each event costs the server a cross-thread wake-up).  Raises
        ``RuntimeError`` after :meth:`close`."""
        job = Job(start, on_event, deltas)
        with self._busy:
            if self._closed:
                raise RuntimeError("the model worker is closed")
            self._pending += 1
        self._queue.put(job)
        return job

    @property
    def num_active(self) -> int:
        """Jobs queued or running."""
        with self._busy:
            return self._pending

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is queued or running; ``False`` on timeout."""
        with self._busy:
            return self._busy.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop accepting jobs, cancel the running ones (their generators are closed) and join the thread."""
        with self._busy:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    def _finish(self, job: Job, kind: str, value: Any) -> None:
        if kind == "cancelled":
            self.cancelled_jobs += 1
        try:
            job.on_event(kind, value)
        except Exception:  # a sink must not kill the thread that serves everyone else
            logger.exception("event sink failed")
        with self._busy:
            self._pending -= 1
            self._busy.notify_all()

    def _take(self, block: bool) -> bool:
        """Start queued jobs; returns ``False`` once :meth:`close` was called."""
        while True:
            try:
                job = self._queue.get(block=block)
            except queue.Empty:
                return True
            block = False
            if job is None:
                return False
            if job.cancelled:
                self._finish(job, "cancelled", None)
                continue
            try:
                self._active.append((job, job.start()))
            except Exception as error:
                self._finish(job, "error", error)

    def _run(self) -> None:
        running = True
        while running:
            running = self._take(block=not self._active)
            for entry in list(self._active):
                job, steps = entry
                if not running or job.cancelled:
                    steps.close()
                    self._active.remove(entry)
                    self._finish(job, "cancelled", None)
                    continue
                try:
                    value = next(steps)
                except StopIteration as done:
                    self._active.remove(entry)
                    self._finish(job, "done", done.value)
                except Exception as error:
                    steps.close()
                    self._active.remove(entry)
                    self._finish(job, "error", error)
                else:
                    if not job.deltas:
                        continue
                    try:
                        job.on_event("delta", value)
                    except Exception:
                        logger.exception("event sink failed")
                        job.cancel()
