"""The streaming client of ``bench serve``'s decode table, run in its own process from this file alone.

An HTTP client is another process in any deployment: in the server's process its threads would take the GIL from
the engine's thread at every token and make the server look slower than it is.  The benchmark starts this module once
and talks to it over stdin/stdout, one JSON line per run each way:

- in: ``{"bodies": [a streamed /v1/completions body per stream, ...]}``;
- out: ``{"stamps": [[[wall s, engine CPU s or null], ...] per stream], "cpu_s": the client's own CPU time in the
  run}`` or ``{"error": "..."}``.

Each stream is one streamed ``/v1/completions`` request on its own ``http.client`` connection and thread; a stamp is
taken as each SSE event with a choice arrives.  Wall time is ``time.perf_counter`` (CLOCK_MONOTONIC on Linux, so the
same clock as the server process's); the engine thread's CPU time is read from
``/proc/<server pid>/task/<engine thread id>/schedstat`` (its run time in ns), null where there is no such file.
Only the standard library is imported, and the benchmark loads this file by its path (:data:`LAUNCH`), not as
``prefixcache.bench.serve_client``, whose package would import every benchmark and torch: the process starts in a few
tens of milliseconds and holds about 20 MB.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LAUNCH", "engine_cpu_reader", "main", "stream"]

LAUNCH = (
    "import importlib.util, sys; spec = importlib.util.spec_from_file_location('serve_client', sys.argv[1]); "
    "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
    "sys.exit(module.main(sys.argv[2:]))"
)
"""``python -c LAUNCH <this file> host port pid tid`` runs :func:`main` without importing the ``prefixcache``
package."""


def engine_cpu_reader(pid: int, thread_id: int) -> Callable[[], float | None]:
    """A function returning the CPU time (seconds) thread ``thread_id`` of process ``pid`` has run, or None where
    Linux's ``/proc/<pid>/task/<tid>/schedstat`` cannot be read."""
    path = f"/proc/{pid}/task/{thread_id}/schedstat"

    def read() -> float | None:
        try:
            with open(path, "rb") as file:
                return int(file.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            return None

    return read


EVENT = b'data: {"id"'
"""How each SSE event with a choice begins (the ``[DONE]`` line and an error event do not)."""

FAILED = b'data: {"error"'
"""How the server's error event begins: a stream that fails after its first token sends one, then ``[DONE]``."""

DONE = b"data: [DONE]"

MAX_LINE_BYTES = 1 << 20
"""A line longer than this (1 MiB; an event of one token is some 150 bytes) is an error, not a buffer that grows."""


def stream(host: str, port: int, body: dict[str, Any], stamp: Callable[[], Any]) -> list[Any]:
    """Stream ``body`` to ``/v1/completions`` on ``host:port``; ``stamp()`` for each SSE event with a choice, in order,
    as the line holding it arrives (events whose lines complete in one read share a stamp's time).  The body is not
    parsed: the client counts event starts in the whole lines of the raw bytes (the chunked framing included: the
    server writes each event in one chunk), at a few microseconds a read, so that on a machine it shares with the
    server it takes little CPU from the engine; a marker counts only at the start of a line (JSON escapes the quotes a
    token's text would need to spell an event start there).  Returns at ``[DONE]``.  Raises ``RuntimeError`` on a
    status other than 200, an error event, a line over :data:`MAX_LINE_BYTES`, or an answer that ends before
    ``[DONE]``, and ``OSError`` on a failed connection."""
    stamps = []
    connection = http.client.HTTPConnection(host, port, timeout=120)
    connection.connect()
    connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    headers = {"Content-Type": "application/json", "Connection": "close"}  # one request per connection
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), headers)
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        raw, pending = response.fp, b""
        while data := raw.read1(1 << 16):
            pending += data
            cut = pending.rfind(b"\n") + 1  # markers are looked for in whole lines only: none is cut or seen twice
            if cut == 0:
                if len(pending) > MAX_LINE_BYTES:
                    raise RuntimeError(f"the stream sent a line of over {MAX_LINE_BYTES:,} bytes")
                continue
            lines, pending = b"\n" + pending[:cut], pending[cut:]
            now = stamp()
            stamps.extend(now for _ in range(lines.count(b"\n" + EVENT)))
            if b"\n" + FAILED in lines:
                at = lines.index(b"\n" + FAILED) + 1
                raise RuntimeError(f"the stream failed after {len(stamps)} event(s): {lines[at : at + 200]!r}")
            if b"\n" + DONE in lines:
                return stamps
        raise RuntimeError(f"the stream ended after {len(stamps)} event(s), before its [DONE]")
    finally:
        connection.close()


def _run(host: str, port: int, engine_cpu: Callable[[], float | None], request: dict[str, Any]) -> list[Any]:
    """One run: every body of ``request`` streamed at once, one thread each; each stream's stamps."""
    results: list[list[Any]] = [[] for _ in request["bodies"]]
    errors: list[BaseException] = []

    def client(i: int, body: dict[str, Any]) -> None:
        try:
            results[i] = stream(host, port, body, lambda: (time.perf_counter(), engine_cpu()))
        except BaseException as error:  # noqa: BLE001 - reported to the benchmark after the run
            errors.append(error)

    threads = [threading.Thread(target=client, args=item) for item in enumerate(request["bodies"])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def main(argv: list[str] | None = None) -> int:
    """``host port server_pid engine_thread_id``: answer each JSON line of stdin with one of stdout until stdin ends;
    0 then, 2 (with a usage line on stderr) for other arguments."""
    args = argv if argv is not None else sys.argv[1:]
    numbers = args[1:]
    if (
        len(args) != 4
        or not all(n.isascii() and n.isdigit() and int(n) < 2**31 for n in numbers)
        or int(args[1]) > 65535
    ):
        sys.stderr.write(f"usage: serve_client HOST PORT SERVER_PID ENGINE_THREAD_ID (numbers), got {args!r}\n")
        return 2
    host, port, pid, thread_id = args
    engine_cpu = engine_cpu_reader(int(pid), int(thread_id))
    for line in sys.stdin:
        try:
            cpu = time.process_time()  # every thread of this process, the run's finished ones included
            answer: dict[str, Any] = {"stamps": _run(host, int(port), engine_cpu, json.loads(line))}
            answer["cpu_s"] = time.process_time() - cpu
        except Exception as error:  # noqa: BLE001 - the benchmark raises it
            answer = {"error": f"{type(error).__name__}: {error}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
