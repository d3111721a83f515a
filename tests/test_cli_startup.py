"""The command line starts without torch where it needs none: ``--help``, ``--version`` and ``plan`` import no torch
(a fresh interpreter each, as a user runs them), and the figures it writes down to stay so match the layers'."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from prefixcache.bench import BENCHMARKS
from prefixcache.cache.pool import kv_bytes_per_token
from prefixcache.cache.resume import DEFAULT_STATE_INTERVAL_BLOCKS
from prefixcache.cli import bench, plan, replay, serve

PROBE = """
import sys
from prefixcache.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit_:
    status = exit_.code
print("TORCH" if "torch" in sys.modules else "NO-TORCH", status, file=sys.stderr)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["serve", "--help"],
        ["replay", "--help"],
        ["bench", "--help"],
        ["plan", "--layers", "24", "--kv-heads", "2", "--head-dim", "64", "--memory", "1GiB"],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_help_version_and_plan_do_not_import_torch(argv) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "NO-TORCH 0", done.stderr
    assert done.stdout  # the help, the version or the plan was printed


def test_the_facade_imports_torch_only_when_a_name_that_needs_it_is_used() -> None:
    probe = (
        "import sys, prefixcache; before = 'torch' in sys.modules; prefixcache.PrefixCachingRunner; "
        "print(before, 'torch' in sys.modules, prefixcache.CapacityError.__module__)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["False", "True", "prefixcache.errors"]


def test_python_m_prefixcache_plan_prints_the_same_figures_as_the_pool() -> None:
    command = [sys.executable, "-m", "prefixcache", "plan", "--layers", "24", "--kv-heads", "2", "--head-dim", "64"]
    done = subprocess.run([*command, "--memory", "1GiB"], capture_output=True, text=True, timeout=120, check=True)
    per_token = kv_bytes_per_token(24, 2, 64, torch.bfloat16)
    assert done.stdout.splitlines()[:2] == [
        f"bytes per token: {per_token:,} (2 x 24 layers x 2 KV heads x 64 head_dim x 2 bytes)",
        f"tokens that fit: {(1 << 30) // per_token:,}",
    ]


def test_plan_element_sizes_are_torchs() -> None:
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    dtypes |= {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    assert set(plan.ELEMENT_BYTES) == set(dtypes)
    for name, dtype in dtypes.items():
        assert plan.ELEMENT_BYTES[name] * 2 * 3 * 5 * 7 == kv_bytes_per_token(3, 5, 7, dtype), name


def test_the_defaults_written_down_for_help_are_the_layers_own() -> None:
    pytest.importorskip("fastapi", reason="needs: pip install 'prefixcache[server]'")
    from prefixcache.serve.jobs import DEFAULT_MAX_REQUEST_BYTES

    assert replay.DEFAULT_STATE_EVERY == DEFAULT_STATE_INTERVAL_BLOCKS
    assert serve.DEFAULT_MAX_REQUEST_BYTES == DEFAULT_MAX_REQUEST_BYTES
    assert bench.BENCHMARK_NAMES == tuple(BENCHMARKS)
