"""``prefixcache replay``'s inputs: standard input and pipes read into files the readers can open twice, and paths
that do not exist refused before a model is built."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from prefixcache.errors import InvalidArgumentError

__all__ = ["check_inputs_exist", "piped", "piped_inputs_as_files"]


def check_inputs_exist(paths: list[str]) -> None:
    """Before a model is built: a path that does not exist is the error it would be after.

    Raises:
        ScenarioError: ``PATH: not found: no such file or folder``.
    """
    from prefixcache.errors import ScenarioError
    from prefixcache.replay.lines import NOT_FOUND

    for path in paths:
        if not Path(path).exists():
            raise ScenarioError(NOT_FOUND, str(path))


@contextlib.contextmanager
def piped_inputs_as_files(args: argparse.Namespace) -> Iterator[None]:
    """Within this block, each input that is ``-`` (standard input) or a pipe (``<(zcat log.jsonl.gz)``, a FIFO) is
    read to the end into a temporary file named for it (``stdin.jsonl``, ``pipe-63.jsonl``), which ``args.paths``
    names instead: the readers look at a file's first line before reading it, and a pipe can be read once.  A replay
    reports it under that name (``stdin``, ``pipe-63``), an error in it names the input as given (``-`` as standard
    input); the token store keys entries by content, so a sweep of the same bytes piped again reads its stored
    tokens.

    Raises:
        InvalidArgumentError: ``-`` named more than once (standard input can be read once).
    """
    piped_at = piped(args.paths)
    if not piped_at:
        yield
        return
    if args.paths.count("-") > 1:
        raise InvalidArgumentError("- (standard input) is named more than once; it can be read once")
    import shutil

    from prefixcache.errors import ScenarioError

    original, given = list(args.paths), {}
    args.piped_names = {}
    with tempfile.TemporaryDirectory(prefix="prefixcache-replay-") as folder:
        for i in piped_at:
            stdin = args.paths[i] == "-"
            if stdin and sys.stdin is None:
                raise InvalidArgumentError("- names standard input, which is closed")
            name = stem = "stdin" if stdin else f"pipe-{Path(args.paths[i]).name}"
            taken = set(args.piped_names.values()) | {Path(path).stem for path in original}
            for n in itertools.count(2):
                if name not in taken:
                    break
                name = f"{stem}-{n}"
            copy = Path(folder) / f"{name}.jsonl"
            with contextlib.nullcontext(sys.stdin.buffer) if stdin else open(args.paths[i], "rb") as source:
                with copy.open("wb") as target:
                    shutil.copyfileobj(source, target, 1 << 20)
            args.paths[i] = str(copy)
            args.piped_names[str(copy)] = name
            given[str(copy)] = "standard input" if stdin else original[i]
        try:
            yield
        except ScenarioError as error:
            if error.path not in given:
                raise
            where = f"{error.path}:{error.line_no}: " if error.line_no is not None else f"{error.path}: "
            raise ScenarioError(str(error).removeprefix(where), given[error.path], error.line_no) from None
        finally:
            args.paths = original


def piped(paths: list[str]) -> list[int]:
    """The indices of ``paths`` that are ``-`` or a FIFO (a character device, /dev/null or a terminal, stays "not a
    regular file or folder")."""
    found = []
    for index, path in enumerate(paths):
        try:
            if path == "-" or stat.S_ISFIFO(Path(path).stat().st_mode):
                found.append(index)
        except OSError:
            pass
    return found
