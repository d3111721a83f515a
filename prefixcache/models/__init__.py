"""Models prefix caching can drive: the :class:`CausalLM` protocol and the embedded seeded Llama.

The names below are imported on first use (:pep:`562`): they import torch, and the submodules that do not
(:mod:`prefixcache.models.sources`, which resolves ``--model``) are imported without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    **dict.fromkeys(
        (
            "BatchRow",
            "CausalLM",
            "LiveKV",
            "ModelConfig",
            "check_cached_call",
            "check_live",
            "check_reference_call",
            "config_fingerprint",
            "forward_batch",
            "kv_pool_shape",
            "num_blocks_for",
        ),
        "prefixcache.models.base",
    ),
    **dict.fromkeys(("ARCHITECTURE", "PRESETS", "LlamaModel", "build_model"), "prefixcache.models.llama"),
}
"""Name -> the submodule it is taken from on first use."""

if TYPE_CHECKING:
    from prefixcache.models.base import (
        BatchRow,
        CausalLM,
        LiveKV,
        ModelConfig,
        check_cached_call,
        check_live,
        check_reference_call,
        config_fingerprint,
        forward_batch,
        kv_pool_shape,
        num_blocks_for,
    )
    from prefixcache.models.llama import ARCHITECTURE, PRESETS, LlamaModel, build_model


def __getattr__(name: str) -> Any:
    """A name of the package, imported on first use (and kept); AttributeError for any other name."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prefixcache.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "ARCHITECTURE",
    "BatchRow",
    "PRESETS",
    "CausalLM",
    "LiveKV",
    "LlamaModel",
    "ModelConfig",
    "build_model",
    "check_cached_call",
    "check_live",
    "check_reference_call",
    "config_fingerprint",
    "forward_batch",
    "kv_pool_shape",
    "num_blocks_for",
]
