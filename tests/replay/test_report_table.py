"""The replay table (issue 29): a compact default within 120 columns, ``--wide`` for every column, and
``--no-baseline`` to skip timing the uncached prefill."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.replay.replayer import Replayer, replay_paths
from prefixcache.replay.report import COMPACT_WIDTH, compact_table, format_replay

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "scenarios" / "multi_turn_chat.jsonl"
STAMP = ROOT / "scenarios" / "timestamp_system_prompt.jsonl"
WIDE_ONLY = ("ideal cached", "peak blocks", "prefilled", "copied", "drift", "prefill s (none)")


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_the_default_table_of_a_verified_model_replay_fits_120_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(CHAT), str(STAMP), "--limit", "2", "--verify", "--no-progress"]) == 0
    lines = table_lines(capsys.readouterr().out)

    assert max(len(line) for line in lines) <= COMPACT_WIDTH
    headers = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert headers == [
        "scenario",
        "requests",
        "prompt tok",
        "cached tok",
        "hit rate",
        "ideal",
        "prefill s",
        "speed-up",
        "verified",
    ]
    assert lines[2].startswith("| multi_turn_chat         |        9 |     10,952 |     10,003 |    91.3% | 91.3% |")
    assert lines[4].startswith("| total                   |       12 |     22,719 |     14,176 |    62.4% | 62.4% |")
    assert lines[2].endswith("|      yes |")


def test_wide_gives_every_column_under_the_paths_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(CHAT), "--limit", "2", "--no-progress", "--wide"]) == 0
    out = capsys.readouterr().out

    assert all(header in out for header in WIDE_ONLY)
    assert f"| {CHAT} " in out


def test_no_baseline_times_only_the_cached_prefill(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    assert main(["replay", str(CHAT), "--limit", "1", "--no-progress", "--no-baseline", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    lines = table_lines(capsys.readouterr().out)

    assert report["prefill_s_uncached"] is None and report["speedup"] is None
    assert report["prefill_s_cached"] > 0
    assert "speed-up" not in lines[0] and "prefill s" in lines[0]


def test_long_file_names_are_elided_in_the_middle_to_fit(tmp_path: Path) -> None:
    long_name = tmp_path / ("a_very_long_scenario_file_name_that_goes_on_" * 2 + "end.jsonl")
    shutil.copy(CHAT, long_name)
    report = replay_paths([long_name, STAMP], Replayer(None, cache_tokens=5000), limit=2)
    report.model = "tiny"  # the model's columns too, as wide as a model replay's
    report.scenarios[0].prefill_s_cached = report.scenarios[1].prefill_s_cached = 12.5
    lines = table_lines(compact_table(report))

    assert max(len(line) for line in lines) == COMPACT_WIDTH
    assert lines[2].startswith("| a_very_long_scena…e_that_goes_on_end |        9 |")
    assert "| total " in lines[4] and "evictions" in lines[0]


def test_files_of_one_name_in_two_folders_are_told_apart_by_their_folders(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in "ab":
        shutil.copy(CHAT, tmp_path / folder / "chat.jsonl")
    report = replay_paths([tmp_path / "a" / "chat.jsonl", tmp_path / "b" / "chat.jsonl"], Replayer(None), limit=1)
    table = format_replay(report)

    names = [line.split("|")[1].strip() for line in table_lines(table)[2:]]
    assert names == ["a/chat", "b/chat", "total"]
