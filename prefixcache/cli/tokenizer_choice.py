"""Which tokenizer ``replay`` and ``serve`` run with: ``--tokenizer PATH``, else the tokenizer of a ``--model hf:PATH``
folder that holds one, else the embedded byte tokenizer (with its ChatML template); and the warning when the byte
tokenizer meets a model whose vocabulary is not byte-level (the prompt becomes byte ids that the model reads as
other tokens, and its answer decodes to mojibake).

Nothing here imports torch or transformers: the choice is made from file names before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["BYTE_VOCAB_SIZE", "TokenizerChoice", "byte_vocab_warning", "choose_tokenizer", "has_tokenizer_files"]

BYTE_VOCAB_SIZE = 259
"""``prefixcache.chat.tokenizer.ByteTokenizer().vocab_size`` (a test keeps the two equal): 256 bytes and 3 ChatML
specials."""


@dataclass(frozen=True, slots=True)
class TokenizerChoice:
    """The tokenizer a command loads: a Hugging Face folder (``path``), or the byte tokenizer (``path`` None).
    ``from_model_folder``: ``path`` is the ``--model hf:PATH`` folder itself, not a ``--tokenizer``."""

    path: str | None
    from_model_folder: bool = False

    def describe(self) -> str:
        """What a start line says: ``byte-level (embedded ChatML)``, ``PATH`` or ``PATH (the model folder's own)``."""
        if self.path is None:
            return "byte-level (embedded ChatML)"
        return f"{self.path} (the model folder's own)" if self.from_model_folder else self.path


def has_tokenizer_files(folder: str | Path) -> bool:
    """Whether ``folder`` holds a Hugging Face tokenizer: ``tokenizer.json``, ``vocab.json`` + ``merges.txt``, or a
    sentencepiece ``tokenizer.model``.  O(1) file checks; False for a missing folder."""
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file():
        return True
    return (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()


def choose_tokenizer(tokenizer: str | None, model: str | None) -> TokenizerChoice:
    """``--tokenizer`` when given; else the folder of ``--model hf:PATH`` when it holds a tokenizer
    (:func:`has_tokenizer_files`); else the byte tokenizer.  ``model`` is the ``--model`` value (None: no model)."""
    if tokenizer:
        return TokenizerChoice(tokenizer)
    if model and model.startswith("hf:") and has_tokenizer_files(model[3:]):
        return TokenizerChoice(model[3:], from_model_folder=True)
    return TokenizerChoice(None)


def byte_vocab_warning(model: str, model_config: str | None, vocab_size: int) -> str | None:
    """The warning for the byte tokenizer in front of the model of ``--model`` / ``--model-config`` with ``vocab_size``
    ids, or None: for an embedded preset (byte-level by construction) and for a vocabulary of exactly
    :data:`BYTE_VOCAB_SIZE` ids."""
    if model_config:
        label = f"--model-config {model_config}"
    elif model.startswith("hf:"):
        label = f"--model {model} (no tokenizer in the folder)"
    else:
        return None
    if vocab_size == BYTE_VOCAB_SIZE:
        return None
    return (
        f"{label} runs with the byte tokenizer, but its vocabulary has {vocab_size:,} ids, not the byte "
        f"tokenizer's {BYTE_VOCAB_SIZE}: prompts become UTF-8 byte ids that the model reads as other tokens, and "
        "its answers decode to mojibake; give the model's tokenizer with --tokenizer PATH"
    )
