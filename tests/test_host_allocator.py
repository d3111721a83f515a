"""keep_freed_host_memory: argument checks, and, in a fresh process, that a freed large block comes back without
page faults once it ran (and faults without it, so the test sees the difference it claims)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from prefixcache.errors import InvalidArgumentError
from prefixcache.host_allocator import OPT_OUT_VARIABLE, keep_freed_host_memory

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# Allocates, fills and frees a 64 MiB tensor twice; prints the minor faults of the second round.
_PROBE = """
import json, resource, sys
import torch
if sys.argv[1] == "library":
    from prefixcache.host_allocator import keep_freed_host_memory
    applied = keep_freed_host_memory()
elif sys.argv[1] == "program":
    from prefixcache.host_allocator import keep_freed_host_memory_unless_opted_out
    applied = keep_freed_host_memory_unless_opted_out()
else:
    applied = None
def round_():
    t = torch.empty(16 << 20, dtype=torch.float32)
    t.fill_(1.0)
    total = float(t[::4096].sum())
    del t
    return total
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""

PAGES = (64 << 20) // 4096


def _probe(mode: str, **env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mmap_threshold_bytes": 0},
        {"mmap_threshold_bytes": -1},
        {"mmap_threshold_bytes": 1 << 31},
        {"trim_threshold_bytes": 4096},
        {"trim_threshold_bytes": 2.5e8},
        {"mmap_threshold_bytes": True},
    ],
)
def test_bad_thresholds_raise_before_changing_anything(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError, match="must be an int"):
        keep_freed_host_memory(**kwargs)


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's; elsewhere the call is a no-op")
def test_a_freed_large_block_is_reused_without_page_faults() -> None:
    plain = _probe("none")
    kept = _probe("library")
    assert plain["applied"] is None and kept["applied"] is True
    # Without it the 64 MiB block is a fresh mapping each round: about one fault per page (fewer with huge pages).
    assert plain["faults"] > PAGES // 8, plain
    assert kept["faults"] < PAGES // 50, kept


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's; elsewhere the call is a no-op")
def test_the_program_path_honours_the_opt_out() -> None:
    opted_out = _probe("program", **{OPT_OUT_VARIABLE: "0"})
    assert opted_out["applied"] is False
    assert opted_out["faults"] > PAGES // 8, opted_out
    assert _probe("program", **{OPT_OUT_VARIABLE: "1"})["applied"] is True


@pytest.mark.skipif(GLIBC, reason="checks the no-op path of a C library other than glibc")
def test_other_c_libraries_are_left_alone() -> None:
    assert keep_freed_host_memory() is False
