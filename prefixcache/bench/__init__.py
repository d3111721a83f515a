"""Benchmarks of the cache's own bookkeeping: ``prefixcache bench [NAME...] [--quick] [--json OUT]``.

``tree`` times each radix-tree operation on the standard workload against SGLang's figures, ``evict`` checks
that one eviction stays O(log n) as the tree grows, ``memory`` counts bytes per cached token, ``route`` compares
routers in front of N simulated replicas.
"""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Callable

import numpy as np

from prefixcache.bench import evict, memory, policy, route, runner, trace, tree
from prefixcache.bench.common import BenchResult, format_table
from prefixcache.errors import InvalidArgumentError

BENCHMARKS: dict[str, Callable[..., BenchResult]] = {
    "tree": tree.run,
    "evict": evict.run,
    "memory": memory.run,
    "runner": runner.run,
    "policy": policy.run,
    "trace": trace.run,
    "route": route.run,
}
"""Name -> ``fn(quick: bool) -> BenchResult``; the command line runs them in this order."""


def run(names: list[str] | None = None, *, quick: bool = False, json_path: str | None = None) -> dict:
    """Run the named benchmarks (all when ``names`` is empty or None), print a table for each, and return the
    figures as a JSON-ready dict (also written to ``json_path`` when given).

    Raises:
        InvalidArgumentError: an unknown benchmark name (nothing runs).
    """
    selected = list(names) if names else list(BENCHMARKS)
    unknown = [name for name in selected if name not in BENCHMARKS]
    if unknown:
        raise InvalidArgumentError(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
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
        result = BENCHMARKS[name](quick=quick)
        for table in result.tables:
            print(format_table(table), end="\n\n", flush=True)
        report["benchmarks"][name] = result.data
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return report
