"""The wire between an engine process and its parent: the messages each side sends, and how they cross a socket.

One pickled message per frame of a ``multiprocessing.connection.Connection`` over a socket pair.  Functions run in
the child are module-level ones, passed by reference (pickle), never closures.  Messages are tuples; a request's
own arguments are pickled by the parent into bytes, so one that the child cannot unpickle fails that request alone.

- parent to child: ``(factory, options, heartbeat_s)`` once, then ``("chat" | "submit", job, payload)``,
  ``("call" | "query", job, payload)``, ``("close", 0, None)``, in the order of their job ids;
- parent to child on a second socket, the cancels: a tuple of the job ids of requests to cancel;
- child to parent: ``("ready", info)`` (:class:`Ready`) or ``("failed", error)`` once, then ``("ack", job, error)``,
  ``("delta", job, (text, records))``, ``("end", job, (kind, value))``, ``("beat", 0, None)`` every ``heartbeat_s``
  seconds and ``("closed", 0, None)``; a request cancelled before the child admitted it ends :data:`NOT_ADMITTED`.

An end's ``(kind, value)`` is ``("done", result)``, ``("cancelled", None)`` or ``("error", exception)``
(:func:`settle` gives it to the job's future).
"""

from __future__ import annotations

import pickle
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["NOT_ADMITTED", "Ready", "portable", "receive_message", "send_message", "settle"]

NOT_ADMITTED = ("cancelled", "not admitted")
"""The end of a request whose cancel came before it: its engine never saw it (nor counted it as cancelled)."""


@dataclass(frozen=True, slots=True)
class Ready:
    """What the engine process sends once it has started: its tokenizer (pickled), the factory's note and the native
    id of its engine thread."""

    tokenizer: Any
    note: str
    engine_thread_id: int


def send_message(conn: Connection, message: Any) -> None:
    """Write ``message`` as one frame.  Raises OSError (and ValueError once closed) when the socket fails."""
    # Plain pickle, not the Connection's own (multiprocessing's ForkingPickler), on which torch registers reducers
    # that move tensors through shared memory: a result's prompt logits are copied as bytes instead.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive_message(conn: Connection) -> Any:
    """The next message; waits for it.  Raises EOFError once the other end closed, OSError when the socket fails."""
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


def settle(future: Future[Any], kind: str, value: Any) -> None:
    """Give ``future`` the outcome of an end ``(kind, value)``: its result for ``"done"``, a
    ``concurrent.futures.CancelledError`` for ``"cancelled"``, else the exception ``value``.  Nothing for a future
    its holder has cancelled meanwhile."""
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
