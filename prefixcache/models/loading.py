"""One entry point for every kind of model: ``load_model("smollm2")``, ``load_model("path/to/model.gguf")``,
``load_model("hf:folder", dtype="bfloat16")``, ``load_model("tiny")`` (:mod:`.sources` says what each value means)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from prefixcache.models.sources import ModelSource, parse_dtype, resolve_model

__all__ = ["load_model", "load_source", "loading"]


def load_model(
    model: str | os.PathLike[str],
    dtype: str | torch.dtype | None = "auto",
    device: torch.device | str | None = None,
) -> Any:
    """The model ``model`` names, in ``dtype`` (``"auto"``: the checkpoint's own; float32 for an embedded preset and
    for a GGUF file, whose weights are dequantized) on ``device`` (None: CUDA when available, else the CPU).

    Raises:
        InvalidArgumentError: an unknown name or dtype, a missing path, ``smollm2`` not installed, a missing extra.
        UnsupportedModelError: an architecture or GGUF tensor type that cannot be served exactly.
    """
    return load_source(resolve_model(model), dtype, device)


def load_source(source: ModelSource, dtype: str | torch.dtype | None = "auto", device: Any = None) -> Any:
    """The model of an already resolved ``source`` (:func:`load_model`, for callers that resolved it first to
    choose a tokenizer or a name).  Raises as :func:`load_model`."""
    chosen = parse_dtype(dtype)
    if source.kind == "preset":
        from prefixcache.models.llama import build_model

        return build_model(source.location, dtype=chosen or torch.float32, device=device)
    if source.kind == "gguf":
        from prefixcache.models.gguf import load_gguf_model

        return load_gguf_model(source.location, chosen, device)
    from prefixcache.models.hf import load_hf_model

    return load_hf_model(source.location, chosen, device)


def loading(source: ModelSource | None) -> contextlib.AbstractContextManager[None]:
    """The context to load ``source``'s model and tokenizer in: for a GGUF file, one where its header is parsed once
    for both (:func:`~prefixcache.models.gguf.reading_gguf`; SmolLM2's tokenizer then loads in under a second instead of
    about 5 s); a no-op otherwise."""
    if source is None or source.kind != "gguf":
        return contextlib.nullcontext()
    from prefixcache.models.gguf import reading_gguf

    return reading_gguf()
