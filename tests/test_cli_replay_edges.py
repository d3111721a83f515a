"""``prefixcache replay`` at the edges of its input and output: text a Hugging Face tokenizer cannot encode, a
tokenizer folder with broken files, a file named twice, a plot of no requests, and Ctrl-C while the reports are
being written.  Each ends in one line and the documented exit status, never a traceback or a half-written file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.errors import ScenarioError
from prefixcache.replay.scenarios import expand_paths

ROOT = Path(__file__).resolve().parents[1]
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
    with pytest.raises(ScenarioError, match="missing.jsonl: not found: no such file or folder"):
        expand_paths([a, tmp_path / "missing.jsonl"])


def test_a_plot_of_no_requests_fails_after_writing_the_other_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    scenario = write_jsonl(tmp_path / "s.jsonl", {"id": "u", "messages": [{"role": "user", "content": "hi"}]})
    out, log, plot = tmp_path / "r.json", tmp_path / "r.jsonl", tmp_path / "p.png"

    assert replay(scenario, "--json", out, "--requests-jsonl", log, "--plot", plot) == 2
    assert json.loads(out.read_text())["requests"] == 0 and log.read_text() == ""
    assert not plot.exists()
    err = capsys.readouterr().err
    assert "nothing to plot" in err and "Traceback" not in err


def test_ctrl_c_while_the_json_is_written_leaves_the_old_file_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = write_jsonl(tmp_path / "s.jsonl", CONVERSATION)
    out = tmp_path / "r.json"
    out.write_text('{"old": true}')
    real_dump = json.dump

    def dump_then_interrupt(obj, handle, **kwargs) -> None:
        handle.write(json.dumps(obj)[:20])
        handle.flush()
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", dump_then_interrupt)
    assert replay(scenario, "--json", out) == 130
    monkeypatch.setattr(json, "dump", real_dump)

    assert json.loads(out.read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "s.jsonl"]
    assert "interrupted" in capsys.readouterr().err


def test_ctrl_c_while_the_requests_log_is_written_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scenario = write_jsonl(tmp_path / "s.jsonl", CONVERSATION, {**CONVERSATION, "id": "b"})
    log = tmp_path / "r.jsonl"
    calls = []
    real_dumps = json.dumps

    def dumps_then_interrupt(obj, **kwargs) -> str:
        calls.append(obj)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_dumps(obj, **kwargs)

    monkeypatch.setattr(json, "dumps", dumps_then_interrupt)
    assert replay(scenario, "--requests-jsonl", log) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]


def test_reports_are_written_with_the_usual_permissions_and_to_devices(tmp_path: Path) -> None:
    scenario = write_jsonl(tmp_path / "s.jsonl", CONVERSATION)
    out = tmp_path / "r.json"

    assert replay(scenario, "--json", out, "--requests-jsonl", "/dev/null") == 0
    probe = tmp_path / "probe"
    probe.touch()
    assert out.stat().st_mode & 0o777 == probe.stat().st_mode & 0o777
    assert json.loads(out.read_text())["requests"] == 1


@pytest.mark.parametrize("option", ["--json", "--requests-jsonl", "--plot"])
def test_an_empty_output_name_is_refused_as_empty(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = write_jsonl(tmp_path / "s.jsonl", CONVERSATION)

    assert replay(scenario, option, "") == 2
    assert f"error: {option}: empty file name" in capsys.readouterr().err


def test_ctrl_c_while_the_plot_is_saved_leaves_no_half_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    scenario = write_jsonl(tmp_path / "s.jsonl", CONVERSATION)
    plot, out = tmp_path / "p.png", tmp_path / "r.json"

    def savefig_then_interrupt(self, target, **kwargs) -> None:
        target.write(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", savefig_then_interrupt)
    assert replay(scenario, "--json", out, "--plot", plot) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "s.jsonl"]


def test_a_plot_is_written_whole_under_its_name(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    scenario = write_jsonl(tmp_path / "s.jsonl", CONVERSATION, {**CONVERSATION, "id": "b"})
    plot = tmp_path / "p.svg"

    assert replay(scenario, "--plot", plot) == 0
    assert plot.read_text().lstrip().startswith("<?xml") and plot.read_text().rstrip().endswith("</svg>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.svg", "s.jsonl"]


def test_an_output_that_is_a_file_of_an_input_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = write_jsonl(tmp_path / "s.jsonl", CONVERSATION)

    assert replay(tmp_path, "--requests-jsonl", scenario) == 2
    assert f"error: --requests-jsonl {scenario}: the same file as an input" in capsys.readouterr().err
    assert json.loads(scenario.read_text()) == CONVERSATION


def test_a_closed_stdout_ends_quietly_with_141_and_still_writes_the_json(tmp_path: Path) -> None:
    scenario = write_jsonl(tmp_path / "s.jsonl", CONVERSATION, {**CONVERSATION, "id": "b"})
    out = tmp_path / "r.json"
    command = [sys.executable, "-m", "prefixcache", "replay", str(scenario), "--no-model", "--no-progress"]
    process = subprocess.Popen([*command, "--json", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # as `| head -1` does once it has its line: every write to stdout fails
    stderr = process.stderr.read().decode()
    process.wait(timeout=120)

    assert process.returncode == 141
    assert stderr == ""
    assert json.loads(out.read_text())["requests"] == 2


@pytest.mark.parametrize("token_id", [2**32, 10**30])
@pytest.mark.parametrize(
    "record",
    [
        lambda ids: {"model": "m", "prompt": ids},
        lambda ids: {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": ids},
        },
    ],
    ids=["requests", "batch"],
)
def test_a_logged_prompt_id_beyond_32_bits_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], record, token_id: int
) -> None:
    # Once an OverflowError traceback (exit 1): the ids were put in a uint32 array before the vocabulary check.
    scenario = write_jsonl(tmp_path / "r.jsonl", record([1, token_id]))
    assert replay(scenario) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{scenario}:1:" in err and f"prompt token id {token_id} is not below the vocabulary size" in err


def test_replay_help_names_every_input_format(capsys: pytest.CaptureFixture[str]) -> None:
    # PATH's help once said "chat or Mooncake trace" only, after request logs, Batch and ShareGPT were read too.
    with pytest.raises(SystemExit) as exited:
        main(["replay", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for kind in ("chat transcripts", "request logs", "OpenAI Batch", "ShareGPT", "Mooncake", "one JSON array"):
        assert kind in text, kind


MODES = {"replay": [], "sweep": ["--sweep"], "endpoint": ["--endpoint", "http://127.0.0.1:9"]}
FORMATS = ["auto", "chat", "requests", "batch", "sharegpt", "mooncake"]


@pytest.mark.parametrize("file_format", FORMATS)
@pytest.mark.parametrize("mode", MODES)
def test_a_missing_file_is_one_line_and_exit_2_in_every_mode_and_format(
    tmp_path: Path, mode: str, file_format: str, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "absent.jsonl"

    assert replay(missing, *MODES[mode], "--format", file_format) == 2

    assert capsys.readouterr().err == f"error: {missing}: not found: no such file or folder\n"


def test_a_path_that_is_no_file_or_folder_is_told_so_not_that_it_is_missing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert replay("/dev/null") == 2

    assert capsys.readouterr().err == "error: /dev/null: not a regular file or folder\n"


def test_a_symlink_loop_is_an_input_not_found_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")

    assert replay(tmp_path / "loop1", "--json", tmp_path / "out.json") == 2

    assert capsys.readouterr().err == f"error: {tmp_path / 'loop1'}: not found: no such file or folder\n"


EMPTY = {"empty": "", "blank lines": "\n \n\n", "empty array": "[]\n"}


@pytest.mark.parametrize("content", EMPTY.values(), ids=EMPTY.keys())
@pytest.mark.parametrize("file_format", FORMATS)
@pytest.mark.parametrize("mode", MODES)
def test_an_empty_file_is_one_line_and_exit_2_in_every_mode_and_format(
    tmp_path: Path, mode: str, file_format: str, content: str, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)

    assert replay(empty, *MODES[mode], "--format", file_format) == 2

    assert capsys.readouterr().err == f"error: {empty}: empty file: no conversations or requests\n"
