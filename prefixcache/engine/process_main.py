"""The engine process's own side of :mod:`prefixcache.engine.process`: its main loop (``python -c``
:data:`CHILD_COMMAND`), which builds the runner and its :class:`~prefixcache.engine.batching.BatchEngine` and serves
the parent's commands (the messages: :mod:`prefixcache.engine.process_wire`)."""

from __future__ import annotations

import contextlib
import functools
import pickle
import signal
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Any

from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.chat import PreparedChat, submit_chat
from prefixcache.engine.chat_decoder import ChatDecoder
from prefixcache.engine.grammar import register_tokenizer
from prefixcache.engine.process_wire import NOT_ADMITTED, Ready, portable, receive_message, send_message
from prefixcache.engine.results import GenerationResult
from prefixcache.errors import InvalidArgumentError, PrefixCacheError

__all__ = ["CHILD_COMMAND", "child_main"]


def _portable_value(value: Any) -> Any:
    # A result's insert record points into the child's tree: not the parent's business, and heavy to pickle.
    return replace(value, insert=None) if isinstance(value, GenerationResult) and value.insert is not None else value


class _ChildLink:
    """The child's end of the pipe, sent to from the command thread and the engine thread."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, kind: str, job: int, value: Any) -> None:
        try:
            data = pickle.dumps((kind, job, value), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:  # noqa: BLE001 - a value that does not pickle: the job fails, not the child
            failure = RuntimeError(f"the engine's answer did not pickle: {type(error).__name__}: {error}")
            data = pickle.dumps(("end", job, ("error", failure)), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self.lock:
                self.conn.send_bytes(data)
        except (OSError, ValueError):
            pass  # the parent is gone; the command loop sees EOF and ends the child

    def end(self, job: int, future: Future[Any]) -> None:
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or isinstance(error, CancelledError):
            self.send("end", job, ("cancelled", None))
        elif error is not None:
            self.send("end", job, ("error", portable(error)))
        else:
            self.send("end", job, ("done", _portable_value(future.result())))


CHILD_COMMAND = (
    "import sys\n"
    "if sys.path[:1] == ['']: del sys.path[0]\n"  # python -c's current folder: the parent's path comes as PYTHONPATH
    "from prefixcache.engine.process_main import child_main\n"
    "child_main(int(sys.argv[1]), int(sys.argv[2]))"
)
"""The engine process's command line after ``python -c``; its arguments are its ends of the two socket pairs (the
commands', the cancels')."""


def child_main(fd: int, cancels_fd: int) -> None:
    """The engine process (``python -c CHILD_COMMAND fd cancels_fd``): read the factory, the engine's options and the
    heartbeat interval, build the runner and its engine, then serve the parent's commands and cancels until ``close``
    or the parent's end closes, with a heartbeat meanwhile."""
    conn = Connection(fd)
    cancels = Connection(cancels_fd)
    try:
        factory, options, heartbeat_s = receive_message(conn)
    except BaseException as error:  # noqa: BLE001 - a factory that does not unpickle here
        hint = "the runner factory must be a module-level function of a module the engine process can import"
        with contextlib.suppress(OSError):
            send_message(
                conn, ("failed", InvalidArgumentError(f"{hint} (not __main__'s): {type(error).__name__}: {error}"))
            )
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent ends us
    link = _ChildLink(conn)
    try:
        built = factory()
        runner, note = built if isinstance(built, tuple) else (built, "")
        register_tokenizer(runner.tokenizer)
        engine = BatchEngine(runner, **options)
        engine.start()
        thread_id = engine.call_soon(threading.get_native_id).result()
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it
        if not isinstance(error, PrefixCacheError):  # a bug or a resource: its stack is here, not in the parent
            traceback.print_exc()
        with contextlib.suppress(OSError):  # the parent may be gone already
            send_message(conn, ("failed", portable(error)))
        conn.close()
        return
    try:
        send_message(conn, ("ready", Ready(runner.tokenizer, note, thread_id)))
    except OSError:  # the parent died while this one started
        engine.close()
        return
    served = threading.Event()
    beats = threading.Thread(target=_beat, args=(link, heartbeat_s, served), name="prefixcache-heartbeat", daemon=True)
    beats.start()
    try:
        _serve(conn, _Commands(engine, link, cancels))
    finally:
        served.set()
        engine.close()
        try:
            link.send("closed", 0, None)
        finally:
            conn.close()
            cancels.close()


def _beat(link: _ChildLink, interval_s: float, served: threading.Event) -> None:
    """The heartbeat thread: ``("beat", 0, None)`` every ``interval_s`` seconds until ``served`` is set, so that the
    parent tells this process, busy or idle, from one that is stopped (its watchdog; see
    :mod:`prefixcache.engine.process`).  A thread of its own: the engine thread may be in a long step, the command
    thread waiting for the parent."""
    while not served.wait(interval_s):
        link.send("beat", 0, None)


