"""``replay --sweep`` on the command line, and the token store that spares a rerun its tokenizing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.cli import main
from prefixcache.replay.requests import load_requests
from prefixcache.replay.token_store import cache_dir, load_requests_cached


def conversation(conversation_id: str, *turns: str) -> dict:
    roles = ["user", "assistant"] * len(turns)
    messages = [{"role": "system", "content": "You are a terse assistant for tests."}]
    return {
        "id": conversation_id,
        "messages": messages + [{"role": r, "content": t} for r, t in zip(roles, turns, strict=False)],
    }


@pytest.fixture
def chats(tmp_path: Path) -> Path:
    lines = [conversation(f"c{i}", f"question {i}?", f"answer {i} " * 5, "and then?", "the end " * i) for i in range(6)]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting its chat renderings."""

    def __init__(self) -> None:
        self.calls = 0

    def render_chat(self, *args, **kwargs):
        self.calls += 1
        return super().render_chat(*args, **kwargs)


def test_a_second_load_reads_the_stored_tokens_without_calling_the_tokenizer(chats: Path, tmp_path: Path):
    store = tmp_path / "store"
    first = CountingTokenizer()
    requests, skipped, stored = load_requests_cached(chats, first, directory=store)
    assert (stored, skipped) == (False, 0) and first.calls > 0
    again = CountingTokenizer()
    restored, skipped, stored = load_requests_cached(chats, again, directory=store)
    assert (stored, skipped, again.calls) == (True, 0, 0)
    assert [(r.conversation_id, r.turn, r.prompt, r.answer, r.drift_at) for r in restored] == [
        (r.conversation_id, r.turn, r.prompt, r.answer, r.drift_at) for r in requests
    ]
    assert restored == load_requests(chats, ByteTokenizer())[0]  # conversation is not compared


def test_an_edited_file_another_order_or_no_cache_tokenizes_again(chats: Path, tmp_path: Path):
    store = tmp_path / "store"
    load_requests_cached(chats, ByteTokenizer(), directory=store)
    for kwargs in ({"order": "file"}, {"use_cache": False}, {}):
        if not kwargs:
            chats.write_text(chats.read_text() + json.dumps(conversation("new", "hi", "hello")) + "\n")
        tokenizer = CountingTokenizer()
        _, _, stored = load_requests_cached(chats, tokenizer, directory=store, **kwargs)
        assert not stored and tokenizer.calls > 0, kwargs
    assert len(list(store.glob("*.npz"))) == 3  # the original, the file order, the edited file


def test_a_damaged_entry_is_tokenized_again_and_rewritten(chats: Path, tmp_path: Path):
    store = tmp_path / "store"
    load_requests_cached(chats, ByteTokenizer(), directory=store)
    (entry,) = store.glob("*.npz")
    entry.write_bytes(b"not a zip")
    tokenizer = CountingTokenizer()
    _, _, stored = load_requests_cached(chats, tokenizer, directory=store)
    assert not stored and tokenizer.calls > 0
    _, _, stored = load_requests_cached(chats, ByteTokenizer(), directory=store)
    assert stored


def _npy(entry: Path) -> None:
    np.save(entry.open("wb"), np.zeros(3))


