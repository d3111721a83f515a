"""Which Hugging Face causal LMs a pool of per-token K/V can serve exactly (extra ``prefixcache[hf]``).

:func:`check_supported` refuses, with a reason, what a prefix cache of full per-token K/V cannot reproduce: encoder-
decoders, recurrent or linear-attention state, sliding-window or chunked attention, rotary scalings whose frequencies
depend on the call's length, forwards without a cache or ``position_ids`` argument.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from prefixcache.errors import UnsupportedModelError

if TYPE_CHECKING:
    from prefixcache.models.hf_state import StateLayout

__all__ = ["check_supported", "probe_kv_layout"]

# Model types whose state is not (only) per-token K/V, for a clear message even where DynamicCache cannot say so.
_RECURRENT_MODEL_TYPES = frozenset({"mamba", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma"})

# Rotary scalings that pick frequencies from the longest position of each forward call (not prefix-stable).
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def check_supported(model: Any, layout: StateLayout) -> str:
    """Raise UnsupportedModelError unless every layer is full attention with a plain K/V cache, a recurrent layer
    whose state ``layout`` can snapshot, or a layer that keeps nothing.

    Returns the name of the forward's cache argument (``cache`` in transformers >= 5.x, else ``past_key_values``).
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    config = model.config
    arch = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{arch} is an encoder-decoder; prefix caching needs a decoder-only model")
    if config.model_type in _RECURRENT_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{arch} ({config.model_type}) carries recurrent state, not per-token K/V; a prefix cannot be resumed "
            "from a KV pool"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    # One dict, or (for models with several layer types) one dict per layer type.
    ropes = (
        list(rope.values()) if isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values()) else [rope]
    )
    rope_types = {r.get("rope_type", r.get("type")) for r in ropes if isinstance(r, dict)}
    if rope_types & _LENGTH_DEPENDENT_ROPE:
        raise UnsupportedModelError(
            f"{arch} uses {sorted(rope_types & _LENGTH_DEPENDENT_ROPE)} rotary scaling, whose frequencies depend on "
            "the length of the forward call: K/V cached by a shorter call would not match a full recompute"
        )
    try:
        probe = DynamicCache(config=config)
    except Exception as error:  # noqa: BLE001 - any failure here means the cache layout is not one we understand
        raise UnsupportedModelError(f"cannot build a KV cache for {arch}: {error}") from None
    layer_types = list(getattr(config, "layer_types", None) or [type(layer).__name__ for layer in probe.layers])
    sliding = [i for i, layer in enumerate(probe.layers) if isinstance(layer, DynamicSlidingWindowLayer)]
    if sliding:
        window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
        raise UnsupportedModelError(
            f"{arch} uses sliding-window or chunked attention (window {window}) in layers {sliding[:8]}"
            f"{'...' if len(sliding) > 8 else ''} (layer types {sorted(set(layer_types))}); a prefix cache of "
            "full per-token K/V would attend beyond the window, so cached logits would not be exact"
        )
    # The layout refused layers of unknown kinds; its K/V layers must keep plain per-token K/V.
    other = [i for i in layout.kv_layers if type(probe.layers[i]) is not DynamicLayer]
    if other:
        kinds = sorted({type(probe.layers[i]).__name__ for i in other})
        raise UnsupportedModelError(
            f"{arch} has layers without plain per-token K/V ({kinds} in layers {other[:8]}"
            f"{'...' if len(other) > 8 else ''}; layer types {sorted(set(layer_types))}): recurrent, linear or "
            "shared state cannot be restored from a KV pool"
        )
    if probe.layers and len(probe.layers) != config.num_hidden_layers:
        raise UnsupportedModelError(
            f"{arch} has {config.num_hidden_layers} layers but {len(probe.layers)} cache layers; cannot map them"
        )
    params = inspect.signature(model.forward).parameters
    cache_kwarg = next((name for name in ("cache", "past_key_values") if name in params), None)
    if cache_kwarg is None or ("position_ids" not in params and layout.kv_layers):
        raise UnsupportedModelError(f"{arch}.forward takes no cache or no position_ids; cannot prefill a suffix")
    if getattr(config, "max_position_embeddings", None) is None and layout.kv_layers:
        raise UnsupportedModelError(f"{arch} config has no max_position_embeddings")
    return cache_kwarg


def probe_kv_layout(
    model: Any, cache_kwarg: str, kv_layers: tuple[int, ...] | None = None, cache: Any = None
) -> tuple[int, int]:
    """``(num_kv_heads, head_dim)`` the model's layers really store, read from a one-token forward into a fresh cache.

    The config cannot always say: Falcon's multi-query attention keeps one K/V head whatever its config fields are,
    and a config may carry keys its architecture never reads (``num_key_value_heads`` on GPT-2).  Costs one forward
    of one token.  Raises UnsupportedModelError when that forward fails (a config the model cannot run, such as more
    K/V heads than query heads), a layer keeps no K/V or the layers disagree on the layout.
    """
    from transformers import DynamicCache

    if cache is None:
        cache = DynamicCache(config=model.config)
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    try:
        with torch.inference_mode():
            model(input_ids=ids, position_ids=ids, use_cache=True, **keep, **{cache_kwarg: cache})
    except Exception as error:  # noqa: BLE001 - a model that cannot run one token cannot be served at all
        raise UnsupportedModelError(
            f"{type(model).__name__} failed a one-token forward with a cache: {type(error).__name__}: {error}"
        ) from error
    layers = cache.layers if kv_layers is None else [cache.layers[i] for i in kv_layers]
    shapes = {
        (tuple(layer.keys.shape), tuple(layer.values.shape)) if getattr(layer, "keys", None) is not None else None
        for layer in layers
    }
    if len(shapes) != 1 or None in shapes:
        raise UnsupportedModelError(
            f"{type(model).__name__} layers keep K/V of shapes {sorted(map(str, shapes))} after one token; a KV pool "
            "needs every layer to keep one [1, kv_heads, 1, head_dim] K and V"
        )
    ((keys, values),) = shapes
    if keys != values or len(keys) != 4 or keys[0] != 1 or keys[2] != 1:
        raise UnsupportedModelError(
            f"{type(model).__name__} keeps K {keys} and V {values} after one token; expected [1, kv_heads, 1, head_dim]"
        )
    return keys[1], keys[3]
