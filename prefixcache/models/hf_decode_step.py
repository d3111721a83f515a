"""A decode step of a Llama-family Hugging Face model run layer by layer by us, on the CPU.

A decode step multiplies one row by every weight, so on the CPU its products take the memory's time and everything
else is overhead.  transformers spends some of that overhead per layer in Python that a one-token step does not
need: each decoder layer's and attention module's forward wrappers (deprecated-argument handling, hub-kernel
dispatch), the attention function's lookup by name, per-call configuration reads, and the model's mask building.
:func:`decode_hidden` runs the same computation from the model's own modules (its norms, projections, MLPs and
rotary embedding are called as they are, so adapters inside them, LoRA for one, still apply) and leaves out those
layers of wrapping.  Measured on this project's 2-core Intel host, two threads, Qwen2.5-0.5B's 24 layers at 2,048
keys with every product replaced by a preallocated zero tensor (what is left is the overhead): 10.9-13.0 -> 8.4-9.9
ms a step, alternating in one process.

The step attends as :mod:`~prefixcache.models.hf_decode_attention` does (the one query grouped per KV head, one SDPA
call, the module's own ``scaling``) and applies rotary embeddings with the modeling file's own
``apply_rotary_pos_emb``, so its logits equal the model's own path under
:func:`~prefixcache.models.hf_decode_attention.grouped_decode` bit for bit.

It applies only where that holds by construction (:func:`decode_layers`): model types of
:data:`DECODE_STEP_TYPES`, transformers' own SDPA attention, every layer full attention (no sliding window shorter
than the model's positions), transformers' own decoder
layer and attention classes with their own forwards and no hooks on them, and a step of one token per row without
an attention mask.
Every other forward goes through the model as before.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from prefixcache.models.hf_decode_attention import sdpa_is_stock
from prefixcache.models.hf_support import LLAMA_FAMILY_TYPES
from prefixcache.models.linear import WeightPacks, project, tall_skinny_linears

__all__ = ["DECODE_STEP_TYPES", "decode_hidden", "decode_layers", "decode_logits"]

DECODE_STEP_TYPES = LLAMA_FAMILY_TYPES
"""``config.model_type`` values whose decoder layer is ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, with
attention ``q/k/v/o_proj``, rotary embeddings on Q and K (Qwen3: after its per-head ``q_norm``/``k_norm``) and no
other state: what :func:`decode_hidden` computes."""

_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
_ATTENTION_VALUES = ("head_dim", "scaling", "layer_idx")


_STOCK_FORWARDS: dict[int, tuple[Any, bool]] = {}
"""``id(function) -> (function, verdict)`` of :func:`_stock_forward`.  Keyed by id, checked by identity: a wrapt proxy
hashes and compares as the function it wraps, so a dictionary keyed by functions would answer for that one."""


def _stock_forward(function: Any) -> bool:
    """Whether ``function`` and every function it wraps (its ``__wrapped__`` chain) are plain functions whose code is in
    transformers' files, or in the ``kernels`` package, whose hub-kernel decorator transformers applies to some
    forwards.  A wrapper patched onto a class (``functools.wraps``) copies ``__module__`` from what it wraps, and a
    proxy (``wrapt``) forwards it: only the code's file tells a patch from the original.  Remembered per function."""
    known = _STOCK_FORWARDS.get(id(function))
    if known is not None and known[0] is function:
        return known[1]
    roots = tuple(
        os.path.dirname(package.__file__) + os.sep
        for package in (sys.modules.get("transformers"), sys.modules.get("kernels"))
        if getattr(package, "__file__", None)
    )
    current, depth = function, 0
    while type(current) is types.FunctionType and current.__code__.co_filename.startswith(roots) and depth < 16:
        current, depth = getattr(current, "__wrapped__", None), depth + 1
    _STOCK_FORWARDS[id(function)] = (function, current is None)
    return current is None


def _ours_to_skip(module: Any) -> bool:
    """Whether ``module``'s own forward may be skipped: transformers' own class with its own ``forward`` (not one
    patched onto the class, even a wrapper of the original, nor set on the instance, as patching libraries and users
    do), no forward hooks on it."""
    cls = type(module)
    return (
        cls.__module__.startswith("transformers.models.")
        and getattr(cls.forward, "__module__", None) == cls.__module__
        and _stock_forward(cls.forward)
        and "forward" not in module.__dict__
        and not module._forward_hooks
        and not module._forward_pre_hooks
    )


def _rotary_function(attention: Any) -> Any:
    """The ``apply_rotary_pos_emb`` of the attention module's own modeling file (as patched there, if it is), or
    None."""
    return getattr(sys.modules.get(type(attention).__module__), "apply_rotary_pos_emb", None)