def _wrong_meta(entry: Path) -> None:
    with np.load(entry) as stored:
        arrays = dict(stored)
    meta = json.loads(arrays["meta"].tobytes()) | {"ids": 5}
    np.savez(entry.open("wb"), **{**arrays, "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)})


@pytest.mark.parametrize(
    "damage",
    [lambda entry: entry.write_bytes(b""), _npy, _wrong_meta],
    ids=["empty-file", "an-npy-not-an-npz", "meta-of-wrong-types"],
)
def test_an_entry_damaged_in_any_way_is_tokenized_again(chats: Path, tmp_path: Path, damage):
    # An empty entry once failed the replay with numpy's EOFError, an .npy or a meta of the wrong types with a
    # TypeError: an entry that cannot be read is ignored, whatever is wrong with it.
    store = tmp_path / "store"
    load_requests_cached(chats, ByteTokenizer(), directory=store)
    (entry,) = store.glob("*.npz")
    damage(entry)
    tokenizer = CountingTokenizer()
    requests, _, stored = load_requests_cached(chats, tokenizer, directory=store)
    assert not stored and tokenizer.calls > 0
    assert requests == load_requests(chats, ByteTokenizer())[0]
    _, _, stored = load_requests_cached(chats, ByteTokenizer(), directory=store)
    assert stored


def test_the_store_lives_in_the_user_cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("PREFIXCACHE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "prefixcache" / "tokens"
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine" / "tokens"


def test_replay_sweep_prints_the_curve_writes_json_and_reuses_the_tokens(
    chats: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}))
    out = tmp_path / "sweep.json"
    argv = ["replay", str(chats), "--no-model", "--sweep", "--block-size", "4", "--json", str(out), "--check-knee"]
    assert main([*argv, "--model-config", str(config), "--kv-dtype", "fp16"]) == 0
    printed = capsys.readouterr()
    assert "knee (within 1 point of unlimited)" in printed.out and "KV bytes" in printed.out
    (sweep,) = json.loads(out.read_text())["sweeps"]
    assert sweep["requests"] == 12 and sweep["bytes_per_token"] == 2 * 2 * 4 * 16 * 2
    assert sweep["unlimited_hit_rate"] == pytest.approx(
        max(p["lru_hit_rate"] for p in sweep["points"])
    )  # the last point is the working set
    assert sweep["points"][-1]["capacity_tokens"] == sweep["working_set_tokens"]
    assert sweep["exact_at_knee"] is not None
    assert "token store" not in printed.err  # the first run tokenized
    assert main(argv) == 0
    assert "tokens read from the token store" in capsys.readouterr().err


def test_replay_sweep_at_a_size_reports_the_hit_rate_there(
    chats: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    from prefixcache.replay.sweep import sweep_lru

    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "sweep.json"
    argv = ["replay", str(chats), "--sweep", "--block-size", "4", "--json", str(out), "--no-progress"]
    assert main([*argv, "--sweep-at", "150", "--sweep-at", "1e2"]) == 0
    requests, _ = load_requests(chats, ByteTokenizer())
    curve = sweep_lru([(r.prompt, r.answer) for r in requests], 4)
    points = {p["capacity_tokens"]: p for p in json.loads(out.read_text())["sweeps"][0]["points"]}
    for tokens in (100, 152):  # 150 tokens is 38 whole blocks of 4
        assert points[tokens]["lru_hit_tokens"] == curve.hit_tokens(tokens // 4) > 0
        assert points[tokens]["lru_hit_rate"] == pytest.approx(curve.hit_rate(tokens // 4))
    assert f"|            152 | {100 * curve.hit_rate(38):.2f}%" in capsys.readouterr().out


def test_sweep_at_without_sweep_is_refused(chats: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["replay", str(chats), "--no-model", "--sweep-at", "8192"]) == 2
    assert "--sweep-at needs --sweep" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "option"), [(["--speculate", "tree"], "--speculate"), (["--verify-cost", "1,1.2"], "--verify-cost")]
)
def test_sweep_refuses_the_speculation_options_it_would_ignore(
    chats: Path, extra: list[str], option: str, capsys: pytest.CaptureFixture[str]
):
    assert main(["replay", str(chats), "--no-model", "--sweep", *extra]) == 2
    assert f"{option} predicts a replay's decoding; --sweep sizes the cache only" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "shown"), [(["--dtype", "int8"], "--dtype int8"), (["--quantize", "int4"], "--quantize int4")]
)
def test_a_precision_without_a_model_is_refused(
    chats: Path, extra: list[str], shown: str, capsys: pytest.CaptureFixture[str]
):
    assert main(["replay", str(chats), "--no-model", *extra]) == 2
    assert f"{shown} sets a model's precision: drop it with --no-model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--cache-tokens", "64"], "drop --cache-tokens"),
        (["--policy", "lfu"], "LFU"),
        (["--kv-dtype", "fp8"], "--kv-dtype needs --model-config"),
    ],
)
def test_replay_sweep_refuses_options_it_does_not_take(
    chats: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
):
    assert main(["replay", str(chats), "--no-model", "--sweep", *extra]) == 2
    assert message in capsys.readouterr().err


def test_replay_sweep_draws_the_curve(chats: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("PREFIXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    plot = tmp_path / "curve.png"
    assert main(["replay", str(chats), "--sweep", "--block-size", "4", "--plot", str(plot), "--no-progress"]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("tmp")] == []  # no temporary file left


def test_the_command_lines_kv_dtypes_are_the_sweeps() -> None:
    # The parser keeps its own list so that --help imports no torch; it must name exactly what the sweep sizes.
    from prefixcache.cli.replay import KV_DTYPE_CHOICES
    from prefixcache.replay.sweep_report import KV_DTYPES

    assert sorted(KV_DTYPE_CHOICES) == sorted(KV_DTYPES)


@pytest.mark.parametrize(
    ("lines", "older", "skip_invalid", "refusal"),
    [
        ("", 2, False, "empty.jsonl: empty file: no conversations or requests"),
        ('{"messages": 3}\n{bad\n', 3, True, "empty.jsonl: no valid request found"),
    ],
)
def test_an_entry_an_older_version_stored_for_a_file_of_no_requests_is_not_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: str, older: int, skip_invalid: bool, refusal: str
):
    from prefixcache.errors import ScenarioError
    from prefixcache.replay import token_store

    empty = tmp_path / "empty.jsonl"
    empty.write_text(lines)
    store = tmp_path / "store"
    options = {"order": "round-robin", "seed": 0, "limit": None, "skip_invalid": skip_invalid, "format": "chat"}
    read = {"directory": store, "file_format": "chat", "skip_invalid": skip_invalid}
    with monkeypatch.context() as before:  # what that version wrote for this file with --format chat: no requests
        before.setattr(token_store, "FORMAT_VERSION", older)
        token_store._write(token_store.entry_path(empty, ByteTokenizer().name, store, **options), [], 0)
        assert load_requests_cached(empty, ByteTokenizer(), **read) == ([], 0, True)

    assert token_store.FORMAT_VERSION > older
    with pytest.raises(ScenarioError, match=refusal):
        load_requests_cached(empty, ByteTokenizer(), **read)
