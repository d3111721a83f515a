"""The peers benchmark: its workloads, its drivers of SGLang's and vLLM's caches, and its failure without them.

Tests that drive a peer skip when its package is not installed (``pip install --no-deps sglang==...``).  No timings
are asserted; the drivers' answers are.
"""

from __future__ import annotations

import pytest

from prefixcache.bench import peers
from prefixcache.bench.common import standard_workload
from prefixcache.bench.peer_caches import OursDriver, SGLangDriver, VllmDriver
from prefixcache.bench.peer_imports import PeerUnavailableError, load_sglang, load_vllm
from prefixcache.cli import main


def _peer(loader):
    try:
        return loader()
    except PeerUnavailableError as error:
        pytest.skip(f"peer not importable: {error}")


def test_agent_turns_extend_the_previous_prompt_and_answer_round_robin() -> None:
    work = peers.agent_workload(num_conversations=3, num_turns=4, system_tokens=50)

    assert len(work.requests) == 12
    system = work.requests[0][0][:50]
    for i, (prompt, answer) in enumerate(work.requests):
        assert prompt[:50] == system
        assert 20 <= len(answer) < 240
        if i >= 3:
            earlier_prompt, earlier_answer = work.requests[i - 3]
            assert prompt[: len(earlier_prompt) + len(earlier_answer)] == earlier_prompt + earlier_answer
            assert len(prompt) > len(earlier_prompt) + len(earlier_answer)


def test_sglang_hits_what_we_hit_and_splits_nodes_where_we_do_not() -> None:
    sglang = _peer(load_sglang)
    work = standard_workload(num_seqs=20, seq_len=64, prefix_len=40)
    capacity = 20 * 64

    ours = peers.tree_pass(OursDriver(1, capacity), work.token_lists)
    theirs = peers.tree_pass(SGLangDriver(sglang, capacity), work.token_lists)

    assert theirs["cycle_hits"] == ours["cycle_hits"] == [0] + [40] * 19
    assert theirs["match_hits"] == ours["match_hits"] == [64] * 20
    assert theirs["prefill_hits"] == ours["prefill_hits"] == [63] * 20
    assert ours["nodes_before"] == ours["nodes_after"] == 1 + 20
    assert theirs["nodes_before"] == 21
    assert theirs["nodes_after"] == 41, "SGLang splits each leaf at len-1 on lookup"
    assert theirs["evicted_tokens"] == 40 + 20 * 24


def test_sglang_agent_cycle_frees_every_duplicate_slot() -> None:
    sglang = _peer(load_sglang)
    work = peers.agent_workload(num_conversations=2, num_turns=3, system_tokens=30)
    capacity = sum(len(p) + len(a) for p, a in work.requests)
    driver = SGLangDriver(sglang, capacity)

    result = peers.agent_pass(driver, work)

    assert result["hits"] == peers.agent_pass(OursDriver(1, capacity), work)["hits"]
    assert result["hits"][:2] == [0, 30], "the second conversation finds the whole system prompt"
    cached = driver.cache.evictable_size()
    free = len(driver.allocator.free_slots) + sum(len(t) for t in driver.allocator.released)
    assert cached + free == capacity, "every slot is either in the tree or free again"


def test_vllm_hits_our_block_size_16_hit_in_whole_blocks() -> None:
    vllm = _peer(load_vllm)
    work = peers.agent_workload(num_conversations=2, num_turns=3, system_tokens=100)
    capacity = sum(len(p) + len(a) for p, a in work.requests) * 2

    ours = peers.agent_pass(OursDriver(16, capacity), work)["hits"]
    theirs = peers.agent_pass(VllmDriver(vllm, 16, capacity), work)["hits"]

    assert theirs == [h // 16 * 16 for h in ours]
    assert theirs[1] == 96


def test_bench_peers_without_sglang_says_how_to_install_and_fails(monkeypatch, capsys) -> None:
    def missing():
        raise PeerUnavailableError("sglang is not installed; pip install --no-deps sglang==0.5.23")

    monkeypatch.setattr(peers, "load_sglang", missing)

    assert main(["bench", "peers", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "sglang is not installed" in err and "pip install --no-deps sglang" in err
    assert "Traceback" not in err


def test_stubs_for_third_party_modules_do_not_outlive_the_import() -> None:
    import sys

    _peer(load_sglang)

    stubbed = [name for name in ("zmq", "psutil") if name in sys.modules]
    assert all(not type(sys.modules[name]).__name__.startswith("_Stub") for name in stubbed)


def test_running_every_benchmark_skips_peers_with_a_note_when_sglang_is_missing(monkeypatch, capsys) -> None:
    from prefixcache import bench

    def missing(quick: bool = False):
        raise PeerUnavailableError("sglang is not installed; pip install --no-deps sglang==0.5.23")

    monkeypatch.setattr(bench, "BENCHMARKS", {"peers": missing})

    report = bench.run(None, quick=True)

    assert report["benchmarks"] == {}
    assert "peers: skipped: sglang is not installed" in capsys.readouterr().out
