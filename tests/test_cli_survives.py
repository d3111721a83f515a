"""The command line survives what users do (issue 12): Ctrl-C, wrong paths and sizes, folders, bad first lines,
tokenizer folders without a template, and every option documented.  These run the real entry point in a
subprocess (``python -m prefixcache``), as a user's shell would."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.cli import build_parser, main
from prefixcache.replay.replayer import load_requests

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "scenarios"
CHAT = SCENARIOS / "multi_turn_chat.jsonl"
QWEN_DIR = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen2.5-0.5b-instruct"


def run_cli(*args: object, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefixcache", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def line(messages: list[tuple[str, str]], conversation_id: str) -> str:
    return json.dumps({"id": conversation_id, "messages": [{"role": r, "content": c} for r, c in messages]})


GOOD = line([("user", "Hello there"), ("assistant", "Hi! How can I help?")], "ok")


@pytest.fixture
def qwen_dir() -> Path:
    pytest.importorskip("transformers")
    if not QWEN_DIR.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the Qwen tokenizer folder at {QWEN_DIR}")
        pytest.skip(f"Qwen tokenizer folder not found at {QWEN_DIR}")
    return QWEN_DIR


def test_readme_test_command_makes_the_venv_pins_torch_and_calls_its_pip_and_pytest_by_path() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- test-command -->")[1].split("<!-- /test-command -->")[0]
    command = "\n".join(x for x in block.strip().splitlines() if not x.startswith("```"))
    steps = [step.strip() for step in command.split("&&")]

    assert steps[0] == "python3 -m venv .venv"
    assert steps[1] == ".venv/bin/pip install -q torch==2.13.0"
    assert steps[-1] == ".venv/bin/pytest -n 2 --dist loadfile"  # two xdist workers; a file's tests share one
    # No bare pip or pytest: a new terminal has no venv active, and the global ones are not this clone's.
    assert all(step.startswith((".venv/bin/", "python3 -m venv")) for step in steps)
    subprocess.run(["bash", "-n", "-c", command], check=True)


def test_readme_test_command_installs_every_extra_but_dev_and_peers() -> None:
    # `peers` holds the dependencies of other systems' caches for `bench peers`; .ci/run installs it (and SGLang)
    # after the test command and runs that benchmark's tests then.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    readme = (ROOT / "README.md").read_text()
    extras = set(re.search(r'pip install -q -e "\.\[([a-z,-]+)\]"', readme).group(1).split(","))
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])

    assert extras == declared - {"dev", "peers"}
    assert '.venv/bin/pip install --quiet -e ".[peers]"' in (ROOT / ".ci" / "run").read_text()


def test_ci_runs_the_readme_command_without_a_venv_of_its_own() -> None:
    ci = (ROOT / ".ci" / "run").read_text()

    assert "venv" not in "".join(x for x in ci.splitlines() if not x.lstrip().startswith("#")).replace(".venv/", "")
    assert 'bash -euo pipefail -c "$test_command"' in ci


def test_ctrl_c_prints_the_partial_table_writes_partial_json_and_exits_130(tmp_path: Path, cli_processes) -> None:
    out = tmp_path / "report.json"
    scenario = SCENARIOS / "agent_tool_loop.jsonl"
    total = len(load_requests(scenario, ByteTokenizer())[0])
    process = cli_processes.start(
        ["replay", str(scenario), "--verify", "--json", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stderr = bytearray()

    def read_stderr() -> None:
        for chunk in iter(lambda: process.stderr.read1(4096), b""):
            stderr.extend(chunk)

    reader = threading.Thread(target=read_stderr)
    reader.start()
    deadline = time.monotonic() + 300
    done = re.compile(rb"replay agent_tool_loop\.jsonl:.*?\| *([0-9]+)/[0-9]+ ")
    while time.monotonic() < deadline and process.poll() is None:
        counts = [int(m) for m in done.findall(bytes(stderr))]
        if counts and max(counts) >= 2:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the replay ended before it could be interrupted"
    cli_processes.interrupt(process)
    stdout = process.stdout.read().decode()
    process.wait(timeout=120)
    reader.join(timeout=10)

    assert process.returncode == 130
    assert "Traceback" not in stderr.decode()
    assert "PARTIAL: interrupted" in stdout and "| agent_tool_loop (partial) |" in stdout
    report = json.loads(out.read_text())
    assert report["partial"] is True and report["scenarios"][str(scenario)]["partial"] is True
    assert 2 <= report["requests"] < total
    assert report["cached_tokens"] + report["prefilled_tokens"] == report["prompt_tokens"]


def test_progress_starts_before_loading_and_covers_tokenizing_and_replaying() -> None:
    done = run_cli("replay", CHAT, "--limit", 2)

    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("building model tiny ...\n")
    assert "tokenize multi_turn_chat.jsonl" in done.stderr
    assert "replay multi_turn_chat.jsonl" in done.stderr


def test_no_progress_keeps_stderr_empty() -> None:
    done = run_cli("replay", CHAT, "--limit", 2, "--no-model", "--no-progress")

    assert (done.returncode, done.stderr) == (0, "")


def test_progress_line_comes_before_the_hugging_face_tokenizer_loads(qwen_dir: Path) -> None:
    done = run_cli("replay", CHAT, "--limit", 1, "--no-model", "--tokenizer", qwen_dir)

    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith(f"loading tokenizer {qwen_dir} ...\n")
    assert "tokenize multi_turn_chat.jsonl" in done.stderr


def test_a_plot_name_matplotlib_cannot_write_fails_at_once_in_one_line() -> None:
    done = run_cli("replay", CHAT, "--no-progress", "--plot", "out.txt")

    assert (done.returncode, done.stdout) == (2, "")  # nothing replayed
    assert done.stderr.count("\n") == 1
    assert "--plot out.txt: '.txt' is not an image format matplotlib writes; use one of" in done.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--json", "/no/such/dir/x.json"], "--json /no/such/dir/x.json: folder '/no/such/dir' does not exist"),
        (["--requests-jsonl", "scenarios"], "--requests-jsonl scenarios: is a folder"),
        (["--json", "scenarios/multi_turn_chat.jsonl"], "the same file as an input"),
        (["--cache-memory", "1TiB"], "--cache-memory asks for 1,024.0 GiB of KV but cpu has only"),
    ],
)
def test_bad_outputs_and_sizes_fail_before_any_work_in_one_line(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)

    assert main(["replay", str(CHAT), "--no-progress", *args]) == 2

    out, err = capsys.readouterr()
    assert out == ""  # nothing replayed
    assert err.count("\n") == 1 and says in err


def test_too_small_cache_names_the_smallest_size_that_replays_the_whole_input() -> None:
    requests, _ = load_requests(CHAT, ByteTokenizer())
    need = max(-(-(len(r.prompt) + len(r.answer)) // 16) * 16 for r in requests)

    done = run_cli("replay", CHAT, "--no-model", "--no-progress", "--cache-tokens", 100)

    assert done.returncode == 2
    assert f"the whole input replays with --cache-tokens {need} or more" in done.stderr
    assert main(["replay", str(CHAT), "--no-model", "--no-progress", "--cache-tokens", str(need)]) == 0
    assert main(["replay", str(CHAT), "--no-model", "--no-progress", "--cache-tokens", str(need - 16)]) == 2


def test_a_folder_replays_its_jsonl_files_in_name_order(tmp_path: Path) -> None:
    shutil.copy(SCENARIOS / "multi_turn_chat.jsonl", tmp_path / "b.jsonl")
    shutil.copy(SCENARIOS / "few_shot.jsonl", tmp_path / "a.jsonl")
    (tmp_path / "notes.txt").write_text("not a scenario")
    out = tmp_path / "out" / "report.json"
    out.parent.mkdir()

    done = run_cli("replay", tmp_path, "--no-model", "--no-progress", "--json", out)

    assert done.returncode == 0, done.stderr
    assert list(json.loads(out.read_text())["scenarios"]) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]


def test_a_folder_without_jsonl_files_is_an_error(tmp_path: Path) -> None:
    assert main(["replay", str(tmp_path), "--no-model", "--no-progress"]) == 2


def test_vocab_and_merges_without_tokenizer_config_say_what_is_missing(tmp_path: Path, qwen_dir: Path) -> None:
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(qwen_dir / name, tmp_path / name)

    done = run_cli("replay", CHAT, "--no-model", "--no-progress", "--tokenizer", tmp_path)

    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1
    assert "no tokenizer_config.json" in done.stderr and "copy the model's tokenizer_config.json" in done.stderr


def test_a_tokenizer_without_chat_template_asks_for_one_and_chat_template_supplies_it(
    tmp_path: Path, qwen_dir: Path
) -> None:
    folder = tmp_path / "tok"
    shutil.copytree(qwen_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    template = tmp_path / "chatml.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    out = tmp_path / "report.json"

    refused = run_cli("replay", CHAT, "--no-model", "--no-progress", "--tokenizer", folder)
    done = run_cli(
        "replay", CHAT, "--no-model", "--no-progress", "--tokenizer", folder, "--chat-template", template, "--json", out
    )

    assert refused.returncode == 2
    assert "has no chat template" in refused.stderr and "--chat-template FILE" in refused.stderr
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["requests"] == len(load_requests(CHAT, ByteTokenizer())[0])


def test_a_conversation_without_an_assistant_message_is_named_in_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text(GOOD + "\n" + line([("user", "anyone there?")], "lonely-42") + "\n")

    done = run_cli("replay", path, "--no-model", "--no-progress")

    assert done.returncode == 0
    assert "conversation 'lonely-42' has no assistant message, so it makes no request" in done.stderr
    assert f"{path}:2:" in done.stderr


def test_skip_invalid_skips_a_too_deeply_nested_first_line_which_otherwise_names_its_column(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text("[" * 100_000 + "\n" + GOOD + "\n")
    out = tmp_path / "report.json"

    failed = run_cli("replay", path, "--no-model", "--no-progress")
    skipped = run_cli("replay", path, "--no-model", "--no-progress", "--skip-invalid", "--json", out)

    assert failed.returncode == 2
    assert f"{path}:1: not usable JSON: nested 100000 levels deep (deepest bracket at column 100000)" in failed.stderr
    assert skipped.returncode == 0, skipped.stderr
    report = json.loads(out.read_text())
    assert (report["requests"], report["skipped_lines"]) == (1, 1)


@pytest.mark.parametrize(
    ("first_line", "says"),
    [
        ('{"n": ' + "9" * 5000 + "}", "not usable JSON: an integer of 5,000 digits at column 7"),
        ('{"id": "x", "messages": tru}', "not valid JSON: Expecting value at column 25"),
        ('{"id": "é", "messages": [x]}', "not valid JSON: Expecting value at column 26"),
        ('{"id": "x\tb", "messages": []}', "not valid JSON: Invalid control character at column 10"),
        ('{"messages": "\xff"}', "not valid UTF-8 (invalid start byte at column 15)"),
    ],
)
def test_skip_invalid_skips_any_bad_first_line_which_otherwise_names_its_column(
    tmp_path: Path, first_line: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(first_line.encode("utf-8").replace(b"\xc3\xbf", b"\xff") + b"\n" + GOOD.encode() + b"\n")
    out = tmp_path / "report.json"

    assert main(["replay", str(path), "--no-model", "--no-progress"]) == 2
    assert f"{path}:1: {says}" in capsys.readouterr().err
    assert main(["replay", str(path), "--no-model", "--no-progress", "--skip-invalid", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["requests"], report["skipped_lines"]) == (1, 1)


def test_a_byte_order_mark_at_the_start_of_the_file_is_read_past(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode() + b"\n")
    out = tmp_path / "report.json"

    assert main(["replay", str(path), "--no-model", "--no-progress", "--json", str(out)]) == 0

    assert json.loads(out.read_text())["requests"] == 1


def test_every_option_of_every_command_has_a_help_line() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    undocumented = [
        f"{name} {action.option_strings or action.dest}"
        for name, sub in [("prefixcache", parser), *commands.items()]
        for action in sub._actions
        if action.help is None and action.dest != "command"
    ]

    assert undocumented == []


def test_bench_help_lists_the_benchmark_names() -> None:
    from prefixcache.bench import BENCHMARKS

    done = run_cli("bench", "--help")

    assert all(name in done.stdout for name in BENCHMARKS)


def test_version_prints_the_package_version() -> None:
    import importlib.metadata

    done = run_cli("--version")

    assert (done.returncode, done.stdout) == (0, f"prefixcache {importlib.metadata.version('prefixcache')}\n")


def test_the_readme_lists_every_option() -> None:
    # The serve table and the replay, bench and plan synopses are generated (tests/test_readme_reference.py).
    synopsis = (ROOT / "README.md").read_text()
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    options = {
        option
        for sub in [parser, *commands.values()]
        for action in sub._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }

    assert sorted(o for o in options if o not in synopsis) == []


def test_bench_quick_says_its_figures_are_not_judged(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "memory", "--quick"]) == 0

    assert "the figures are not judged against the goals" in capsys.readouterr().out
