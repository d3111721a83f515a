"""The precisions a benchmark runs a model at (``prefixcache bench --precision``): a dtype for the weights, norms and
K/V pool, and a weight-only quantization of the linear layers (:mod:`prefixcache.models.quantize`), as ``serve
--dtype D --quantize Q`` loads a model.  ``int8`` and ``int4`` alone keep float32 (``--dtype auto`` for presets and
GGUF files); ``bfloat16+int8`` names both.  Each has llama.cpp's GGUF type of the same class (:attr:`gguf_type`:
F32, BF16, Q8_0, Q4_0), the file that ``bench llamacpp`` gives llama.cpp's server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixcache.errors import InvalidArgumentError

__all__ = ["PRECISION_NAMES", "Precision", "parse_precision"]

PRECISION_NAMES = ("float32", "bfloat16", "int8", "int4", "bfloat16+int8", "bfloat16+int4")
"""The values of ``--precision`` (``prefixcache.cli.bench`` keeps a copy, so that ``--help`` imports no torch; a
test keeps the two equal)."""

_DTYPES = ("float32", "bfloat16")
_GGUF_TYPES = {"none": None, "int8": "Q8_0", "int4": "Q4_0"}


@dataclass(frozen=True, slots=True)
class Precision:
    """``dtype``: ``"float32"`` or ``"bfloat16"`` (weights left dense, norms, activations, K/V); ``quantize``:
    ``"none"``, ``"int8"`` or ``"int4"``."""

    dtype: str
    quantize: str = "none"

    @property
    def name(self) -> str:
        """The ``--precision`` value: ``"float32"``, ``"int8"`` (float32 implied), ``"bfloat16+int4"``, ..."""
        if self.quantize == "none":
            return self.dtype
        return self.quantize if self.dtype == "float32" else f"{self.dtype}+{self.quantize}"

    @property
    def torch_dtype(self) -> Any:
        """The dtype as a ``torch.dtype`` (torch imported here, not at the command line's parse)."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def gguf_type(self) -> str:
        """llama.cpp's file type of the same class: ``"F32"``, ``"BF16"``, ``"Q8_0"`` (int8), ``"Q4_0"`` (int4)."""
        return _GGUF_TYPES[self.quantize] or {"float32": "F32", "bfloat16": "BF16"}[self.dtype]

    def apply(self, model: Any) -> Any:
        """``model`` (built in :attr:`torch_dtype`) quantized in place to :attr:`quantize` where not ``"none"``;
        returned.  Raises InvalidArgumentError as the model's ``quantize`` (not on the CPU, already quantized)."""
        if self.quantize != "none":
            model.quantize(self.quantize)
        return model


def parse_precision(text: str) -> Precision:
    """One of :data:`PRECISION_NAMES` as a :class:`Precision`.  Raises InvalidArgumentError for any other text."""
    if text not in PRECISION_NAMES:
        raise InvalidArgumentError(f"unknown precision {text!r}; choose from {', '.join(PRECISION_NAMES)}")
    if "+" in text:
        dtype, mode = text.split("+")
    elif text in _DTYPES:
        dtype, mode = text, "none"
    else:
        dtype, mode = "float32", text
    return Precision(dtype, mode)
