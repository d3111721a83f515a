"""The engine process's own side of :mod:`prefixcache.engine.process`: its main loop (``python -c``
:data:`CHILD_COMMAND`), which builds the runner and its :class:`~prefixcache.engine.batching.BatchEngine` and serves
the parent's commands, and the wire both ends share (one pickled message per frame of a
``multiprocessing.connection.Connection`` over a socket pair).  See :mod:`prefixcache.engine.process` for the
messages."""

from __future__ import annotations

import contextlib
import functools
import pickle
import signal
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.chat import ChatDecoder, PreparedChat, submit_chat
from prefixcache.engine.grammar import register_tokenizer
from prefixcache.engine.results import GenerationResult
from prefixcache.errors import InvalidArgumentError, PrefixCacheError

__all__ = ["CHILD_COMMAND", "Ready", "child_main", "portable", "receive_message", "send_message"]


@dataclass(frozen=True, slots=True)
class Ready:
    """What the engine process sends once it has started: its tokenizer (pickled), the factory's note and the native
    id of its engine thread."""

    tokenizer: Any
    note: str
    engine_thread_id: int


def send_message(conn: Connection, message: Any) -> None:
    # Plain pickle, not the Connection's own (multiprocessing's ForkingPickler), on which torch registers reducers
    # that move tensors through shared memory: a result's prompt logits are copied as bytes instead.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive_message(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling as itself (its type and message), else a ``RuntimeError`` naming its type
    and message, so that the parent always gets an exception.  O(size of the error's pickle)."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error
    except Exception:  # noqa: BLE001 - any failure to pickle means: send a stand-in
        pass
    return RuntimeError(f"{type(error).__name__}: {error}")


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
    "child_main(int(sys.argv[1]))"
)
"""The engine process's command line after ``python -c``; its one argument is its end of the socket pair."""


def child_main(fd: int) -> None:
    """The engine process (``python -c CHILD_COMMAND fd``): read the factory, the engine's options and the heartbeat
    interval, build the runner and its engine, then serve the parent's commands until ``close`` or the parent's end
    closes, with a heartbeat meanwhile."""
    conn = Connection(fd)
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
    handles: dict[int, Any] = {}
    served = threading.Event()
    beats = threading.Thread(target=_beat, args=(link, heartbeat_s, served), name="prefixcache-heartbeat", daemon=True)
    beats.start()
    try:
        _serve(conn, link, engine, handles)
    finally:
        served.set()
        engine.close()
        try:
            link.send("closed", 0, None)
        finally:
            conn.close()


def _beat(link: _ChildLink, interval_s: float, served: threading.Event) -> None:
    """The heartbeat thread: ``("beat", 0, None)`` every ``interval_s`` seconds until ``served`` is set, so that the
    parent tells this process, busy or idle, from one that is stopped (its watchdog; see
    :mod:`prefixcache.engine.process`).  A thread of its own: the engine thread may be in a long step, the command
    thread waiting for the parent."""
    while not served.wait(interval_s):
        link.send("beat", 0, None)


def _serve(conn: Any, link: _ChildLink, engine: BatchEngine, handles: dict[int, Any]) -> None:
    while True:
        try:
            op, job, data = receive_message(conn)
        except (EOFError, OSError):
            return  # the parent is gone
        if op == "close":
            return
        if op == "cancel":
            handle = handles.get(job)
            if handle is not None:
                handle.cancel()
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
