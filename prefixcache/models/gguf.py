"""GGUF files (llama.cpp's format) as Hugging Face models: ``--model PATH.gguf``, ``--model smollm2``.

The file is read by transformers' own GGUF loader (``from_pretrained(folder, gguf_file=NAME)``, which uses the
``gguf`` package to parse the metadata and dequantize the tensors, maps llama.cpp's tensor names to the architecture's
and undoes llama.cpp's rotary row permutation of Q and K), then wrapped in
:class:`~prefixcache.models.hf.HFCausalLM` like any checkpoint.  The weights are dequantized once at load: to float32
(``dtype=None``, transformers' choice, for quantized and F16 / BF16 files alike: the dequantized values exactly), or
to ``dtype`` when given.  The tokenizer and chat template in the same file are read by
:class:`~prefixcache.chat.hf_tokenizer.HFTokenizer`.

Architectures: those transformers reads from GGUF (Llama, Mistral, Qwen2/3, Qwen2-MoE, Phi-3, Gemma 2/3, ...) that
the adapter serves exactly; others are :class:`UnsupportedModelError` naming the GGUF architecture.  A tensor type the
``gguf`` package cannot dequantize is :class:`UnsupportedModelError` naming the type.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from prefixcache.errors import InvalidArgumentError, UnsupportedModelError, install_command
from prefixcache.models.base import resolve_device

__all__ = ["gguf_architecture", "load_gguf_model", "reading_gguf"]


_lock = threading.RLock()
_memo: dict[str, dict[Any, Any]] | None = None


@contextlib.contextmanager
def reading_gguf() -> Iterator[None]:
    """Within it, each GGUF file's header is parsed once, however many times transformers opens it.

    transformers reads a file's header once for the config, once for the weights and once for the tokenizer, and
    builds llama.cpp's tensor-name map once per module of the model; each header parse of SmolLM2-135M (its 49,152
    vocabulary strings) takes about 6 s in the ``gguf`` package, and the maps 7 s in all.  This swaps the package's
    ``GGUFReader`` and ``get_tensor_name_map`` and transformers' metadata-only ``load_gguf_checkpoint`` (all imported
    from their modules at each call) for memoised ones (the metadata handed out as a copy), and puts them back on
    exit: loading SmolLM2's model and tokenizer drops from about 40 s to about 10.  Reentrant
    (an inner use shares the outer memo); holds a lock, so loads in two threads take turns.  The memo (parsed headers,
    memory-mapped files) is dropped on the outermost exit.
    """
    global _memo
    import gguf

    with _lock:
        if _memo is not None:
            yield
            return
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        real_reader, real_map, real_checkpoint = (
            gguf.GGUFReader,
            gguf.get_tensor_name_map,
            gguf_utils.load_gguf_checkpoint,
        )
        _memo = {"readers": {}, "maps": {}, "headers": {}}
        readers, maps, headers = _memo["readers"], _memo["maps"], _memo["headers"]

        def reader(path: Any, mode: str = "r") -> Any:
            key = (os.path.realpath(os.fspath(path)), mode)
            if key not in readers:
                readers[key] = real_reader(path, mode)
            return readers[key]

        def name_map(arch: Any, n_blocks: int) -> Any:
            if (arch, n_blocks) not in maps:
                maps[arch, n_blocks] = real_map(arch, n_blocks)
            return maps[arch, n_blocks]

        def checkpoint(path: Any, return_tensors: bool = False, *args: Any, **kwargs: Any) -> Any:
            if return_tensors or args or kwargs:
                return real_checkpoint(path, return_tensors, *args, **kwargs)
            key = os.path.realpath(os.fspath(path))
            if key not in headers:
                headers[key] = real_checkpoint(path, False)
            return copy.deepcopy(headers[key])  # its callers edit the dicts they get

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        gguf_utils.load_gguf_checkpoint = checkpoint
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map
            gguf_utils.load_gguf_checkpoint = real_checkpoint
            _memo = None


def gguf_architecture(path: str | os.PathLike[str]) -> str:
    """The ``general.architecture`` of the GGUF file at ``path`` (``"llama"``, ``"qwen2"``), read from its header
    (memory-mapped; O(metadata)).  Raises :class:`InvalidArgumentError` for a file that is not GGUF."""
    reader = _reader(path)
    field = reader.fields.get("general.architecture")
    if field is None:
        raise InvalidArgumentError(f"{os.fspath(path)!r}: GGUF file without general.architecture")
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def load_gguf_model(
    path: str | os.PathLike[str], dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Any:
    """Load the GGUF file at ``path`` into an :class:`~prefixcache.models.hf.HFCausalLM`, its weights dequantized
    to ``dtype`` (None: float32, whatever the file's types).  Takes about 10 s for SmolLM2-135M's 98 MB Q4_1 file on
    two cores (the dequantization runs in numpy).

    Raises:
        InvalidArgumentError: no such file, not a GGUF file, or the ``gguf`` / ``accelerate`` packages missing (the
            message gives the install command).
        UnsupportedModelError: transformers has no GGUF mapping for the file's architecture, the ``gguf`` package
            cannot dequantize one of its tensor types, a tensor's shape does not fit the architecture, a weight is
            missing (but a tied LM head), or the adapter refuses the architecture.
    """
    from transformers import AutoModelForCausalLM, GgufConfig

    from prefixcache.models.hf import HFCausalLM

    file = Path(path)
    if not file.is_file():
        raise InvalidArgumentError(f"GGUF file {str(file)!r} does not exist")
    try:
        with reading_gguf(), _quiet_transformers():
            _reader(file)  # a file that is not GGUF is named here, before transformers fails on it less clearly
            model = AutoModelForCausalLM.from_pretrained(
                str(file.parent),
                gguf_file=file.name,
                dtype=dtype if dtype is not None else "auto",
                # Plain dense weights, always: packed GGUF layers (transformers' kernels path) are not what the
                # adapter's exactness was tested on.  Quantized decode is the engine's job, not this loader's.
                quantization_config=GgufConfig(dequantize=True),
                local_files_only=True,
                output_loading_info=True,
            )
    except NotImplementedError as error:  # gguf's dequantize for a type it lacks
        raise UnsupportedModelError(f"{file.name}: {error}") from None
    except (RuntimeError, KeyError, IndexError, TypeError) as error:  # a tensor of the wrong shape, a short vocabulary
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnsupportedModelError(f"{file.name}: its tensors do not fit its architecture: {first}") from None
    except ValueError as error:
        text = str(error)
        if "accelerate" in text:
            raise InvalidArgumentError(f"loading a GGUF file needs accelerate: {install_command('hf')}") from None
        if "architecture" in text or "not supported" in text:
            raise UnsupportedModelError(
                f"{file.name}: GGUF architecture {gguf_architecture(file)!r} cannot be read by transformers: {text}"
            ) from None
        raise InvalidArgumentError(f"cannot load {str(file)!r}: {text}") from None
    model, info = model
    # A weight the file lacks would be left at its random initialisation: a model that answers noise.  A tied LM
    # head is the one weight a GGUF may leave out (llama.cpp then uses the token embedding).
    tied = model.config.tie_word_embeddings
    missing = [key for key in info.get("missing_keys", ()) if not (tied and key == "lm_head.weight")]
    if missing:
        raise UnsupportedModelError(f"{file.name} lacks weights its architecture needs: {_some(missing)}")
    # transformers re-initialises a weight whose shape differs from the architecture's, with a warning only.
    mismatched = [
        str(entry[0]) if isinstance(entry, tuple) else str(entry) for entry in info.get("mismatched_keys", ())
    ]
    if mismatched:
        raise UnsupportedModelError(f"{file.name}: its tensors do not fit its architecture: {_some(mismatched)}")
    return HFCausalLM(model.to(resolve_device(device)))


def _some(names: list[str]) -> str:
    """Up to five of ``names``, sorted, and how many more."""
    shown = ", ".join(sorted(names)[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' two progress bars of a GGUF load off (its own, and the tqdm of its GGUF module, which its
    switch does not reach): a user sees the command's start line, not bars of a step it does not name."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars, real_tqdm = hf_logging.is_progress_bar_enabled(), gguf_utils.tqdm
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(real_tqdm, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = real_tqdm
        if bars:
            hf_logging.enable_progress_bar()


def _reader(path: str | os.PathLike[str]) -> Any:
    try:
        import gguf
    except ImportError:
        raise InvalidArgumentError(f"reading GGUF files needs the gguf package: {install_command('hf')}") from None
    try:
        with reading_gguf():
            return gguf.GGUFReader(os.fspath(path))
    except (ValueError, OSError) as error:  # a bad magic number or a truncated header
        raise InvalidArgumentError(f"{os.fspath(path)!r} is not a readable GGUF file: {error}") from None
