"""One entry point for every kind of model: ``load_model("smollm2")``, ``load_model("path/to/model.gguf")``,
``load_model("hf:folder", dtype="bfloat16")``, ``load_model("tiny")`` (:mod:`.sources` says what each value means),
``load_model("smollm2", quantize="int8")`` (:mod:`.quantize`)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from prefixcache.host_allocator import release_freed_host_memory
from prefixcache.models.quantize import parse_quantize
from prefixcache.models.sources import ModelSource, parse_dtype, resolve_model

__all__ = ["load_model", "load_source", "loading", "require_hf"]


def load_model(
    model: str | os.PathLike[str],
    dtype: str | torch.dtype | None = "auto",
    device: torch.device | str | None = None,
    quantize: str | None = "none",
) -> Any:
    """The model ``model`` names, in ``dtype`` (``"auto"``: the checkpoint's own; float32 for an embedded preset and
    for a GGUF file, whose weights are dequantized) on ``device`` (None: CUDA when available, else the CPU), its
    linear layers' weights quantized once to ``quantize`` (``"int8"``, ``"int4"``; ``"none"`` or None: not), the
    activations staying in ``dtype`` (:mod:`~prefixcache.models.quantize`).

    Raises:
        InvalidArgumentError: an unknown name, dtype or quantization, a missing path, ``smollm2`` not installed, a
            missing extra, quantization on a device other than the CPU.
        UnsupportedModelError: an architecture or GGUF tensor type that cannot be served exactly.
    """
    return load_source(resolve_model(model), dtype, device, quantize)


def load_source(
    source: ModelSource, dtype: str | torch.dtype | None = "auto", device: Any = None, quantize: str | None = "none"
) -> Any:
    """The model of an already resolved ``source`` (:func:`load_model`, for callers that resolved it first to
    choose a tokenizer or a name).  Raises as :func:`load_model`."""
    mode = parse_quantize(quantize)
    model = _load_dense(source, dtype, device)
    if mode != "none":
        model.quantize(mode)  # gives the freed heap back itself
    else:
        release_freed_host_memory()  # what loading freed (a GGUF file's dequantization temporaries)
    return model


def _load_dense(source: ModelSource, dtype: str | torch.dtype | None, device: Any) -> Any:
    chosen = parse_dtype(dtype)
    if source.kind != "preset":
        require_hf(source)
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
    require_hf(source)
    from prefixcache.models.gguf import reading_gguf

    return reading_gguf()


def require_hf(source: ModelSource) -> None:
    """Refuse ``source`` (a GGUF file or a Hugging Face folder) unless the ``hf`` extra's packages are installed (a
    GGUF file also needs ``gguf`` and ``accelerate``).  Raises :class:`InvalidArgumentError` naming the missing
    packages and the one command that installs them all."""
    import importlib.util

    from prefixcache.errors import InvalidArgumentError, install_command

    needed = ("transformers", "gguf", "accelerate") if source.kind == "gguf" else ("transformers",)
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        what = "GGUF files" if source.kind == "gguf" else "Hugging Face models"
        raise InvalidArgumentError(f"{what} need {', '.join(missing)}: {install_command('hf')}")
