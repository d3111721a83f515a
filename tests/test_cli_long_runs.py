"""Long model replays (issue 29): the bar shows each prefill chunk by chunk, and Ctrl-C during a long prefill acts
between chunks, within about a second."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from prefixcache.replay.replayer import Replayer, replay_paths

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "scenarios" / "multi_turn_chat.jsonl"

CTRL_C_LIMIT_S = 2.0
"""How long after SIGINT the replay may take to exit: the 1 s the issue asks for, plus 1 s of margin for a loaded
machine (seen: the report printed 0.003-0.07 s after the signal, the process gone 0.23-0.45 s after it, with the
load at 5 on 2 cores)."""


def one_prompt(path: Path, characters: int) -> Path:
    """A file of one conversation whose user message is ``characters`` ASCII characters (as many byte tokens)."""
    text = ("lorem ipsum dolor sit amet " * (characters // 27 + 1))[:characters]
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
    path.write_text(json.dumps({"id": "long", "messages": messages}) + "\n")
    return path


class Bar:
    """A stand-in for the tqdm bar the command line gives: iterates the requests, records what each prefill chunk
    shows in its postfix."""

    def __init__(self, items) -> None:
        self.items, self.notes = items, []

    def __call__(self, items, description, total, unit) -> Bar:
        self.items = items
        return self

    def __iter__(self):
        return iter(self.items)

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.notes.append(text)


def test_the_bar_shows_each_prefill_chunk(tiny, tmp_path: Path) -> None:
    path = one_prompt(tmp_path / "long.jsonl", 2000)
    bars: list[Bar] = []

    def progress(items, description, total, unit):
        bars.append(Bar(items))
        return bars[-1]

    report = replay_paths([path], Replayer(tiny, prefill_chunk_tokens=512), progress=progress)

    assert report.scenarios[0].prompt_tokens == 2019
    assert bars[-1].notes == [f"prefill {n:,}/2,019 tok" for n in (512, 1024, 1536, 2019)]


def test_chunked_prefill_verifies_and_caches_as_one_forward(tiny) -> None:
    chunked = replay_paths([CHAT], Replayer(tiny, verify=True, prefill_chunk_tokens=64), limit=2).scenarios[0]
    whole = replay_paths([CHAT], Replayer(tiny, verify=True, prefill_chunk_tokens=None), limit=2).scenarios[0]

    assert chunked.verified is True and whole.verified is True
    assert (chunked.cached_tokens, chunked.prompt_tokens) == (whole.cached_tokens, whole.prompt_tokens)
    assert chunked.max_abs_logit_diff <= 1e-4


def prefilling(process: subprocess.Popen) -> tuple[bytearray, threading.Thread]:
    """Wait (at most 300 s) until the replay ``process`` shows a chunk of its 32,019-token prefill on stderr; the
    stderr read so far (and on, by the returned reader thread).  Fails if the replay ended first or never showed one."""
    stderr = bytearray()

    def read_stderr() -> None:
        for chunk in iter(lambda: process.stderr.read1(4096), b""):
            stderr.extend(chunk)

    reader = threading.Thread(target=read_stderr)
    reader.start()
    started = re.compile(rb"prefill [1-9][0-9,]*/32,019 tok")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None and not started.search(bytes(stderr)):
        time.sleep(0.01)
    assert process.poll() is None, "the replay ended before it could be interrupted"
    assert started.search(bytes(stderr)), "no prefill chunk shown within 300 s"
    return stderr, reader


def test_ctrl_c_during_a_long_prefill_exits_130_within_a_second_with_the_partial_report(
    tmp_path: Path, cli_processes
) -> None:
    # The small preset on a 32,000-token prompt: tens of seconds of prefill on 2 cores, seconds on a fast machine.
    path = one_prompt(tmp_path / "long.jsonl", 32_000)
    out = tmp_path / "report.json"
    command = ["replay", str(path), "--model", "small", "--json", str(out)]
    process = cli_processes.start(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stderr, reader = prefilling(process)
    cli_processes.interrupt(process)
    signalled = time.monotonic()
    stdout = process.stdout.read().decode()  # until the process closes it: its end
    process.wait(timeout=120)
    exit_s = time.monotonic() - signalled
    reader.join(timeout=10)

    assert process.returncode == 130
    assert exit_s < CTRL_C_LIMIT_S, f"the replay took {exit_s:.2f} s to exit after Ctrl-C"
    assert b"interrupted: the report above covers the requests completed before Ctrl-C" in stderr
    assert "| long (partial) |        0 |" in stdout
    assert json.loads(out.read_text())["partial"] is True


def test_prefill_chunk_zero_prefills_a_prompt_in_one_forward(tiny, tmp_path: Path) -> None:
    from prefixcache.cli import build_parser

    path = one_prompt(tmp_path / "long.jsonl", 2000)
    args = build_parser().parse_args(["replay", str(path), "--prefill-chunk", "0"])
    bar = Bar(None)

    replay_paths([path], Replayer(tiny, prefill_chunk_tokens=args.prefill_chunk or None), progress=bar)

    assert bar.notes == ["prefill 2,019/2,019 tok"]


def test_a_negative_prefill_chunk_is_refused(capsys) -> None:
    from prefixcache.cli import main

    assert main(["replay", str(CHAT), "--prefill-chunk", "-1"]) == 2
    assert "--prefill-chunk must be 0 (whole prompts) or more, got -1" in capsys.readouterr().err


def test_the_prefill_chunk_written_down_for_help_is_the_replayers() -> None:
    from prefixcache.cli.replay import DEFAULT_PREFILL_CHUNK
    from prefixcache.replay.replayer import DEFAULT_PREFILL_CHUNK_TOKENS

    assert DEFAULT_PREFILL_CHUNK == DEFAULT_PREFILL_CHUNK_TOKENS == 512


def test_sigterm_during_a_piped_replay_ends_it_as_ctrl_c_does_and_removes_its_copy(
    tmp_path: Path, cli_processes
) -> None:
    path = one_prompt(tmp_path / "long.jsonl", 32_000)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    environment = {**os.environ, "TMPDIR": str(temporary)}
    command = ["replay", "-", "--model", "small"]
    process = cli_processes.start(
        command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment
    )
    process.stdin.write(path.read_bytes())
    process.stdin.close()
    _, reader = prefilling(process)
    assert [entry.name for entry in temporary.iterdir() if entry.name.startswith("prefixcache-replay-")]
    process.send_signal(signal.SIGTERM)
    stdout = process.stdout.read().decode()
    process.wait(timeout=120)
    reader.join(timeout=10)

    assert process.returncode == 143  # 128 + SIGTERM, after the partial report, as Ctrl-C's 130
    assert "| stdin (partial) |        0 |" in stdout
    assert [entry.name for entry in temporary.iterdir() if entry.name.startswith("prefixcache-replay-")] == []
