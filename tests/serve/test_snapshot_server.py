"""``prefixcache serve --snapshot DIR``: a restarted server answers the next agent turn from the cache, a refused
snapshot starts it cold saying why, and ``--snapshot-every`` saves while it runs."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.cli import main
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import LlamaModel
from prefixcache.serve import create_app, start_background

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")

SERVE = [sys.executable, "-m", "prefixcache", "serve", "--port", "0", "--cache-tokens", "4096"]


def start(snapshot: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [*SERVE, "--snapshot", str(snapshot), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = process.stdout.readline()
    match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
    if match is None:
        process.kill()
        raise AssertionError(f"no URL in {line!r}: {process.stderr.read()[-2000:]}")
    return process, match.group(1)


def stop(process: subprocess.Popen) -> str:
    """Ctrl-C, as a user stops it; returns what it logged."""
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-2000:]
    return stderr


def turn(url: str, messages: list[dict]) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    messages.append(answer["choices"][0]["message"])
    return answer["usage"]


def test_a_restarted_server_answers_the_next_turn_from_its_snapshot(tmp_path: Path) -> None:
    snapshot = tmp_path / "snap"
    messages = [{"role": "system", "content": "You are a terse support agent for Acme."}]
    process, url = start(snapshot)
    try:
        usages = []
        for question in ("Where is order 12?", "And order 13?", "Cancel both."):
            messages.append({"role": "user", "content": question})
            usages.append(turn(url, messages))
    finally:
        first_log = stop(process)
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "no snapshot" in first_log and "saved" in first_log
    assert (snapshot / "CURRENT").is_file()

    process, url = start(snapshot)
    try:
        messages.append({"role": "user", "content": "Thanks!"})
        fourth = turn(url, messages)
    finally:
        second_log = stop(process)

    assert "restored" in second_log
    # Every token of the third turn's prompt (and more: its answer, as far as it renders back the same) is cached.
    assert fourth["prompt_tokens_details"]["cached_tokens"] >= usages[2]["prompt_tokens"]


def test_a_damaged_snapshot_starts_the_server_cold_and_says_why(
    tiny: LlamaModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    snapshot = tmp_path / "snap"
    first = PrefixCachingRunner(tiny, cache_tokens=4096)
    app = create_app(first, model_name="tiny", snapshot_dir=snapshot)
    with start_background(app) as server:
        turn(server.url, [{"role": "user", "content": "hello there"}])
    assert app.state.snapshots.last_saved.num_tokens > 0
    version = snapshot / (snapshot / "CURRENT").read_text().strip()
    (version / "snapshot.json").write_text((version / "snapshot.json").read_text().replace('"clock":', '"clock":7'))

    runner = PrefixCachingRunner(tiny, cache_tokens=4096)
    app = create_app(runner, model_name="tiny", snapshot_dir=snapshot)
    with caplog.at_level(logging.WARNING, "prefixcache.serve.snapshots"), start_background(app) as server:
        usage = turn(server.url, [{"role": "user", "content": "hello there"}])

    assert "starting with an empty cache" in caplog.text and "checksum" in caplog.text
    assert app.state.snapshots.restored is None and "checksum" in app.state.snapshots.restore_error
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_snapshot_every_saves_while_the_server_runs(tiny: LlamaModel, tmp_path: Path) -> None:
    runner = PrefixCachingRunner(tiny, cache_tokens=4096)
    app = create_app(runner, model_name="tiny", snapshot_dir=tmp_path / "snap", snapshot_every_s=0.2)
    with start_background(app) as server:
        usage = turn(server.url, [{"role": "user", "content": "remember this prompt"}])
        keeper = app.state.snapshots
        deadline = time.monotonic() + 30
        while (keeper.last_saved is None or keeper.last_saved.num_tokens == 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert keeper.restore_error is not None and keeper.restored is None  # nothing to restore at first
        assert keeper.last_saved.num_tokens >= usage["prompt_tokens"]
        fresh = PrefixCachingRunner(tiny, cache_tokens=4096)
        assert fresh.load_snapshot(tmp_path / "snap").num_tokens >= usage["prompt_tokens"]


def test_snapshot_every_needs_a_snapshot_folder(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--snapshot-every", "5"]) == 2
    assert "--snapshot-every needs --snapshot" in capsys.readouterr().err


@pytest.mark.parametrize("minutes", ["0.01", "inf", "nan", "0"])
def test_snapshot_every_below_six_seconds_or_not_finite_is_refused(
    minutes: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--snapshot", str(tmp_path / "snap"), "--snapshot-every", minutes]) == 2
    assert "a finite number of minutes, at least 0.1 (a save writes every cached block" in capsys.readouterr().err
    assert not (tmp_path / "snap").exists()


def test_a_snapshot_folder_that_is_a_file_is_refused_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "snap").write_text("a file")
    assert main(["serve", "--snapshot", str(tmp_path / "snap")]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err


def test_create_app_refuses_a_snapshot_folder_that_is_a_file(tiny: LlamaModel, tmp_path: Path) -> None:
    (tmp_path / "snap").write_text("a file")
    with pytest.raises(InvalidArgumentError, match="is a file, not a folder"):
        create_app(PrefixCachingRunner(tiny, cache_tokens=4096), model_name="tiny", snapshot_dir=tmp_path / "snap")


@pytest.fixture
def serve_in_background(monkeypatch: pytest.MonkeyPatch) -> dict:
    """``main(["serve", ...])`` on a real server in a thread: one chat turn, then a clean shutdown (which saves).
    Records the app, what its cache held before the turn, the turn's usage and what was announced."""
    import prefixcache.serve

    seen: dict = {}

    def serve_forever(app, host, port, *, log_level, announce) -> None:
        with start_background(app) as server:
            announce(server.url)
            seen.update(app=app, cached_before=app.state.runner.cache.stats().cached_tokens)
            seen["usage"] = turn(server.url, [{"role": "user", "content": "hello there, agent"}])

    monkeypatch.setattr(prefixcache.serve, "serve_forever", serve_forever)
    return seen