class _Commands:
    """What the command thread knows of the parent's jobs: the requests running (their handles, until they end), the
    highest job id received, and the cancels that came before their request.

    The cancels come on a socket of their own, read before each request is admitted, so that one cancelled while it
    waited in the commands' socket (the parent gave up on it while this process was stopped) is never started.  Jobs
    come in the order of their ids, so a cancel naming a job above the highest received is one whose request is still
    on its way (kept until it comes: then answered cancelled, never admitted), and one naming a job at or below it
    that is not running names one that has ended (ignored)."""

    def __init__(self, engine: BatchEngine, link: _ChildLink, cancels: Connection) -> None:
        self.engine = engine
        self.link = link
        self.cancels: Connection | None = cancels
        self.handles: dict[int, Any] = {}
        self.last_job = 0
        self.cancelled_ahead: set[int] = set()

    def read_cancels(self) -> None:
        """Apply every cancel already sent.  O(cancels read)."""
        while self.cancels is not None:
            try:
                if not self.cancels.poll(0):
                    return
                jobs = receive_message(self.cancels)
            except (EOFError, OSError):
                self.cancels = None  # the parent is gone: its commands' socket ends too
                return
            for job in jobs:
                handle = self.handles.get(job)
                if handle is not None:
                    handle.cancel()
                elif job > self.last_job:
                    self.cancelled_ahead.add(job)

    def arrived(self, job: int) -> bool:
        """Note that ``job`` has come; False when it was cancelled before (answered cancelled here)."""
        self.last_job = max(self.last_job, job)
        if job not in self.cancelled_ahead:
            return True
        self.cancelled_ahead.discard(job)
        self.link.send("end", job, NOT_ADMITTED)
        return False


def _serve(conn: Any, commands: _Commands) -> None:
    link, engine, handles = commands.link, commands.engine, commands.handles
    while True:
        sources = [conn] if commands.cancels is None else [conn, commands.cancels]
        ready = wait(sources)
        commands.read_cancels()
        if conn not in ready:
            continue
        try:
            op, job, data = receive_message(conn)
        except (EOFError, OSError):
            return  # the parent is gone
        if op == "close":
            return
        commands.read_cancels()  # those sent while this request was on its way
        if not commands.arrived(job):
            continue
        try:
            payload = pickle.loads(data)
            if op in ("chat", "submit"):
                handle, future = _submit(op, engine, link, job, payload)
            else:
                fn, args = payload
                future = _function(op, engine, fn, args)
        except BaseException as error:  # noqa: BLE001 - this request's error, answered to its caller
            link.send("ack", job, portable(error))
            continue
        if op in ("chat", "submit"):
            handles[job] = handle
            link.send("ack", job, None)
            future.add_done_callback(functools.partial(_ended, link, handles, job))
        else:
            future.add_done_callback(functools.partial(link.end, job))


def _ended(link: _ChildLink, handles: dict[int, Any], job: int, future: Future[Any]) -> None:
    handles.pop(job, None)
    link.end(job, future)


def _submit(op: str, engine: BatchEngine, link: _ChildLink, job: int, payload: Any) -> tuple[Any, Any]:
    if op == "submit":
        prompt_ids, sampling, options = payload
        handle = engine.submit(prompt_ids, sampling, **options)
        return handle, handle.future
    prompt_ids, sampling, arguments, namespace, request_id, wants_deltas, wants_logprobs = payload
    decoder = ChatDecoder.from_arguments(engine.runner.tokenizer, sampling, arguments)
    prepared = PreparedChat(prompt_ids, sampling, decoder)
    pending: list[Any] = []
    send = link.send

    def on_delta(text: str) -> None:  # on the engine thread: one pickle and one write per delta
        records = tuple(pending)
        pending.clear()
        send("delta", job, (text, records))

    handle, completed = submit_chat(
        engine,
        prepared,
        namespace=namespace,
        request_id=request_id,
        on_delta=on_delta if wants_deltas else None,
        on_logprob=pending.append if wants_logprobs else None,
    )

    def flush(_: Future[Any]) -> None:  # the entries after the last delta (a stop string's tokens), before the end
        if pending:
            on_delta("")

    completed.add_done_callback(flush)  # before _serve's own callback, which sends the end
    return handle, completed


def _function(op: str, engine: BatchEngine, fn: Callable[..., Any], args: tuple[Any, ...]) -> Future[Any]:
    """``fn(engine, *args)``: at once on this thread (``query``) or on the engine thread between steps (``call``); a
    result that is itself a future (a snapshot save's) is waited for."""
    outer: Future[Any] = Future()

    def chained(inner: Future[Any]) -> None:
        error = inner.exception()
        if error is not None:
            outer.set_exception(error)
            return
        value = inner.result()
        if isinstance(value, Future):
            value.add_done_callback(chained)
        else:
            outer.set_result(value)

    if op == "query":
        inner: Future[Any] = Future()
        try:
            inner.set_result(fn(engine, *args))
        except BaseException as error:  # noqa: BLE001 - its caller's error
            inner.set_exception(error)
    else:
        inner = engine.call_soon(functools.partial(fn, engine, *args))
    inner.add_done_callback(chained)
    return outer
