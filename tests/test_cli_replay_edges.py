"""``prefixcache replay`` at the edges of its input and output: text a Hugging Face tokenizer cannot encode, a
tokenizer folder with broken files, a file named twice, a plot of no requests, and Ctrl-C while the reports are
being written.  Each ends in one line and the documented exit status, never a traceback or a half-written file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.errors import ScenarioError
from prefixcache.replay.scenarios import expand_paths

CONVERSATION = {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def replay(*args: object) -> int:
    return main(["replay", *map(str, args), "--no-model", "--no-progress"])


def write_jsonl(path: Path, *objects: object) -> Path:
    path.write_text("".join(json.dumps(obj) + "\n" for obj in objects), encoding="utf-8")
    return path


def test_a_lone_surrogate_with_a_hf_tokenizer_names_file_line_and_conversation(
    tmp_path: Path, qwen_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = {"id": "lone", "messages": [{"role": "user", "content": "x\ud800y"}, {"role": "assistant", "content": "z"}]}
    scenario = write_jsonl(tmp_path / "s.jsonl", CONVERSATION, bad)

    assert replay(scenario, "--tokenizer", qwen_dir) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{scenario}:2: conversation 'lone'" in err and "surrogate" in err


def test_skip_invalid_skips_a_conversation_the_template_cannot_render(
    tmp_path: Path, qwen_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = {"id": "lone", "messages": [{"role": "user", "content": "\udfff"}, {"role": "assistant", "content": "z"}]}
    scenario = write_jsonl(tmp_path / "s.jsonl", CONVERSATION, bad)
    out = tmp_path / "r.json"

    assert replay(scenario, "--tokenizer", qwen_dir, "--skip-invalid", "--json", out) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 1 and report["skipped_lines"] == 1
    assert f"skipped {scenario}:2: conversation 'lone'" in caplog.text


def test_a_tokenizer_folder_with_broken_merges_is_one_line(
    tmp_path: Path, qwen_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(qwen_dir / "vocab.json", folder / "vocab.json")
    (folder / "merges.txt").write_text("#version: 0.2\na b c\n")
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2Tokenizer"}')
    scenario = write_jsonl(tmp_path / "s.jsonl", CONVERSATION)

    assert replay(scenario, "--tokenizer", folder) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"cannot load a tokenizer from {str(folder)!r}" in err


def test_a_file_named_twice_replays_once_and_the_json_totals_match_its_scenarios(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    scenario = write_jsonl(tmp_path / "s.jsonl", CONVERSATION, {**CONVERSATION, "id": "b"})
    out = tmp_path / "r.json"

    assert replay(scenario, tmp_path, tmp_path / "." / "s.jsonl", "--json", out) == 0
    report = json.loads(out.read_text())
    assert list(report["scenarios"]) == [str(scenario)]
    assert report["requests"] == report["scenarios"][str(scenario)]["requests"] == 2
    assert f"{scenario}: named more than once (again as {scenario}); replayed once" in caplog.text


def test_expand_paths_keeps_the_first_naming_of_each_file(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", CONVERSATION)
    b = write_jsonl(tmp_path / "b.jsonl", CONVERSATION)

    assert expand_paths([b, tmp_path, a]) == [b, a]
    with pytest.raises(ScenarioError, match="no such scenario file"):
        expand_paths([a, tmp_path / "missing.jsonl"])
