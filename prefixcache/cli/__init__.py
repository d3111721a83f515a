"""The ``prefixcache`` command line: ``replay``, ``bench``, ``plan`` and ``serve``, one module each.

``prefixcache --help``, ``--version``, ``plan`` and the replays that run no model (``replay --no-model``,
``--sweep``, ``--endpoint``) import no torch: each command imports the layers it runs on only when it runs (the
package's facade and ``prefixcache.models`` are lazy too, and the cache imports torch only for a pool that holds K/V).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from prefixcache.cli import bench, plan, replay, serve
from prefixcache.cli.options import parse_count, parse_size, verbose_parent, version
from prefixcache.errors import PrefixCacheError, VerificationError
from prefixcache.host_allocator import keep_freed_host_memory_unless_opted_out

__all__ = ["build_parser", "main", "parse_count", "parse_size"]

_COMMANDS = {"replay": replay, "bench": bench, "serve": serve, "plan": plan}


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command (``-v`` is taken before and after the subcommand)."""
    parser = argparse.ArgumentParser(prog="prefixcache", description="Exact prefix caching for LLM inference.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    commands = parser.add_subparsers(dest="command", required=True)
    after = verbose_parent()
    for command in _COMMANDS.values():
        command.add_parser(commands, [after])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 verification failed, 2 bad input or other error, 130 Ctrl-C,
    141 stdout closed by its reader; run as the program, 143 for a SIGTERM, which it takes as a Ctrl-C).

    Run as the program (``argv`` None: the ``prefixcache`` script, ``python -m prefixcache``), a Ctrl-C ends the
    process as soon as its report is written and the streams flushed (``os._exit(130)``): tearing down torch and a
    model's tensors otherwise takes another 1-5 s on a loaded 2-core machine.

    Run as the program, it first keeps the host allocator's freed blocks for reuse
    (:func:`~prefixcache.host_allocator.keep_freed_host_memory`; ``PREFIXCACHE_KEEP_FREED_MEMORY=0`` opts out):
    a CPU prefill then stops page-faulting on every layer's activations.
    """
    if argv is None:
        keep_freed_host_memory_unless_opted_out()
        _end_on_sigterm_as_on_ctrl_c()
    status = _main(argv)
    if status == 130 and argv is None:
        status = 143 if _TERMINATED else 130
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(status)
    return status


_TERMINATED: list[int] = []
"""The SIGTERMs the program received (:func:`_end_on_sigterm_as_on_ctrl_c`)."""


def _end_on_sigterm_as_on_ctrl_c() -> None:
    # Python's default SIGTERM ends the process at once: no partial report, and a piped input's temporary copy left
    # behind.  Raised as a KeyboardInterrupt instead, it ends the run as Ctrl-C does, with 143 (128 + SIGTERM).
    # `serve`'s uvicorn installs its own handlers while it runs; a handler set by whoever started us is kept.
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def terminated(signum: int, frame: object) -> None:
        _TERMINATED.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    args.verbose += args.verbose_after
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _COMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed by its reader (`| head`): end quietly, as a program killed by SIGPIPE would.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush fails silently
        return 141
    except VerificationError as error:
        print(f"VERIFICATION FAILED: {error}", file=sys.stderr)
        return 1
    except (PrefixCacheError, OSError, MemoryError) as error:
        print(f"error: {error or type(error).__name__}", file=sys.stderr)
        return 2
