"""Benchmark claims that mean something: no goal verdicts on quick runs, memory measured rather than computed, and
the policy table's unlimited-cache row simulated for every policy."""

from __future__ import annotations

import sys

import pytest
import torch

from prefixcache.bench import memory, policy
from prefixcache.bench.common import QUICK_NOT_JUDGED, verdict
from prefixcache.cache.pool import zeroed


def test_a_quick_run_leaves_every_goal_cell_empty() -> None:
    assert [verdict(True, quick=True), verdict(False, quick=True)] == ["", ""]
    assert [verdict(True, quick=False), verdict(False, quick=False)] == ["met", "not met"]


def test_quick_memory_run_prints_no_verdict_and_says_why() -> None:
    result = memory.run(quick=True)

    tree_table = result.tables[0]
    goal = next(i for i, h in enumerate(tree_table.headers) if h.startswith("goal"))
    assert [row[goal] for row in tree_table.rows] == ["", ""]
    assert QUICK_NOT_JUDGED in tree_table.notes


@pytest.mark.skipif(memory.resident_bytes() is None, reason="needs /proc/self/statm (Linux)")
def test_resident_memory_grows_by_what_a_filled_tensor_holds() -> None:
    # Fresh pages (a private anonymous mapping, as the pool's): a torch.ones of 64 MiB may reuse heap memory that
    # earlier tests in this process freed, which is already resident.
    before = memory.resident_bytes()
    tensor = zeroed((64 * 2**20 // 4,), torch.float32, torch.device("cpu")).fill_(1.0)
    grown = memory.resident_bytes() - before

    assert 0.95 * tensor.nbytes <= grown <= 1.05 * tensor.nbytes


@pytest.mark.skipif(memory.resident_bytes() is None, reason="needs /proc/self/statm (Linux)")
def test_pool_bytes_are_measured_not_taken_from_the_formula(monkeypatch) -> None:
    real = memory.pool_bytes("Qwen2.5-0.5B", 24, 2, 64, torch.bfloat16)
    assert real["rss_bytes_per_token"] == pytest.approx(12288, rel=memory.RSS_TOLERANCE)
    assert real["rss_at_creation_bytes_per_token"] < 0.1 * 12288  # pages are committed as blocks are written

    # A wrong formula changes the formula column and the pool's size, not what the measurement finds per token.
    monkeypatch.setattr(memory, "kv_bytes_per_token", lambda *args: 2 * 12288)
    doubled = memory.pool_bytes("Qwen2.5-0.5B", 24, 2, 64, torch.bfloat16)
    assert doubled["formula_bytes_per_token"] == 2 * 12288
    assert doubled["rss_bytes_per_token"] == pytest.approx(12288, rel=memory.RSS_TOLERANCE)


def test_unlimited_cache_row_is_simulated_for_every_policy(monkeypatch) -> None:
    path = policy.DATA_DIR / "oasst_en100_tree_paths.jsonl"
    if not path.is_file():
        pytest.skip(f"shared transcripts not found at {policy.DATA_DIR} (../shared/data beside the project)")
    radix_calls, sim_calls = [], []
    real_replay, real_simulate = policy.replay_radix, policy.simulate

    def replay(requests, num_blocks, name, block_size, *granularity):
        radix_calls.append((name, num_blocks))
        return real_replay(requests, num_blocks, name, block_size, *granularity)

    def simulate(trace, capacity, name):
        sim_calls.append((name, capacity))
        return real_simulate(trace, capacity, name)

    monkeypatch.setattr(policy, "replay_radix", replay)
    monkeypatch.setattr(policy, "simulate", simulate)

    result = policy.measure_file(path, limit=5)

    unbounded = radix_calls[0][1]
    assert ("lfu", unbounded) in radix_calls
    largest = max(capacity for _, capacity in sim_calls)
    assert {name for name, capacity in sim_calls if capacity == largest} == {"lru", "belady"}
    assert result["infinite_radix_lfu"] == pytest.approx(result["infinite_radix"])
    assert result["infinite_sim_belady"] == pytest.approx(result["infinite_sim"])
    assert "infinite_radix_lfu" in result and sys.modules["prefixcache.bench.policy"] is policy
