"""The per-request series a replay records, and the plot drawn from it."""

from __future__ import annotations

import re
import sys
from array import array

import pytest

from prefixcache.cli import main
from prefixcache.errors import install_command
from prefixcache.replay.plot import MissingDependencyError, plot_replay
from prefixcache.replay.replayer import Replayer, ReplayReport, ReplayRequest, ReplaySeries, replay_paths

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCENARIOS = ["scenarios/timestamp_system_prompt.jsonl", "scenarios/multi_turn_chat.jsonl"]


def _request(prompt: list[int], answer: list[int]) -> ReplayRequest:
    return ReplayRequest("s", "c", 1, array("I", prompt), array("I", answer))


def test_the_replay_records_one_sample_per_request_from_the_cache_stats() -> None:
    requests = [
        _request([1, 2, 3, 4, 5, 6], [7, 8]),  # cold; 8 tokens take 2 of the 4 blocks
        _request([1, 2, 3, 4, 5, 6, 7, 8, 9], [10]),  # 8 cached (a block boundary), one more block
        # 3 blocks, 1 free: evicts the leaf [8, 10) and then the tail block of [0, 8) (6 tokens, 2 blocks)
        _request([20, 21, 22, 23, 24, 25, 26, 27, 28], [29]),
    ]
    report = Replayer(None, block_size=4, cache_tokens=16).replay("s", requests)
    assert report.series == ReplaySeries(
        prompt_tokens=[6, 15, 24],
        cached_tokens=[0, 8, 8],
        ideal_cached_tokens=[0, 8, 8],
        used_blocks=[2, 3, 4],
        evictable_blocks=[2, 3, 4],
        free_blocks=[2, 1, 0],
        evictions=[0, 0, 2],
        evicted_tokens=[0, 0, 6],
    )
    assert "series" not in report.to_json()


def test_plot_replay_writes_a_png(tmp_path) -> None:
    report = replay_paths(SCENARIOS, Replayer(None, cache_tokens=12288))
    out = plot_replay(report, tmp_path / "replay.png")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC)
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1430, int((2.5 * 2 + 1.1) * 110))


def test_plot_of_a_report_without_series_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_replay(ReplayReport(), tmp_path / "empty.png")


def test_replay_plot_option_writes_the_file(tmp_path, capsys) -> None:
    out = tmp_path / "cli.png"
    assert main(["replay", SCENARIOS[0], "--no-model", "--no-progress", "--plot", str(out)]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert f"plot written to {out}" in capsys.readouterr().out


def test_without_matplotlib_plotting_fails_with_install_advice(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    report = replay_paths(SCENARIOS[:1], Replayer(None))
    with pytest.raises(MissingDependencyError, match=re.escape(install_command("plot"))):
        plot_replay(report, tmp_path / "x.png")
    assert main(["replay", SCENARIOS[0], "--no-model", "--no-progress", "--plot", str(tmp_path / "x.png")]) == 2
    assert install_command("plot") in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
