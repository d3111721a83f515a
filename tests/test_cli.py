"""Specification of the command line: ``replay`` writes its report as a table, JSON and per-request usage,
``plan`` sizes a KV budget, and bad input ends with exit status 2 and a message naming the problem."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache import cli
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.cli import main
from prefixcache.errors import install_command
from prefixcache.models import build_model
from prefixcache.replay.replayer import load_requests
from prefixcache.testing import ShiftedLogits

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "scenarios" / "multi_turn_chat.jsonl"
REPORT_KEYS = {
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "prefilled_tokens",
    "copied_tokens",
    "ideal_cached_tokens",
    "evictions",
    "hit_rate",
    "verified",
}


def replay(*args: object) -> int:
    return main(["replay", *map(str, args), "--no-progress"])


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD_LINE = json.dumps(
    {
        "id": "ok",
        "messages": [
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi! How can I help?"},
        ],
    }
)


@pytest.fixture(scope="module")
def chat_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("cli") / "report.json"
    assert replay(CHAT, "--no-model", "--json", out) == 0
    return json.loads(out.read_text())


def test_json_report_has_the_documented_top_level_keys(chat_report: dict) -> None:
    assert REPORT_KEYS <= chat_report.keys()


def test_json_report_has_the_documented_keys_per_scenario(chat_report: dict) -> None:
    assert list(chat_report["scenarios"]) == [str(CHAT)]
    assert REPORT_KEYS <= chat_report["scenarios"][str(CHAT)].keys()


def test_json_report_counts_the_requests_and_prompt_tokens_of_the_file(chat_report: dict) -> None:
    requests, _ = load_requests(CHAT, ByteTokenizer())

    assert chat_report["requests"] == len(requests)
    assert chat_report["prompt_tokens"] == sum(len(r.prompt) for r in requests)


def test_json_report_values_are_consistent(chat_report: dict) -> None:
    for report in (chat_report, chat_report["scenarios"][str(CHAT)]):
        assert report["cached_tokens"] + report["prefilled_tokens"] == report["prompt_tokens"]
        assert report["hit_rate"] == report["cached_tokens"] / report["prompt_tokens"]
        assert report["cached_tokens"] == report["ideal_cached_tokens"] > 0
        assert report["evictions"] == 0
        assert report["verified"] is None


def test_json_report_total_of_one_file_is_that_file(chat_report: dict) -> None:
    scenario = chat_report["scenarios"][str(CHAT)]

    assert {key: chat_report[key] for key in REPORT_KEYS} == {key: scenario[key] for key in REPORT_KEYS}


def test_requests_jsonl_has_one_openai_usage_line_per_request(tmp_path: Path) -> None:
    out_json, out_requests = tmp_path / "report.json", tmp_path / "requests.jsonl"

    assert replay(CHAT, "--no-model", "--json", out_json, "--requests-jsonl", out_requests) == 0

    report = json.loads(out_json.read_text())
    records = [json.loads(line) for line in out_requests.read_text().splitlines()]
    assert len(records) == report["requests"]
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in records]
    assert sum(cached) == report["cached_tokens"]
    assert sum(r["usage"]["prompt_tokens"] for r in records) == report["prompt_tokens"]


def test_replay_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert replay(CHAT, "--no-model") == 0

    out = capsys.readouterr().out
    assert "model: none (cache accounting only), block size 16" in out
    assert "| scenario        | requests | prompt tok | cached tok | hit rate | ideal |" in out
    assert "\n| multi_turn_chat |" in out and str(CHAT) in out  # the file's name in the table, its path above


def test_replay_block_size_reaches_the_report(tmp_path: Path) -> None:
    out = tmp_path / "report.json"

    assert replay(CHAT, "--no-model", "--block-size", 4, "--json", out) == 0

    assert json.loads(out.read_text())["block_size"] == 4


def test_small_cache_tokens_evict(tmp_path: Path) -> None:
    out = tmp_path / "report.json"

    assert replay(CHAT, "--no-model", "--cache-tokens", 8192, "--json", out) == 0

    report = json.loads(out.read_text())
    assert report["evictions"] > 0
    assert report["cached_tokens"] <= report["ideal_cached_tokens"]


def test_replay_with_the_model_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_lines(tmp_path / "one.jsonl", [GOOD_LINE])
    out = tmp_path / "report.json"

    assert replay(path, "--verify", "--json", out) == 0

    assert json.loads(out.read_text())["verified"] is True
    assert "model: tiny" in capsys.readouterr().out


def test_missing_file_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "absent.jsonl"

    assert replay(missing, "--no-model") == 2

    err = capsys.readouterr().err
    assert err == f"error: {missing}: not found: no such file or folder\n"


def test_a_missing_file_is_named_before_any_model_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    built = []
    monkeypatch.setattr("prefixcache.models.llama.build_model", lambda *args, **kwargs: built.append(args))
    missing = tmp_path / "absent.jsonl"

    assert replay(CHAT, missing) == 2

    assert built == []
    captured = capsys.readouterr()
    assert f"error: {missing}: not found: no such file or folder" in captured.err
    assert "building model" not in captured.out + captured.err


def test_bad_line_exits_2_naming_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [GOOD_LINE, "{not json"])

    assert replay(path, "--no-model") == 2

    assert f"{path}:2:" in capsys.readouterr().err


def test_bad_line_with_skip_invalid_exits_0_and_counts_it(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [GOOD_LINE, "{not json"])
    out = tmp_path / "report.json"

    assert replay(path, "--no-model", "--skip-invalid", "--json", out) == 0

    report = json.loads(out.read_text())
    assert (report["requests"], report["skipped_lines"]) == (1, 1)


@pytest.mark.parametrize("file_format", ["auto", "chat", "requests", "sharegpt", "mooncake"])
def test_skip_invalid_with_every_line_invalid_exits_2_saying_no_valid_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], file_format: str
) -> None:
    # Auto detection takes {"messages": 3} for a chat transcript; only the loader refuses it.
    path = write_lines(tmp_path / "bad.jsonl", ["{not json", '{"messages": 3}'])
    out = tmp_path / "report.json"

    assert replay(path, "--no-model", "--skip-invalid", "--format", file_format, "--json", out) == 2

    err = capsys.readouterr().err
    assert "Traceback" not in err
    read_as = "chat" if file_format == "auto" else file_format
    assert f"error: {path}: no valid request found ({read_as} format); 2 invalid lines skipped" in err
    assert not out.exists()


def test_skip_invalid_past_a_line_limit_says_that_limit_counts_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # In a request log --limit counts lines, bad ones included: the one valid request is the second line.
    good = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi there"}]})
    path = write_lines(tmp_path / "log.jsonl", ["{bad", good])

    assert replay(path, "--no-model", "--skip-invalid", "--format", "requests", "--limit", "1") == 2
    err = capsys.readouterr().err
    assert "no valid request found in the first 1 lines (--limit counts lines in this format)" in err
    assert replay(path, "--no-model", "--skip-invalid", "--format", "requests", "--limit", "2") == 0


def test_verify_without_a_model_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert replay(CHAT, "--no-model", "--verify") == 2

    assert "--verify needs a model" in capsys.readouterr().err


def test_failed_verification_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        "prefixcache.models.llama.build_model", lambda name, **kwargs: ShiftedLogits(build_model(name, **kwargs))
    )
    path = write_lines(tmp_path / "one.jsonl", [GOOD_LINE])

    assert replay(path, "--verify") == 1

    assert "VERIFICATION FAILED" in capsys.readouterr().err


PLAN_8B = ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--memory", "24GiB"]


def test_plan_prints_bytes_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN_8B, "--dtype", "bf16"]) == 0

    assert "bytes per token: 131,072 " in capsys.readouterr().out


@pytest.mark.parametrize("command", [[*PLAN_8B, "-v"], [*PLAN_8B, "-vv"], ["-v", *PLAN_8B, "--verbose"]])
def test_verbosity_is_taken_after_the_subcommand_too(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(command) == 0
    assert "tokens that fit: 196,608\n" in capsys.readouterr().out


def test_plan_prints_the_tokens_that_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN_8B, "--dtype", "bf16"]) == 0

    assert "tokens that fit: 196,608\n" in capsys.readouterr().out


def test_plan_prints_whole_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN_8B, "--block-size", "16"]) == 0

    assert "blocks of 16 tokens: 12,288 (196,608 tokens in whole blocks)" in capsys.readouterr().out


def test_plan_in_fp32_doubles_the_bytes_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN_8B, "--dtype", "fp32"]) == 0

    out = capsys.readouterr().out
    assert "bytes per token: 262,144 " in out and "tokens that fit: 98,304\n" in out


def test_plan_rejects_a_non_positive_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--layers", "0", "--kv-heads", "8", "--head-dim", "128", "--memory", "1GiB"]) == 2

    assert "must be positive" in capsys.readouterr().err


def test_plan_rejects_memory_that_holds_no_block(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN_8B[:-1], "1KiB"]) == 2

    assert "holds no block of 16 tokens (2,097,152 bytes" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "size"),
    [("24GiB", 24 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("4096", 4096), ("2 kib", 2048)],
)
def test_parse_size_reads_units(text: str, size: int) -> None:
    assert cli.parse_size(text) == size


def test_parse_size_reads_the_exponent_form_its_error_message_suggests() -> None:
    assert cli.parse_size("1e9") == 10**9


def test_bad_memory_size_is_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--layers", "1", "--kv-heads", "1", "--head-dim", "2", "--memory", "lots"])

    assert exit_.value.code == 2
    assert "not a size" in capsys.readouterr().err


def test_python_dash_m_prefixcache_help_lists_the_commands() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "prefixcache", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )

    assert done.returncode == 0
    for command in ("replay", "bench", "plan"):
        assert command in done.stdout


def test_bench_serve_without_the_server_extra_says_what_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "prefixcache.serve", None)  # its import fails, as without FastAPI
    monkeypatch.setitem(sys.modules, "prefixcache.bench.serve", None)  # however earlier tests imported it
    assert main(["bench", "serve", "--quick"]) == 2
    err = capsys.readouterr().err
    assert f"the serve benchmark needs the server extra: {install_command('server')}" in err and "pip install -e" in err


def test_standard_input_and_a_pipe_are_replayed_like_the_file_they_carry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io
    import os
    import threading

    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "store"))
    data = CHAT.read_bytes()
    assert replay(CHAT, "--no-model", "--json", tmp_path / "file.json") == 0
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert replay("-", "--no-model", "--json", tmp_path / "stdin.json") == 0
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(data))
    writer.start()
    assert replay(fifo, "--no-model", "--json", tmp_path / "fifo.json") == 0
    writer.join(10)
    reports = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("file", "stdin", "fifo")]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert replay("-", "--no-model", "--requests-jsonl", tmp_path / "requests.jsonl") == 0
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 28 and {record["scenario"] for record in records} == {"stdin"}
    totals = [(r["prompt_tokens"], r["cached_tokens"]) for r in reports]
    assert totals[0] == totals[1] == totals[2] and totals[0][1] > 0
    assert [list(r["scenarios"]) for r in reports] == [[str(CHAT)], ["stdin"], ["pipe-fifo"]]
    capsys.readouterr()
    for option in ("--sweep", "--endpoint=http://127.0.0.1:9"):
        assert replay("-", "--no-model", option) == 2
        assert "reads files only; save - to a file first" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", None)  # started with standard input closed (<&-)
    assert replay("-", "--no-model") == 2
    assert "standard input, which is closed" in capsys.readouterr().err
    assert replay("-", "-", "--no-model") == 2
    assert "- (standard input) is named more than once" in capsys.readouterr().err
    # An error in piped input names it as given, not its temporary copy.
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"")))
    assert replay("-", "--no-model") == 2
    assert capsys.readouterr().err == "error: standard input: empty file: no conversations or requests\n"


def test_pipes_of_one_name_are_kept_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import os
    import threading

    sources = [CHAT, ROOT / "scenarios" / "few_shot.jsonl", ROOT / "scenarios" / "support_bot.jsonl"]
    fifos = [tmp_path / "a" / "f", tmp_path / "c" / "f-2", tmp_path / "b" / "f"]  # "pipe-f", "pipe-f-2", then?
    writers = []
    for fifo, source in zip(fifos, sources, strict=True):
        fifo.parent.mkdir()
        os.mkfifo(fifo)
        writers.append(threading.Thread(target=lambda f=fifo, s=source: f.write_bytes(s.read_bytes())))
        writers[-1].start()
    assert replay(*fifos, "--no-model", "--json", tmp_path / "out.json") == 0
    for writer in writers:
        writer.join(10)
    scenarios = json.loads((tmp_path / "out.json").read_text())["scenarios"]
    assert list(scenarios) == ["pipe-f", "pipe-f-2", "pipe-f-3"]
    assert len({s["prompt_tokens"] for s in scenarios.values()}) == 3  # three inputs, none overwritten
