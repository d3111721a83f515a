"""Running the app under uvicorn: in the foreground (``prefixcache serve``) or on a background thread (tests, bench).

The socket is bound here, before uvicorn starts, so that port 0 yields a free port whose number is known at once.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

__all__ = ["BackgroundServer", "bind", "serve_forever", "start_background"]


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: a free port).  Raises ``OSError`` if it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when the proto says TCP, and without it
    # Nagle holds the second write of a response (body after headers) for the client's delayed ACK, ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _config(app: FastAPI, log_level: str, **options: object) -> uvicorn.Config:
    """uvicorn's settings for ``app``.  The access log is kept only where it is printed (``log_level`` info or
    more verbose): uvicorn formats each line's arguments (client address, path) before the logger drops it, and
    the client address is its only use of the proxy headers, so both go when nothing is logged."""
    logged = log_level.lower() in ("info", "debug", "trace")
    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=logged,
        proxy_headers=logged,
        timeout_graceful_shutdown=5,
        **options,  # type: ignore[arg-type]
    )


def serve_forever(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    log_level: str = "info",
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve ``app`` until interrupted (Ctrl-C or SIGTERM stop uvicorn gracefully, and this returns).

    ``announce(url)`` is called once the port is bound (with ``port=0``, the URL names the port picked).
    Raises ``OSError`` if the port is taken.
    """
    sock = bind(host, port)
    if announce is not None:
        bound = sock.getsockname()[1]
        announce(f"http://{f'[{host}]' if ':' in host else host}:{bound}")
    config = _config(app, log_level)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the signal after its graceful shutdown; for a server, Ctrl-C is the normal stop


@dataclass
class BackgroundServer:
    """A uvicorn server on a daemon thread; ``url`` is ``http://host:port`` and :meth:`stop` shuts it down."""

    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_background(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, timeout: float = 30.0
) -> BackgroundServer:
    """Start ``app`` on a free port of ``host`` in a thread and wait until it accepts requests.

    Raises ``OSError`` if it cannot bind, ``RuntimeError`` if uvicorn has not started within ``timeout`` seconds.
    """
    sock = bind(host, port)
    actual_port = sock.getsockname()[1]
    config = _config(app, "warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start on {host}:{actual_port}")
        time.sleep(0.01)
    return BackgroundServer(server, thread, host, actual_port)
