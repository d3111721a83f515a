"""The engine process as its parent starts and ends it: a fresh interpreter, its two sockets, its first message, its
exit (killed when it does not exit in time)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from prefixcache.engine.process_main import CHILD_COMMAND
from prefixcache.engine.process_wire import Ready, receive_message, send_message
from prefixcache.errors import EngineDeadError

__all__ = ["ChildProcess"]

logger = logging.getLogger(__name__)


class ChildProcess:
    """An engine process running ``factory`` (pickled: a module-level function or a ``functools.partial`` of one)
    under a ``BatchEngine`` with ``options``, sending a heartbeat every ``heartbeat_s`` seconds.

    The constructor returns once the child has sent :class:`Ready` (seconds: it imports torch and builds the model),
    or raises what the factory raised (its type kept where it pickles), EngineDeadError if the child died first,
    TimeoutError after ``start_timeout_s`` (None: no bound); the child is then killed.  ``conn`` carries the commands
    and the child's answers, ``cancels_conn`` the cancels (:mod:`prefixcache.engine.process_wire`)."""

    def __init__(
        self,
        factory: Callable[[], Any],
        options: dict[str, Any],
        heartbeat_s: float,
        start_timeout_s: float | None,
    ) -> None:
        # A fresh interpreter started by its command line, not multiprocessing's spawn: spawn runs the parent's main
        # module again in the child, which fails for a script without a ``__main__`` guard (and for a notebook).
        parent_end, child_end = socket.socketpair()
        cancels_end, child_cancels_end = socket.socketpair()
        environment = dict(os.environ)
        # The child imports from where this process imports, in its order (an empty entry, this process's current
        # folder, made absolute), and from nowhere else: not from its own current folder, which ``python -c`` would
        # put first (CHILD_COMMAND drops it), nor from an empty entry of a PYTHONPATH.
        path = [os.path.abspath(entry) for entry in sys.path]
        environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD_COMMAND, str(child_end.fileno()), str(child_cancels_end.fileno())],
            pass_fds=(child_end.fileno(), child_cancels_end.fileno()),
            env=environment,
        )
        child_end.close()
        child_cancels_end.close()
        self.conn = Connection(parent_end.detach())
        self.cancels_conn = Connection(cancels_end.detach())
        try:
            send_message(self.conn, (factory, options, heartbeat_s))
            self.ready = self._first_message(start_timeout_s)
        except BaseException:
            self.process.kill()
            self.process.wait()
            self.close_sockets()
            raise
        self.pid: int = self.process.pid

    def _first_message(self, timeout_s: float | None) -> Ready:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"the engine process did not start within {timeout_s} s")
        try:
            kind, value = receive_message(self.conn)
        except (EOFError, OSError):
            code = self.process.wait(10)
            raise EngineDeadError(f"the engine process exited while starting (exit code {code})") from None
        if kind == "failed":
            raise value
        return value

    def running(self) -> bool:
        """Whether the process has not exited."""
        return self.process.poll() is None

    def exit_code(self, timeout_s: float) -> int | None:
        """The process's exit code once it has exited, waiting up to ``timeout_s``; None if it has not by then."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def end(self, timeout_s: float, at_once: bool) -> None:
        """Wait for the process to exit, killing it if it has not within ``timeout_s`` (logged), or at once."""
        try:
            self.process.wait(0 if at_once else timeout_s)
        except subprocess.TimeoutExpired:
            if not at_once:
                logger.warning("the engine process did not exit within %s s: killed", timeout_s)
            self.process.kill()
            self.process.wait()

    def close_sockets(self) -> None:
        self.conn.close()
        self.cancels_conn.close()
