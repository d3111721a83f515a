"""``prefixcache replay FILE --sweep``: the flags, the checks and the run (the command line adds the flags and calls
:func:`run_sweep`).  The sweep never runs a model; ``--model-config`` only gives the KV shape for bytes."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefixcache.cache.pool import check_block_size
from prefixcache.chat.tokenizer import ByteTokenizer, Tokenizer
from prefixcache.errors import InvalidArgumentError
from prefixcache.replay.plot import check_plot_path
from prefixcache.replay.requests import Progress, read_options
from prefixcache.replay.scenarios import expand_paths
from prefixcache.replay.sweep import sweep_lru
from prefixcache.replay.sweep_report import (
    format_sweep,
    kv_bytes_per_token_from_config,
    plot_sweep,
    summarize,
    sweep_json,
)
from prefixcache.replay.token_store import load_requests_cached

__all__ = ["check_sweep_options", "or_sweep", "run_sweep"]

_REFUSED = {
    "cache_tokens": "--cache-tokens",
    "cache_memory": "--cache-memory",
    "host_cache_tokens": "--host-cache-tokens",
    "host_cache_memory": "--host-cache-memory",
    "state_bytes": "--state-bytes",
    "requests_jsonl": "--requests-jsonl",
}


def or_sweep(
    run_replay: Callable[[argparse.Namespace], int],
    load_tokenizer: Callable[[argparse.Namespace, Any], Tokenizer | None],
    make_progress: Callable[[bool], Any],
) -> Callable[[argparse.Namespace], int]:
    """The ``replay`` command's handler: :func:`run_sweep` with ``--sweep`` (tokenizer and progress from the command
    line's own ``load_tokenizer(args, progress)`` and ``make_progress(enabled)``), else ``run_replay``."""

    def handle(args: argparse.Namespace) -> int:
        if not args.sweep:
            return run_replay(args)
        check_sweep_options(args)
        progress = make_progress(not args.no_progress)
        return run_sweep(args, load_tokenizer(args, progress), progress)

    return handle


def check_sweep_options(args: argparse.Namespace) -> None:
    """Refuse options a sweep does not take, before any work.

    Raises:
        InvalidArgumentError: a fixed pool size, a host tier, recurrent states, a per-request log, --verify,
            --explain or --policy lfu with --sweep; --kv-dtype other than the default, or --layers, without
            --model-config; a --json or --plot path that cannot be written (or is an input).
        MissingDependencyError: --plot without matplotlib.
    """
    for dest, flag in _REFUSED.items():
        if getattr(args, dest, None) is not None:
            raise InvalidArgumentError(f"--sweep computes every cache size; drop {flag}")
    for dest, flag in (("verify", "--verify"), ("explain", "--explain")):
        if getattr(args, dest, False):
            raise InvalidArgumentError(f"--sweep runs no model and explains nothing; drop {flag}")
    if getattr(args, "policy", "lru") != "lru":
        raise InvalidArgumentError("--sweep models LRU (a stack algorithm); LFU has no one-pass curve")
    if args.kv_dtype != "bf16" and not args.model_config:
        raise InvalidArgumentError("--kv-dtype needs --model-config (the KV shape)")
    if args.layers is not None and not args.model_config:
        raise InvalidArgumentError("--layers needs --model-config")
    inputs = {Path(p).resolve() for p in args.paths}
    for flag, value in (("--json", args.json), ("--plot", args.plot)):
        if value is None:
            continue
        target = Path(value)
        if not value.strip() or target.is_dir() or not target.resolve().parent.is_dir():
            raise InvalidArgumentError(f"{flag} {value!r}: give a file name in a folder that exists")
        if target.resolve() in inputs:
            raise InvalidArgumentError(f"{flag} {value}: the same file as an input")
    if args.json and args.plot and Path(args.json).resolve() == Path(args.plot).resolve():
        raise InvalidArgumentError("--json and --plot name the same file")
    if args.plot:
        check_plot_path(args.plot)


def run_sweep(args: argparse.Namespace, tokenizer: Tokenizer | None, progress: Progress | None = None) -> int:
    """Sweep every file of ``args.paths`` (see :mod:`prefixcache.replay.sweep_report`) with ``tokenizer`` (None:
    the byte tokenizer); print the tables, write ``--json`` and ``--plot``.  Returns the exit status (0).

    Raises:
        InvalidArgumentError: as :func:`check_sweep_options`, or an unreadable ``--model-config``.
        ScenarioError: a bad input line (unless ``--skip-invalid``).
    """
    check_sweep_options(args)
    check_block_size(args.block_size)
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    per_token = None
    if args.model_config:
        per_token = kv_bytes_per_token_from_config(args.model_config, args.kv_dtype, args.layers)
    summaries, results = [], []
    for path in expand_paths(args.paths):
        use_cache = not args.no_token_cache
        requests, _, stored = load_requests_cached(path, tokenizer, use_cache=use_cache, **read_options(args, progress))
        if stored and not args.no_progress:
            print(f"{path}: tokens read from the token store (--no-token-cache to tokenize again)", file=sys.stderr)
        start = time.perf_counter()
        pairs = [(r.prompt, r.answer) for r in requests]
        result = sweep_lru(pairs, args.block_size)
        exact = None
        if args.check_knee:
            exact = _exact_replay(str(path), requests, args.block_size)
        summary = summarize(
            str(path),
            result,
            None if args.no_belady else pairs,
            bytes_per_token=per_token,
            exact=exact,
            at_tokens=args.sweep_at or (),
        )
        summary.sweep_s = time.perf_counter() - start
        summaries.append(summary)
        results.append(result)
    print(f"tokenizer: {tokenizer.name}; LRU by stack distances (Mattson et al. 1970), no model")
    print(format_sweep(summaries))
    if args.json:
        _write_atomic(args.json, json.dumps(sweep_json(summaries), indent=2).encode())
    if args.plot:
        with tempfile.TemporaryDirectory(dir=Path(args.plot).resolve().parent) as folder:
            temp = Path(folder) / f"plot{Path(args.plot).suffix}"
            plot_sweep(summaries, results, temp)
            os.replace(temp, args.plot)
    return 0


def _exact_replay(name: str, requests, block_size: int):
    from prefixcache.replay.replayer import Replayer  # torch: only when asked for

    def exact(capacity_tokens: int) -> float:
        return Replayer(None, block_size=block_size, cache_tokens=capacity_tokens).replay(name, requests).hit_rate

    return exact


def _write_atomic(path: str, data: bytes) -> None:
    target = Path(path)
    fd, temp = tempfile.mkstemp(dir=target.resolve().parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
