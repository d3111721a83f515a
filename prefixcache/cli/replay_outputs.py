"""``prefixcache replay``'s outputs: every output file checked before any work, then the report printed and written
(``--json``, ``--requests-jsonl``, ``--plot``), each file whole or not at all."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from prefixcache.errors import InvalidArgumentError

__all__ = ["check_outputs", "write_replay"]


def _real_path(path: str | Path) -> Path:
    # os.path.realpath never raises; Path.resolve raises on a symlink loop, which is the inputs' check to report.
    return Path(os.path.realpath(path))


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, an output that cannot be written: a missing folder, a folder given as the file,
    a plot format matplotlib does not know, two outputs (or an output and an input) on one path."""
    outputs = {"--json": args.json, "--requests-jsonl": args.requests_jsonl, "--plot": args.plot}
    real = _real_path
    seen: dict[Path, str] = {real(p): "an input" for p in args.paths}
    for folder in (Path(p) for p in args.paths if Path(p).is_dir()):
        seen.update((real(p), "an input") for p in folder.glob("*.jsonl"))  # replayed as inputs too
    for option, value in outputs.items():
        if value is None:
            continue
        if not value.strip():
            raise InvalidArgumentError(f"{option}: empty file name")
        path = Path(value)
        folder = path.parent
        if path.is_dir():
            raise InvalidArgumentError(f"{option} {value}: is a folder; give a file name")
        if not folder.is_dir():
            raise InvalidArgumentError(f"{option} {value}: folder {str(folder)!r} does not exist")
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise InvalidArgumentError(f"{option} {value}: not writable")
        if real(path) in seen:
            raise InvalidArgumentError(f"{option} {value}: the same file as {seen[real(path)]}")
        seen[real(path)] = option
    if args.plot:
        from prefixcache.replay.plot import check_plot_path

        check_plot_path(args.plot)


def write_replay(args: argparse.Namespace, report, tokenizer_name: str) -> None:
    """Write ``--json`` and ``--requests-jsonl`` first, then print the table, the speculation and drift lines, the
    ``--explain`` breakdown, and draw ``--plot`` last."""
    from prefixcache.replay.report import (
        drift_json,
        format_drift,
        format_drift_requests,
        format_replay,
        format_speculation,
    )

    # The files first: a stdout closed early (`| head`) must not cost them.
    if args.json:
        out_json = report.to_json()
        for scenario in report.scenarios:
            out_json["scenarios"][scenario.scenario]["drift"] = drift_json(scenario)
        with _replacing(args.json) as out:
            json.dump(out_json, out, indent=2)
    if args.requests_jsonl:
        with _replacing(args.requests_jsonl) as out:
            for record in report.requests_log:
                out.write(json.dumps(record) + "\n")
    print(f"tokenizer: {tokenizer_name}")
    print(format_replay(report, wide=args.wide))
    speculation = format_speculation(report)
    if speculation:
        print(speculation)
    for scenario in report.scenarios:
        line = format_drift(scenario)
        if line:
            print(line)
    if args.explain:
        from prefixcache.replay.explain import format_divergences

        for scenario in report.scenarios:
            print()
            print(format_divergences(scenario.scenario, scenario.explain_kinds or {}, scenario.divergences))
            if scenario.drifts:
                print(format_drift_requests(scenario))
    if args.plot and report.scenarios:  # last: a plot that cannot be drawn (no requests) costs no other report
        from prefixcache.replay.plot import plot_replay

        with _replacing(args.plot, binary=True) as out:
            plot_replay(report, out, image_format=Path(args.plot).suffix.lstrip(".").lower())
        print(f"plot written to {args.plot}")


@contextlib.contextmanager
def _replacing(name: str, *, binary: bool = False) -> Iterator[IO[Any]]:
    """A text file opened for writing that appears at ``name`` whole or not at all: written beside it under a
    temporary name and renamed over it on success, removed on any error or Ctrl-C, so an old report survives.
    A name that is not a regular file (``/dev/stdout``, a pipe) is written directly."""
    path = Path(name)
    if path.exists() and not path.is_file():
        with open(path, "wb") if binary else open(path, "w", encoding="utf-8") as out:
            yield out
        return
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") if binary else os.fdopen(handle, "w", encoding="utf-8") as out:
            yield out
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~umask)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
