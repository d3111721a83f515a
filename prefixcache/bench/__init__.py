"""Benchmarks of the cache's own bookkeeping: ``prefixcache bench [NAME...] [--quick] [--json OUT]``.

``tree`` times each radix-tree operation on the standard workload, ``peers`` runs SGLang's radix cache and vLLM's
block pool beside ours in the same process (``pip install --no-deps sglang``; see :mod:`prefixcache.bench.peers`),
``evict`` checks that one eviction stays O(log n) as the tree grows, ``memory`` counts bytes per cached token.
``engine`` and ``agent`` (extra ``hf``) time the runner on a real model shape against transformers' own calls, ``route``
compares routers in front of N simulated replicas, ``snapshot`` how long a snapshot save makes a stream wait,
``llamacpp`` our server beside llama.cpp's on the same GGUF file (skipped without a ``llama-server``).
``serve`` (extra ``server``: :mod:`prefixcache.bench.serve`, imported only by the command line, so that this package
imports without FastAPI) times the HTTP server against in-process calls.
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable

import numpy as np

from prefixcache.bench import (
    agent,
    engine,
    evict,
    llamacpp,
    memory,
    peers,
    policy,
    route,
    runner,
    snapshot,
    trace,
    tree,
)
from prefixcache.bench.common import BenchResult, format_table
from prefixcache.errors import InvalidArgumentError

BENCHMARKS: dict[str, Callable[..., BenchResult]] = {
    "tree": tree.run,
    "peers": peers.run,
    "evict": evict.run,
    "memory": memory.run,
    "runner": runner.run,
    "policy": policy.run,
    "trace": trace.run,
    "engine": engine.run,
    "agent": agent.run,
    "route": route.run,
    "snapshot": snapshot.run,
    "llamacpp": llamacpp.run,
}
"""Name -> ``fn(quick: bool) -> BenchResult``; the command line runs them in this order."""


def run(
    names: list[str] | None = None,
    *,
    quick: bool = False,
    json_path: str | None = None,
    extra: dict[str, Callable[..., BenchResult]] | None = None,
) -> dict:
    """Run the named benchmarks (all when ``names`` is empty or None), print a table for each, and return the
    figures as a JSON-ready dict (also written to ``json_path`` when given).  ``extra`` adds benchmarks that need an
    extra this package does not import (the command line adds ``serve`` where the server extra is installed).

    When every benchmark runs (no ``names``), ``peers`` is skipped with a note if SGLang is not installed.

    Raises:
        InvalidArgumentError: an unknown benchmark name (nothing runs).
        PeerUnavailableError: ``peers`` was named and SGLang is not installed (the message says how to install it).
    """
    benchmarks = {**BENCHMARKS, **(extra or {})}
    selected = list(names) if names else list(benchmarks)
    unknown = [name for name in selected if name not in benchmarks]
    if unknown:
        raise InvalidArgumentError(f"unknown benchmark(s) {unknown}; choose from {list(benchmarks)}")
    report: dict = {
        "quick": quick,
        "environment": {
            "python": sys.version.split()[0],
            "implementation": platform.python_implementation(),
            "numpy": np.__version__,
            "machine": platform.machine(),
            "platform": platform.platform(),
        },
        "benchmarks": {},
    }
    for name in selected:
        try:
            result = benchmarks[name](quick=quick)
        except peers.PeerUnavailableError as error:
            if names:
                raise
            print(f"{name}: skipped: {error}", end="\n\n", flush=True)
            continue
        for table in result.tables:
            print(format_table(table), end="\n\n", flush=True)
        report["benchmarks"][name] = result.data
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return report
