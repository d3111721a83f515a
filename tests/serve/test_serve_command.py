"""``prefixcache serve`` as a user runs it: a subprocess on 127.0.0.1, a free port, Ctrl-C to stop."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx


def test_serve_command_answers_and_stops_on_ctrl_c(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("secret-1 team-1\n")
    command = [
        sys.executable,
        "-m",
        "prefixcache",
        "serve",
        "--port",
        "0",
        "--cache-tokens",
        "4096",
        "--max-batch-tokens",
        "64",
    ]
    command += ["--max-running", "2"]
    process = subprocess.Popen([*command, "--api-keys", str(keys)], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        url = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line).group(1)
        assert httpx.get(url + "/health").json()["status"] == "ok"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
        headers = {"Authorization": "Bearer secret-1"}
        answer = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 3
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0


def test_batch_bounds_below_one_are_refused_before_anything_starts(capsys) -> None:
    from prefixcache.cli import main

    for option in ("--max-batch-tokens", "--max-running"):
        try:
            code = main(["serve", option, "0"])
        except SystemExit as exit_:
            code = exit_.code
        assert code == 2
        assert option in capsys.readouterr().err
