"""The two servers ``bench llamacpp`` starts and stops: llama.cpp's ``llama-server`` and ``prefixcache serve``, each in
a process group of its own on a free loopback port, so that stopping one ends every process it made (our engine
process too) and an error in the benchmark leaves none behind.

The command lines give both the same threads and context: llama-server ``-t N -tb N -c CONTEXT -np 1`` (one slot)
and ``--cache-ram 0`` (no copies of earlier prompts' K/V in host memory beyond the context: its default keeps up to
8 GiB of them, which ours, holding ``CONTEXT`` tokens of K/V in all, does not); ours ``--cache-tokens CONTEXT
--max-running 1`` with ``OMP_NUM_THREADS=N`` (torch's intra-op threads, in the server and in its engine process).
Resident memory is the sum over the group's processes of ``/proc/PID/statm``'s resident pages (Linux; None
elsewhere).
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from prefixcache.bench.precision import Precision
from prefixcache.errors import InvalidArgumentError

__all__ = [
    "START_TIMEOUT_S",
    "ServerProcess",
    "free_port",
    "group_resident_bytes",
    "group_resident_parts",
    "llama_server_command",
    "prefixcache_serve_command",
]

START_TIMEOUT_S = 300.0
"""How long a server may take to answer ``/health`` with 200 (ours dequantizes a GGUF at load: SmolLM2 about 10 s on
an idle 2-core machine, several times that on a loaded one)."""
STOP_TIMEOUT_S = 15.0
HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick; free until someone else takes it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def llama_server_command(binary: Path, gguf: Path, port: int, threads: int, context: int) -> list[str]:
    """llama-server on ``gguf``: ``threads`` for decode and prompt batches, one slot of ``context`` tokens, no host
    memory prompt cache."""
    return [
        str(binary),
        *("-m", str(gguf), "--host", HOST, "--port", str(port)),
        *("-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", "1", "--cache-ram", "0"),
    ]


def prefixcache_serve_command(gguf: Path, precision: Precision, port: int, context: int) -> list[str]:
    """``prefixcache serve`` on ``gguf`` at ``precision`` (``--dtype``, ``--quantize``), a pool of ``context``
    tokens, one request running at a time; run by this interpreter."""
    return [
        sys.executable,
        *("-m", "prefixcache", "serve", "--model", str(gguf), "--served-model-name", "bench"),
        *("--dtype", precision.dtype, "--quantize", precision.quantize),
        *("--host", HOST, "--port", str(port), "--cache-tokens", str(context), "--max-running", "1"),
    ]


def _group_members(group: int) -> list[int]:
    """Ids of the live processes whose process group is ``group``, from ``/proc/PID/stat`` (empty off Linux); a
    zombie (ended, not yet reaped by its new parent) is not counted."""
    members = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def group_resident_parts(group: int) -> list[tuple[int, str, int]]:
    """``(pid, command name, resident bytes)`` of every live process of process group ``group``, by pid
    (``/proc/PID/statm`` and ``comm``; empty off Linux)."""
    parts = []
    for pid in sorted(_group_members(group)):
        try:
            pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, ValueError, IndexError):  # ended while we looked
            continue
        parts.append((pid, name, pages * os.sysconf("SC_PAGE_SIZE")))
    return parts


def group_resident_bytes(group: int) -> int | None:
    """Resident bytes of every process of process group ``group`` (:func:`group_resident_parts`), None off Linux or
    when it has none."""
    parts = group_resident_parts(group)
    return sum(size for _pid, _name, size in parts) if parts else None


class ServerProcess:
    """One server started by :meth:`start` in a new session (its own process group), its output in ``log``,
    ready when ``GET /health`` answers 200; :meth:`stop` (or leaving the ``with`` block) ends the whole group:
    SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`."""

    def __init__(self, name: str, command: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.command, self.port, self.log = name, command, port, log
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> ServerProcess:
        """Start the server and wait until it is ready.  Raises InvalidArgumentError when it exits first or is not
        ready within ``timeout_s`` (the end of its log in the message); the group is stopped then."""
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        try:
            while not self._healthy():
                if self.process.poll() is not None:
                    raise InvalidArgumentError(f"{self.name} exited ({self.process.returncode}): {self._log_tail()}")
                if time.monotonic() > deadline:
                    raise InvalidArgumentError(f"{self.name} not ready after {timeout_s:.0f} s: {self._log_tail()}")
                time.sleep(0.25)
        except BaseException:
            self.stop()
            raise
        return self

    def _healthy(self) -> bool:
        connection = http.client.HTTPConnection(HOST, self.port, timeout=5)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    def _log_tail(self, chars: int = 800) -> str:
        try:
            return self.log.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def resident_bytes(self) -> int | None:
        """Resident bytes of the server and every process it started (None when not running or off Linux)."""
        if self.process is None or self.process.poll() is not None:
            return None
        return group_resident_bytes(self.process.pid)

    def resident_parts(self) -> list[tuple[int, str, int]]:
        """:func:`group_resident_parts` of the server's group, the server first (empty when not running)."""
        if self.process is None or self.process.poll() is not None:
            return []
        return group_resident_parts(self.process.pid)

    def stop(self) -> None:
        """End the server's process group (idempotent)."""
        if self.process is None:
            return
        group = self.process.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while time.monotonic() < deadline:
                self.process.poll()  # reaps the leader
                if self.process.returncode is not None and not _group_members(group):
                    break
                time.sleep(0.05)
            else:
                continue
            break
        self.process = None

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
