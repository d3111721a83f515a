"""The last decoder layer's MLP on the last position only, for a Hugging Face forward that keeps one position's logits.

A cold prefill of ``n`` tokens needs every layer's K/V at all ``n`` positions, but, when only the last position's
logits are sampled, the last layer's MLP only at that position: its output reaches nothing but the final norm and the
LM head.  The embedded model slices its last layer so (``LlamaModel._forward``); :func:`last_position_mlp` does the
same to a transformers model from outside, with a forward pre-hook on that MLP.  Qwen2.5-0.5B cut to 4 layers, 1,024
tokens: 27 of 130 GFLOP saved, the HF adapter's cold prefill 560 -> 447 ms on this project's Intel 2-core machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from prefixcache.models.hf_support import LLAMA_FAMILY_TYPES

__all__ = ["LAST_POSITION_MLP_TYPES", "last_layer_mlp", "last_position_mlp"]

LAST_POSITION_MLP_TYPES = LLAMA_FAMILY_TYPES
"""``config.model_type`` values whose last decoder layer adds its MLP's output to the residual row by row
(``h = h + mlp(norm(h))``), so that MLP may run on the last position alone when only its logits are kept."""


def last_layer_mlp(base: torch.nn.Module, config: Any) -> torch.nn.Module | None:
    """The MLP of the last decoder layer of ``base`` (a transformers base model) where :func:`last_position_mlp`
    applies: a model type of :data:`LAST_POSITION_MLP_TYPES`, ``base.layers[-1].mlp`` a dense ``*MLP`` module (not a
    mixture of experts); else None."""
    if getattr(config, "model_type", None) not in LAST_POSITION_MLP_TYPES:
        return None
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        return None
    mlp = getattr(layers[-1], "mlp", None)
    return mlp if isinstance(mlp, torch.nn.Module) and type(mlp).__name__.endswith("MLP") else None


@contextmanager
def last_position_mlp(mlp: torch.nn.Module | None) -> Iterator[None]:
    """Within the block, ``mlp`` (from :func:`last_layer_mlp`; None: nothing changes) runs on the last position of
    its input ``[B, n, hidden]`` only, ``[B, 1, hidden]``; the layer's residual add broadcasts that row over all
    ``n``, so only the last position's hidden state (the one the LM head reads) is right.  The K/V of every
    position are computed before the MLP, as always.  Saves the last layer's MLP on ``n - 1`` positions (Qwen2.5-0.5B,
    4 layers, 1,024 tokens: 27 of 130 GFLOP), as the embedded model does (``LlamaModel._forward``).  The hook is
    removed on leaving, exception or not.
    """
    if mlp is None:
        yield
        return
    handle = mlp.register_forward_pre_hook(_last_position)
    try:
        yield
    finally:
        handle.remove()


def _last_position(_module: torch.nn.Module, args: tuple) -> tuple | None:
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 3:
        return None
    return (args[0][:, -1:], *args[1:])