def _resign(folder: Path, edit) -> None:
    """Edit the current manifest and recompute its checksum: a snapshot written wrong, which checksums pass."""
    import json

    from prefixcache.cache.snapshot.folder import canonical, digest

    path = folder / (folder / "CURRENT").read_text().strip() / "snapshot.json"
    document = json.loads(path.read_text())
    edit(document["manifest"])
    document["checksum"]["xxh3_128"] = digest(canonical(document["manifest"]))
    path.write_text(json.dumps(document))


EDITS = {
    "float_namespace_index": lambda m: m["nodes"][0].update(namespace=0.0),
    "node_without_origin": lambda m: m["nodes"][0].pop("origin"),
    "one_block_twice": lambda m: m["nodes"][0]["blocks"].__setitem__(-1, m["nodes"][0]["blocks"][0]),
}


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_serve_starts_cold_on_a_refused_snapshot_saying_why(
    serve_in_background: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys, edit
) -> None:
    snapshot = tmp_path / "snap"
    assert main(["serve", "--snapshot", str(snapshot), "--cache-tokens", "4096"]) == 0
    assert serve_in_background["app"].state.snapshots.last_saved.num_tokens > 0
    _resign(snapshot, edit)

    with caplog.at_level(logging.WARNING, "prefixcache.serve.snapshots"):
        code = main(["serve", "--snapshot", str(snapshot), "--cache-tokens", "4096"])

    assert code == 0 and "serving 'tiny' at" in capsys.readouterr().out
    keeper = serve_in_background["app"].state.snapshots
    assert keeper.restored is None and "malformed node" in keeper.restore_error
    assert "starting with an empty cache" in caplog.text and "malformed node" in caplog.text
    assert serve_in_background["cached_before"] == 0
    assert serve_in_background["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_snapshot_load_failing_with_any_error_starts_the_server_cold(
    tiny: LlamaModel, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = PrefixCachingRunner(tiny, cache_tokens=4096)
    first.generate(list(range(1, 40)))
    first.save_snapshot(tmp_path / "snap")
    runner = PrefixCachingRunner(tiny, cache_tokens=4096)

    def load_half_then_fail(directory):
        PrefixCachingRunner.load_snapshot(runner, directory)
        raise KeyError("origin")  # a bug a snapshot reached after the cache took part of it

    monkeypatch.setattr(runner, "load_snapshot", load_half_then_fail)
    app = create_app(runner, model_name="tiny", snapshot_dir=tmp_path / "snap")
    with caplog.at_level(logging.WARNING, "prefixcache.serve.snapshots"), start_background(app) as server:
        cached_before = runner.cache.stats().cached_tokens
        usage = turn(server.url, [{"role": "user", "content": "hello"}])

    assert cached_before == 0 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert "KeyError" in app.state.snapshots.restore_error and "starting with an empty cache" in caplog.text


def test_a_save_failing_with_any_error_is_logged_and_the_periodic_saves_and_shutdown_go_on(
    tiny: LlamaModel, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An error other than the snapshot and OS errors (a bug, a MemoryError copying the cache) once escaped
    # SnapshotKeeper.save: it ended the periodic saves for good, and at shutdown skipped closing the engine.
    runner = PrefixCachingRunner(tiny, cache_tokens=4096)
    failures: list[BaseException] = [KeyError("origin")]

    def capture_or_fail(staging=None):
        if failures:
            raise failures[0] if isinstance(failures[0], MemoryError) else failures.pop()
        return PrefixCachingRunner.capture_snapshot(runner, staging)

    monkeypatch.setattr(runner, "capture_snapshot", capture_or_fail)
    app = create_app(runner, model_name="tiny", snapshot_dir=tmp_path / "snap", snapshot_every_s=0.05)
    keeper = app.state.snapshots
    with caplog.at_level(logging.ERROR, "prefixcache.serve.snapshots"), start_background(app) as server:
        turn(server.url, [{"role": "user", "content": "remember this prompt"}])
        deadline = time.monotonic() + 30
        while keeper.last_saved is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert keeper.save_errors == 1 and keeper.last_saved is not None  # the saves after the failure ran
        failures.append(MemoryError())  # every save from now on fails, the shutdown's too
    assert "KeyError" in caplog.text and "MemoryError" in caplog.text
    with pytest.raises(InvalidArgumentError, match="closed"):
        app.state.engine.submit([1, 2, 3])


def test_a_restarted_server_with_a_hybrid_model_resumes_its_first_repeated_prompt(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")
    from prefixcache.models.hf import random_model_from_config
    from prefixcache.models.hf_tiny import tiny_hf_config

    folder = tmp_path / "tiny-mamba2"
    tiny_hf_config("mamba2", max_position_embeddings=4096).save_pretrained(folder)
    model = random_model_from_config(str(folder / "config.json"))
    snapshot = tmp_path / "snap"
    asked = [{"role": "system", "content": "You are a terse support agent for Acme."}]
    asked.append({"role": "user", "content": "Where is order 12?"})

    app = create_app(PrefixCachingRunner(model, cache_tokens=4096), model_name="tiny", snapshot_dir=snapshot)
    cold_chat, warm_chat = list(asked), list(asked)
    with start_background(app) as server:
        cold = turn(server.url, cold_chat)
    assert app.state.snapshots.last_saved.num_states > 0  # the recurrent states went to disk with the blocks

    app = create_app(PrefixCachingRunner(model, cache_tokens=4096), model_name="tiny", snapshot_dir=snapshot)
    with start_background(app) as server:
        warm = turn(server.url, warm_chat)
    assert warm_chat[-1]["content"] == cold_chat[-1]["content"]  # greedy, resumed from the restored state
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    # All but the prompt's last token, which is always computed: the state kept before it was restored.
    assert warm["prompt_tokens_details"]["cached_tokens"] == warm["prompt_tokens"] - 1
