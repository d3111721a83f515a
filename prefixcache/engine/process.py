"""An engine in a process of its own: :class:`EngineProcess` runs a :class:`~prefixcache.engine.batching.BatchEngine`
in a child process and offers the server what it uses of one (``submit``, :func:`~prefixcache.engine.chat.submit_chat`,
snapshots, counters, ``close``).

Why: in one process, the server's event loop and the engine's thread share one GIL.  Every streamed token costs the
loop about 0.1 ms of Python with the GIL held (uvloop's wake-up, the ASGI send chain, the socket write), and the
engine's thread waits for it between its many small tensor operations: a few percent of a small model's token time
(issue 30; ``prefixcache bench serve`` measures it).  In its own process the engine has a GIL of its own; per token it
only pickles the text delta and writes it to a socket (a syscall that gives up its GIL).  vLLM's V1 splits its API
server and its ``EngineCore`` the same way.

What crosses the socket (the child's side is :mod:`prefixcache.engine.process_main`): the parent sends each request
as its prompt ids, its :class:`SamplingParams` (a grammar travels as its source and is rebuilt in the child over the
child's own tokenizer, see :func:`~prefixcache.engine.grammar.register_tokenizer`) and its decoder's arguments; the
child runs it exactly as in-process (``submit_chat``: the stop strings and the detokenizer on the engine thread, so
a stop string ends the request before that token's K/V are computed, as in-process) and sends back each text delta
with its logprob records, then the end.  Functions run in the child are module-level ones, passed by reference
(pickle), never closures.  Wire messages are tuples; a request's own arguments are pickled by the parent into bytes,
so one that the child cannot unpickle fails that request alone.

- parent to child: ``("chat" | "submit", job, payload)``, ``("cancel", job, None)``, ``("call" | "query", job,
  payload)``, ``("close", 0, None)``;
- child to parent: ``("ready", info)`` or ``("failed", error)`` once, then ``("ack", job, error)``, ``("delta",
  job, (text, records))``, ``("end", job, (kind, value))`` and ``("closed", 0, None)``.

Thread safety: every method may be called from any thread.  ``on_delta`` and ``on_logprob`` run on the parent's
receiver thread (not the engine's): they must not block, as on the engine thread.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from typing import Any

from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.chat import PreparedChat
from prefixcache.engine.process_main import CHILD_COMMAND, Ready, receive_message, send_message
from prefixcache.errors import EngineDeadError, InvalidArgumentError

__all__ = ["EngineProcess", "RemoteHandle"]

logger = logging.getLogger(__name__)

RunnerFactory = Callable[[], Any]
"""Builds the runner in the child: a module-level function (or ``functools.partial`` of one), since it is pickled.
Returns the :class:`~prefixcache.engine.runner.PrefixCachingRunner`, or ``(runner, note)`` with a line of text the
parent gets back as :attr:`EngineProcess.note` (the server's start line says how large the pool is)."""


class RemoteHandle:
    """A request running in an :class:`EngineProcess`: ``future`` holds its outcome (the
    :class:`~prefixcache.engine.results.GenerationResult`, or ``ChatCompletion`` for a chat; its error; a
    ``concurrent.futures.CancelledError`` once ``cancel()`` took effect), ``cancel()`` drops it (its blocks are freed
    at the engine's next step; harmless once it has finished)."""

    __slots__ = ("_ask_cancel", "cancelled", "future")

    def __init__(self, ask_cancel: Callable[[], None]) -> None:
        self._ask_cancel = ask_cancel
        self.future: Future[Any] = Future()
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        if not self.future.done() or self.future.cancelled():  # cancelled by its holder: the child runs it still
            try:
                self._ask_cancel()
            except EngineDeadError:
                pass  # its future fails on its own

    def result(self, timeout: float | None = None) -> Any:
        """Block until done; raises what the request raised."""
        return self.future.result(timeout)


class _Job:
    __slots__ = ("ack", "error", "handle", "on_delta", "on_logprob")

    def __init__(self, handle: RemoteHandle | None, on_delta: Any = None, on_logprob: Any = None) -> None:
        self.ack: Future[None] = Future()
        self.handle = handle
        self.on_delta = on_delta
        self.on_logprob = on_logprob
        self.error: BaseException | None = None
        """What a callback raised: the request is cancelled and fails with it, as in-process."""

    def deliver(self, text: str, records: tuple[Any, ...]) -> None:
        if self.error is not None:
            return
        try:
            if self.on_logprob is not None:
                for record in records:
                    self.on_logprob(record)
            if self.on_delta is not None and text:
                self.on_delta(text)
        except BaseException as error:  # noqa: BLE001 - the request's error, a SystemExit too: it must not end the
            self.error = error  # receiver thread (every request would wait forever), as the engine thread serves on
            assert self.handle is not None
            self.handle.cancel()


class _RemoteCache:
    """The parent's view of the child runner's cache: what the server's metrics read."""

    def __init__(self, process: EngineProcess) -> None:
        self._process = process

    def stats(self) -> Any:
        """The child's ``RadixCache.stats()`` (a round trip; raises EngineDeadError once the child is gone)."""
        return self._process.query(_cache_stats)


class EngineProcess:
    """A :class:`~prefixcache.engine.batching.BatchEngine` over the runner ``factory()`` builds, stepping in a child
    process (a fresh interpreter, ``python -c``) so that it never waits for this process's GIL (see the module
    docstring).

    ``max_batch_tokens``, ``max_running`` and ``policy`` are the engine's.  The constructor returns once the child has
    built its runner and started its engine (seconds: it imports torch and builds the model), or raises what the
    factory raised (its type kept where it pickles), EngineDeadError if the child died first, TimeoutError after
    ``start_timeout_s``.  A submit or :meth:`query` the child has not answered within ``answer_timeout_s`` raises
    EngineDeadError.  :meth:`close` ends the child; a child that dies fails every request it held and every later
    call with EngineDeadError.

    ``tokenizer`` is a copy of the child runner's tokenizer (sent back pickled), for the server's prompt rendering,
    tokenization and logprob strings; ``pid`` the child's process id and ``engine_thread_id`` its engine thread's
    native id (``/proc/<pid>/task/<tid>``)."""

    def __init__(
        self,
        factory: RunnerFactory,
        *,
        max_batch_tokens: int = 512,
        max_running: int = 32,
        policy: str = "lpm",
        start_timeout_s: float | None = 600.0,
        answer_timeout_s: float = 60.0,
    ) -> None:
        self.answer_timeout_s = answer_timeout_s
        """How long a submit waits for the child to accept a request, and :meth:`query` for its answer, before it
        raises EngineDeadError (a child that stopped answering: stopped, or stuck in one step)."""
        # A fresh interpreter started by its command line, not multiprocessing's spawn: spawn runs the parent's main
        # module again in the child, which fails for a script without a ``__main__`` guard (and for a notebook).
        parent_end, child_end = socket.socketpair()
        environment = dict(os.environ)
        # The child imports from where this process imports, in its order (an empty entry, this process's current
        # folder, made absolute), and from nowhere else: not from its own current folder, which ``python -c`` would
        # put first (CHILD_COMMAND drops it), nor from an empty entry of a PYTHONPATH.
        path = [os.path.abspath(entry) for entry in sys.path]
        environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
        self._process = subprocess.Popen(
            [sys.executable, "-c", CHILD_COMMAND, str(child_end.fileno())],
            pass_fds=(child_end.fileno(),),
            env=environment,
        )
        child_end.close()
        self._conn = Connection(parent_end.detach())
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count(1)
        self._dead: EngineDeadError | None = None
        self._closed = False
        options = {"max_batch_tokens": max_batch_tokens, "max_running": max_running, "policy": policy}
        try:
            send_message(self._conn, (factory, options))
            ready = self._first_message(start_timeout_s)
        except BaseException:
            self._process.kill()
            self._process.wait()
            self._conn.close()
            raise
        self.tokenizer = ready.tokenizer
        self.note = ready.note
        self.engine_thread_id = ready.engine_thread_id
        self.pid: int = self._process.pid
        self.cache = _RemoteCache(self)
        self._receiver = threading.Thread(target=self._receive, name="prefixcache-engine-receiver", daemon=True)
        self._receiver.start()

    def _first_message(self, timeout_s: float | None) -> Ready:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the engine process did not start within {timeout_s} s")
        try:
            kind, value = receive_message(self._conn)
        except (EOFError, OSError):
            code = self._process.wait(10)
            raise EngineDeadError(f"the engine process exited while starting (exit code {code})") from None
        if kind == "failed":
            raise value
        return value

    # -- requests ---------------------------------------------------------------------------------------------------

    def submit(self, prompt_ids: Any, sampling: Any = None, **options: Any) -> RemoteHandle:
        """Queue a request as :meth:`BatchEngine.submit` does, without per-token callbacks (``on_token`` and
        ``on_logprob`` cannot cross the process boundary: use :meth:`submit_prepared` for a streamed answer).  Raises
        what the engine's submit raises (InvalidTokensError, CapacityError, NamespaceError, InvalidArgumentError),
        InvalidArgumentError for a callback, EngineDeadError once the child is gone.  Blocks for one round trip."""
        if options.get("on_token") is not None or options.get("on_logprob") is not None:
            raise InvalidArgumentError("on_token and on_logprob do not cross to an engine process: use submit_chat")
        options.pop("on_token", None)
        options.pop("on_logprob", None)
        # As given, so that the child's checks see what BatchEngine.submit would (a bad type or shape is its
        # InvalidTokensError, not a TypeError here); only an iterator, which does not pickle, is read into a list.
        prompt = list(prompt_ids) if isinstance(prompt_ids, Iterator) else prompt_ids
        return self._start("submit", (prompt, sampling, options), None, None)

    def submit_prepared(
        self,
        prepared: PreparedChat,
        *,
        namespace: str | None = None,
        request_id: str | None = None,
        on_delta: Callable[[str], None] | None = None,
        on_logprob: Callable[[Any], None] | None = None,
    ) -> tuple[RemoteHandle, Future[Any]]:
        """:func:`~prefixcache.engine.chat.submit_chat` in the child (which calls this for an engine process): the
        same text deltas, logprob records (each before the delta its token's text is part of) and
        ``ChatCompletion``.  Raises as :meth:`submit`."""
        payload = (prepared.prompt_ids, prepared.sampling, prepared.decoder.arguments, namespace, request_id)
        payload += (on_delta is not None or on_logprob is not None, on_logprob is not None)
        handle = self._start("chat", payload, on_delta, on_logprob)
        return handle, handle.future

    def _start(self, op: str, payload: Any, on_delta: Any, on_logprob: Any) -> RemoteHandle:
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._check_open()
            job_id = next(self._ids)
            handle = RemoteHandle(functools.partial(self._post, "cancel", job_id, None))
            job = self._jobs[job_id] = _Job(handle, on_delta, on_logprob)
        self._post(op, job_id, data)
        try:
            job.ack.result(self.answer_timeout_s)  # the engine's own checks raise here, as in-process
        except FutureTimeout:
            with self._lock:
                self._jobs.pop(job_id, None)
            handle.cancel()
            raise EngineDeadError(f"the engine process did not answer within {self.answer_timeout_s} s") from None
        return handle

    # -- functions in the child -------------------------------------------------------------------------------------

    def call(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(engine, *args)`` on the child's engine thread between two steps (:meth:`BatchEngine.call_soon`);
        ``fn`` must be a module-level function (it is pickled).  A result that is a ``Future`` is waited for in the
        child.  The future holds the result or the error.  Raises EngineDeadError once the child is gone."""
        return self._run("call", fn, args)

    def query(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
        """``fn(engine, *args)`` run at once on the child's command thread, not between steps (for reads that the
        engine's own locks make safe: counters, cache stats), and its result.  Raises what ``fn`` raised,
        EngineDeadError once the child is gone, TimeoutError after ``timeout_s``."""
        timeout_s = self.answer_timeout_s if timeout_s is None else timeout_s
        try:
            return self._run("query", fn, args).result(timeout_s)
        except FutureTimeout:
            raise EngineDeadError(f"the engine process did not answer within {timeout_s} s") from None

    def _run(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Future[Any]:
        data = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self._check_open()
            job_id = next(self._ids)
            job = self._jobs[job_id] = _Job(None)
        self._post(op, job_id, data)
        return job.ack

    def save_snapshot(self, directory: str | os.PathLike[str]) -> Future[Any]:
        """:meth:`BatchEngine.save_snapshot` in the child (the copy between two steps, the files on its writer)."""
        return self._run("query", BatchEngine.save_snapshot, (directory,))  # as given: the child checks it

    def load_snapshot(self, directory: str | os.PathLike[str]) -> Future[Any]:
        """:meth:`BatchEngine.load_snapshot` in the child (between two steps)."""
        return self._run("query", BatchEngine.load_snapshot, (directory,))

    def evict_all(self) -> Future[Any]:
        """:meth:`BatchEngine.evict_all` in the child (between two steps)."""
        return self._run("query", BatchEngine.evict_all, ())

    num_pending = property(lambda self: self.query(getattr, "num_pending"), doc="The child engine's num_pending.")
    preempted_requests = property(lambda self: self.query(getattr, "preempted_requests"), doc="Its preemptions.")
    cancelled_requests = property(lambda self: self.query(getattr, "cancelled_requests"), doc="Its cancellations.")

    # -- life -------------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Nothing: the child's engine steps from the start (here so that a server starts either engine alike)."""

    @property
    def alive(self) -> bool:
        """Whether the child runs and has not been closed."""
        return self._dead is None and not self._closed and self._process.poll() is None

    def close(self, timeout_s: float = 30.0) -> None:
        """End the child: its engine closes (requests still queued are cancelled, a snapshot being written finishes)
        and it exits; killed if it has not within ``timeout_s``.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._dead is None:
            try:
                self._post("close", 0, None)
            except EngineDeadError:
                pass
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the engine process did not exit within %s s: killed", timeout_s)
            self._process.kill()
            self._process.wait()
        if threading.current_thread() is not self._receiver:  # a future's callback may close it from there
            self._receiver.join(timeout_s)
        self._conn.close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("the engine is closed")
        if self._dead is not None:
            raise self._dead

    def _post(self, op: str, job: int, data: Any) -> None:
        try:
            with self._send_lock:
                send_message(self._conn, (op, job, data))
        except (OSError, ValueError) as error:  # a broken pipe, or the connection closed
            raise self._dead or EngineDeadError(f"the engine process is gone ({error})") from None

    def _receive(self) -> None:
        """The receiver thread: every message of the child, in order, to its job."""
        jobs = self._jobs
        while True:
            try:
                kind, job_id, value = receive_message(self._conn)
            except (EOFError, OSError):
                break
            if kind == "delta":
                job = jobs.get(job_id)
                if job is not None:
                    job.deliver(*value)
            elif kind == "ack":
                job = jobs.get(job_id)
                if job is None:  # its caller stopped waiting (answer_timeout_s) and cancelled it
                    continue
                if value is None:
                    _settle(job.ack, "done", None)
                else:
                    with self._lock:
                        jobs.pop(job_id, None)
                    _settle(job.ack, "error", value)
            elif kind == "end":
                with self._lock:
                    job = jobs.pop(job_id, None)
                if job is None:
                    continue
                if job.error is not None:
                    value = ("error", job.error)
                _settle(job.handle.future if job.handle is not None else job.ack, *value)
            elif kind == "closed":
                break
        try:
            code: int | None = self._process.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        dead = EngineDeadError(
            "the engine process was closed" if self._closed else f"the engine process exited (exit code {code})"
        )
        with self._lock:
            self._dead = dead
            pending, self._jobs = list(self._jobs.values()), {}
        if not self._closed:
            logger.error("%s; %d request(s) in flight failed", dead, len(pending))
        for job in pending:
            if not job.ack.done():  # a submit or call the child never answered: refused as after close
                _settle(job.ack, "error", InvalidArgumentError("the engine is closed") if self._closed else dead)
            if job.handle is not None and not job.handle.future.done():
                _settle(job.handle.future, "error", CancelledError() if self._closed else dead)

    def __repr__(self) -> str:
        return f"EngineProcess(pid={self.pid}, alive={self.alive})"


def _settle(future: Future[Any], kind: str, value: Any) -> None:
    # A future its holder cancelled (asyncio.wrap_future cancels it with the task awaiting it) takes no outcome: raising
    # InvalidStateError here would end the receiver thread, and every later call would wait forever.
    try:
        if kind == "done":
            future.set_result(value)
        elif kind == "cancelled":
            future.set_exception(CancelledError())
        else:
            future.set_exception(value)
    except InvalidStateError:
        pass


def _cache_stats(engine: BatchEngine) -> Any:
    return engine.runner.cache.stats()