def decode_layers(base: Any, config: Any) -> list[Any] | None:
    """The decoder layers of ``base`` (a transformers base model, ``model.model``) that :func:`decode_hidden` runs,
    or None where it does not apply: another model type, an attention implementation other than transformers' own
    SDPA (:func:`~prefixcache.models.hf_decode_attention.sdpa_is_stock`), a sliding-window layer or a window shorter
    than ``max_position_embeddings``, a base or layer or attention module that is not transformers' own class or
    carries forward hooks (whose forwards :func:`decode_hidden` would skip; global module hooks too), a rotary
    function kernelized on an attention module, or a missing part.  Checked at every step (a hook added later is
    seen): O(layers) dictionary reads, not ``nn.Module`` attribute lookups, each class's forward judged once (24
    layers: 70-135 us, where those lookups took 390)."""
    if getattr(config, "model_type", None) not in DECODE_STEP_TYPES:
        return None
    if getattr(config, "_attn_implementation", None) != "sdpa" or not sdpa_is_stock():
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        # A window as long as the model's positions cuts no key of any context it can hold.
        if window < getattr(config, "max_position_embeddings", float("inf")):
            return None
    if _global_forward_hooks or _global_forward_pre_hooks:
        return None
    modules = getattr(base, "_modules", None)
    if modules is None or not _ours_to_skip(base):
        return None
    if any(modules.get(name) is None for name in ("embed_tokens", "rotary_emb", "layers", "norm")):
        return None
    layers = list(modules["layers"]._modules.values())[: config.num_hidden_layers]
    for layer in layers:
        parts = layer._modules
        attention = parts.get("self_attn")
        if any(parts.get(name) is None for name in _LAYER_PARTS) or not (
            _ours_to_skip(layer) and _ours_to_skip(attention)
        ):
            return None
        if any(attention._modules.get(name) is None for name in _ATTENTION_MODULES):
            return None
        if any(attention.__dict__.get(name) is None for name in _ATTENTION_VALUES):
            return None
        # kernels.kernelize gives the attention's private rotary wrapper an instance forward, which only the
        # attention's own forward calls: the step calls the modeling file's function, so it declines.
        if any("forward" in wrapper.__dict__ for wrapper in attention.__dict__.get("_kernel_funcs", {}).values()):
            return None
    if layers and _rotary_function(layers[0].self_attn) is None:
        return None
    return layers


def decode_hidden(
    base: Any, layers: list[Any], cache: Any, input_ids: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """The final-normed hidden state ``[B, 1, hidden]`` of one decode step: ``input_ids[B, 1]`` at
    ``position_ids[B, 1]``, every row attending all its cached keys (no mask: the caller has none), the new K/V
    appended to ``cache`` through ``cache.update`` as transformers' attention does.  ``layers`` from
    :func:`decode_layers`.  Raises what the model's modules raise."""
    x = base.embed_tokens(input_ids)
    cos, sin = base.rotary_emb(x, position_ids)  # [B, 1, D]
    batch = x.shape[0]
    rotate = _rotary_function(layers[0].self_attn) if layers else None
    for layer in layers:
        attention = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (batch, 1, -1, attention.head_dim)
        q, k = attention.q_proj(h).view(shape), attention.k_proj(h).view(shape)
        if getattr(attention, "q_norm", None) is not None:  # Qwen3: per-head norms before the rotation
            q, k = attention.q_norm(q), attention.k_norm(k)
        q, k = rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # the model's own function
        v = attention.v_proj(h).view(shape).transpose(1, 2)
        keys, values = cache.update(k, v, attention.layer_idx)  # [B, H_kv, S, D]
        grouped = q.reshape(batch, keys.shape[1], -1, q.shape[-1])  # [B, H_kv, group, D]
        out = F.scaled_dot_product_attention(grouped, keys, values, scale=attention.scaling)
        x = x + attention.o_proj(out.reshape(batch, 1, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return base.norm(x)


def decode_logits(
    head: tuple[Any, str, Any],
    config: Any,
    cache: Any,
    inputs: dict[str, torch.Tensor],
    linears: list[torch.nn.Linear],
    packs: WeightPacks | None,
) -> torch.Tensor | None:
    """Logits ``[B, 1, vocab]`` (model dtype) of one decode step through :func:`decode_hidden`, or None where it does
    not apply (:func:`decode_layers`; ``inputs`` other than ``input_ids [B, 1]`` and ``position_ids``, a mask among
    them).  ``head`` is the adapter's ``(base, cache argument name, LM head)``
    (:func:`~prefixcache.models.hf_support.plain_head`); ``linears`` run as tall-skinny products
    (:func:`~prefixcache.models.linear.tall_skinny_linears`) and the head through ``packs``
    (:func:`~prefixcache.models.linear.project`), as in the adapter's other forwards."""
    ids, positions = inputs.get("input_ids"), inputs.get("position_ids")
    if ids is None or positions is None or len(inputs) != 2 or ids.shape[-1] != 1:
        return None
    base, _, lm_head = head
    layers = decode_layers(base, config)
    if layers is None:
        return None
    with tall_skinny_linears(linears, ids.numel()):
        hidden = decode_hidden(base, layers, cache, ids, positions)
    return project(hidden, lm_head.weight, lm_head.bias, packs)
