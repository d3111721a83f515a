"""``--model hf:PATH`` runs with the model folder's own tokenizer and chat template (issue 29): in ``replay`` and
``serve``, unless ``--tokenizer`` is given; both say which tokenizer they use, and the byte tokenizer in front of a
model whose vocabulary is not byte-level is warned about."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.cli import main
from prefixcache.cli.tokenizer_choice import BYTE_VOCAB_SIZE, byte_vocab_warning, choose_tokenizer
from prefixcache.models.sources import resolve_model

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "scenarios" / "multi_turn_chat.jsonl"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json")


def save_tiny_model(folder: Path, vocab_size: int) -> Path:
    """A 1-layer hidden-64 random Qwen2 of ``vocab_size`` ids saved as a model folder (config + weights only)."""
    from prefixcache.models.hf_tiny import tiny_random_model

    tiny_random_model("qwen2", vocab_size=vocab_size, layers=1, max_positions=4096).model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def qwen_model_dir(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 saved with the real Qwen2.5 tokenizer files (and its chat template) beside its weights."""
    pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    folder = save_tiny_model(tmp_path_factory.mktemp("models") / "qwen-tiny", HFTokenizer(qwen_dir).vocab_size)
    for name in TOKENIZER_FILES:
        shutil.copy(qwen_dir / name, folder / name)
    return folder


def replay_json(tmp_path: Path, *args: object) -> dict:
    out = tmp_path / "report.json"
    assert main(["replay", str(CHAT), "--limit", "1", "--json", str(out), *map(str, args)]) == 0
    return json.loads(out.read_text())


def test_replay_of_a_model_folder_tokenizes_with_the_folders_own_tokenizer(
    qwen_model_dir: Path, qwen_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixcache.chat.hf_tokenizer import HFTokenizer
    from prefixcache.replay.replayer import load_requests

    report = replay_json(tmp_path, "--model", f"hf:{qwen_model_dir}")
    out, err = capsys.readouterr()

    requests, _ = load_requests(CHAT, HFTokenizer(qwen_dir), limit=1)
    assert report["requests"] == len(requests) == 5
    assert report["prompt_tokens"] == sum(len(r.prompt) for r in requests)
    byte_tokens = sum(len(r.prompt) for r in load_requests(CHAT, ByteTokenizer(), limit=1)[0])
    assert report["prompt_tokens"] < byte_tokens / 2  # BPE, not bytes
    assert err.startswith(f"loading tokenizer {qwen_model_dir} (the model folder's own) ...\n")
    assert "tokenizer: Qwen2Tokenizer:qwen-tiny:" in out
    assert "byte tokenizer" not in err


def test_tokenizer_overrides_the_model_folders_own(
    qwen_model_dir: Path, byte_bpe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prefixcache.chat.hf_tokenizer import HFTokenizer
    from prefixcache.replay.replayer import load_requests

    report = replay_json(tmp_path, "--model", f"hf:{qwen_model_dir}", "--tokenizer", byte_bpe_dir)

    requests, _ = load_requests(CHAT, HFTokenizer(byte_bpe_dir), limit=1)
    assert report["prompt_tokens"] == sum(len(r.prompt) for r in requests)
    assert capsys.readouterr().err.startswith(f"loading tokenizer {byte_bpe_dir} ...\n")


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict:
    """``main(["serve", ...])`` without a socket: the app it would have served."""
    import prefixcache.serve

    seen: dict = {}

    def serve_forever(app, host, port, *, log_level, announce) -> None:
        announce("http://127.0.0.1:1")
        seen.update(app=app)
        app.state.engine.close()

    monkeypatch.setattr(prefixcache.serve, "serve_forever", serve_forever)
    return seen


def test_serve_of_a_model_folder_uses_its_tokenizer_and_says_so(
    served: dict, qwen_model_dir: Path, byte_bpe_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("fastapi", reason="needs: pip install 'prefixcache[server]'")
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    assert main(["serve", "--model", f"hf:{qwen_model_dir}"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    tokenizer = served["app"].state.runner.tokenizer

    assert line.endswith(f"; tokenizer {qwen_model_dir} (the model folder's own))")
    assert tokenizer.vocab_size == 151_665  # the engine process's tokenizer, sent back to the server
    assert tokenizer.encode("Hello world") == [9707, 1879]  # Qwen2.5's ids, not bytes

    assert main(["serve", "--model", f"hf:{qwen_model_dir}", "--tokenizer", str(byte_bpe_dir)]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(f"; tokenizer {byte_bpe_dir})")
    assert served["app"].state.runner.tokenizer.name == HFTokenizer(byte_bpe_dir).name


def test_a_model_folder_without_a_tokenizer_replays_bytes_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")
    folder = save_tiny_model(tmp_path / "no-tokenizer", 300)
    with caplog.at_level(logging.WARNING):
        report = replay_json(tmp_path, "--model", f"hf:{folder}")

    assert report["prompt_tokens"] == sum(len(r.prompt) for r in load_byte_requests())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"--model hf:{folder} (no tokenizer in the folder) runs with the byte tokenizer, but its vocabulary has 300 "
        "ids, not the byte tokenizer's 259: prompts become UTF-8 byte ids that the model reads as other tokens, and "
        "its answers decode to mojibake; give the model's tokenizer with --tokenizer PATH"
    ]


def load_byte_requests() -> list:
    from prefixcache.replay.replayer import load_requests

    return load_requests(CHAT, ByteTokenizer(), limit=1)[0]


def test_the_embedded_presets_and_a_byte_level_vocabulary_are_not_warned_about(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    with caplog.at_level(logging.WARNING):
        replay_json(tmp_path)  # the tiny preset: 512 ids, the byte tokenizer's 259 among them
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert byte_vocab_warning("hf:/m", False, None, BYTE_VOCAB_SIZE) is None
    assert byte_vocab_warning("small", True, None, 512) is None
    assert "--model-config c.json runs with the byte tokenizer" in byte_vocab_warning("tiny", True, "c.json", 151_936)
    assert "--model /m (no tokenizer in the folder)" in byte_vocab_warning("/m", False, None, 512)


def test_the_byte_vocabulary_written_down_is_the_byte_tokenizers() -> None:
    assert BYTE_VOCAB_SIZE == ByteTokenizer().vocab_size


def test_choose_tokenizer_prefers_tokenizer_then_the_model_folder(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    assert choose_tokenizer("tok", resolve_model(f"hf:{tmp_path}")).path == "tok"
    folder = choose_tokenizer(None, resolve_model(f"hf:{tmp_path}"))
    assert (folder.path, folder.from_model_folder) == (str(tmp_path), True)
    assert folder.describe() == f"{tmp_path} (the model folder's own)"
    (tmp_path / "tokenizer.json").unlink()
    assert choose_tokenizer(None, resolve_model(str(tmp_path))).path is None
    assert choose_tokenizer(None, resolve_model("tiny")).describe() == "byte-level (embedded ChatML)"
    assert choose_tokenizer(None, None).path is None
