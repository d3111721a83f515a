"""Which Hugging Face causal LMs a pool of per-token K/V can serve exactly (extra ``prefixcache[hf]``).

:func:`check_supported` refuses, with a reason, what a prefix cache of full per-token K/V cannot reproduce: encoder-
decoders, bidirectional attention, recurrent state of kinds :mod:`~prefixcache.models.hf_state` cannot snapshot
(Mamba-1, RWKV, xLSTM, RecurrentGemma), rotary scalings whose frequencies depend on the call's length, forwards
without a cache or ``position_ids`` argument.  It accepts sliding-window and chunked
layers (their window is a mask over absolute cache indices, which a full cache keeps exact) and names them in its
:class:`Support`.
:func:`probe_kv_layout` reads what the layers really keep per token (:class:`KVLayout`), K and V sizes apart: a
multi-head latent attention layer keeps a latent and a rotary key of different sizes, which the pool packs.

What keeping every position of a sliding layer costs, bf16, against a cache that frees a sliding layer's K/V outside
the window of every live path (SGLang's SWARadixCache): per cached token, K+V of one layer is ``2 * H_kv * D * 2``
bytes; a window-freeing cache holds asymptotically only the full layers per token, plus ``window`` tokens of the
sliding layers per live path.

=============  ====================  ========  ======  ==============  ===================================  =====
shape          layers sliding+full   H_kv x D  window  all layers      window-freeing                       ratio
=============  ====================  ========  ======  ==============  ===================================  =====
Gemma 3 1B     22 + 4                1 x 256   512     26,624 B/token  4,096 B/token + 11 MiB a live path   6.5
Gemma 3 4B     29 + 5                4 x 256   1024    139,264         20,480 + 116 MiB                     6.8
Gemma 3 27B    52 + 10               16 x 128  1024    507,904         81,920 + 416 MiB                     6.2
gpt-oss-20b    12 + 12               8 x 64    128     49,152          24,576 + 3 MiB                       2.0
gpt-oss-120b   18 + 18               8 x 64    128     73,728          36,864 + 4.5 MiB                     2.0
=============  ====================  ========  ======  ==============  ===================================  =====

(Gemma 3 puts a full layer after every five sliding ones; gpt-oss alternates.)  DeepSeek-V3's latent attention (61
layers, a 512 latent and a 64 rotary key, one head) packs into ``head_dim`` 288: 70,272 B/token, no padding.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from prefixcache.errors import InvalidArgumentError, UnsupportedModelError
from prefixcache.models.architectures import ARCHITECTURES
from prefixcache.models.quantize import QuantizedLinear

if TYPE_CHECKING:
    from prefixcache.models.hf_state import StateLayout

__all__ = [
    "TESTED_MODEL_TYPES",
    "KVLayout",
    "LLAMA_FAMILY_TYPES",
    "Support",
    "check_supported",
    "decode_special_floats",
    "drops_in_training",
    "read_config",
    "output_embeddings",
    "plain_head",
    "probe_kv_layout",
]

LLAMA_FAMILY_TYPES = frozenset("llama mistral qwen2 qwen3".split())
"""``config.model_type`` values of transformers' Llama-family decoders: layers ``x + attn(norm(x))`` then
``x + mlp(norm(x))``, a dense MLP, attention ``q/k/v/o_proj`` with rotary embeddings (Qwen3: per-head Q/K norms)
called as ``attention(module, query [B, H, n, D], key/value [B, H_kv, S, D], mask, ...)``.  The types where the
adapter's own shortcuts apply: the last position's MLP (:mod:`.hf_last_position`), the grouped decode attention
(:mod:`.hf_decode_attention`) and the own decode step (:mod:`.hf_decode_step`)."""

TESTED_MODEL_TYPES = frozenset(architecture.model_type for architecture in ARCHITECTURES)
"""``config.model_type`` values whose exactness ``tests/models/test_hf.py`` and ``test_architectures.py`` check
(the support table, :data:`~prefixcache.models.architectures.ARCHITECTURES`); others log a warning."""

# Tested types whose *ForCausalLM.forward does more than its LM head on the base's last hidden state: Gemma 2/3
# soft-cap the logits (final_logit_softcapping), Cohere scales them (logit_scale).  They keep the model's own forward.
_OWN_HEAD_MODEL_TYPES = frozenset({"cohere", "cohere2", "gemma2", "gemma3_text"})

# Model types whose state is not (only) per-token K/V, for a clear message even where DynamicCache cannot say so.
# Mamba-1 and Falcon-Mamba: transformers' prefill of several tokens restarts their scan instead of continuing a kept
# state, so a cached prefix cannot be resumed (the wrap-time probe of hf_state.check_resume finds it too).
_RECURRENT_MODEL_TYPES = frozenset({"mamba", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma"})

# Rotary scalings that pick frequencies from the longest position of each forward call (not prefix-stable).
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


# Model types whose forward reads the cache's length itself (not only position_ids): Llama 4 scales the queries of
# its no-RoPE layers by a function of ``cache.get_seq_length()``, which a padded batch would set to its width.
_READS_CACHE_LENGTH = frozenset({"llama4_text"})


@dataclass(frozen=True, slots=True)
class Support:
    """What :func:`check_supported` found: the forward's cache argument and the layers whose attention is windowed.

    ``cache_kwarg`` is ``"cache"`` (transformers >= 5.x releases that renamed it) or ``"past_key_values"``.
    ``windowed_layers`` are the sliding-window or chunked layers (transformers' ``DynamicSlidingWindowLayer``),
    ``window`` their ``sliding_window`` or ``attention_chunk_size``.  ``needs_equal_starts``: a padded batch may
    only group rows that start at the same position (no gap between a row's prefix and its new tokens), because
    the model's masks or scales read cache indices as absolute positions.
    """

    cache_kwarg: str
    windowed_layers: tuple[int, ...] = ()
    window: int | None = None
    needs_equal_starts: bool = False


def check_supported(model: Any, layout: StateLayout) -> Support:
    """Raise UnsupportedModelError unless every layer ``layout`` counts as a K/V layer is attention (full,
    sliding-window or chunked) over a plain per-token K/V cache; its recurrent layers (linear attention, SSM) and
    layers that keep nothing were classified by :meth:`~prefixcache.models.hf_state.StateLayout.of`.  Builds one
    empty ``DynamicCache``; runs no forward."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    config = model.config
    arch = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{arch} is an encoder-decoder; prefix caching needs a decoder-only model")
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        # A token's K/V would then depend on the tokens after it: a cached prefix would go stale as the request grows.
        raise UnsupportedModelError(f"{arch} attends bidirectionally; prefix caching needs causal attention")
    if config.model_type in _RECURRENT_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{arch} ({config.model_type}) carries a recurrent state that transformers' forward of several tokens "
            "does not continue (or that prefixcache cannot snapshot): a cached prefix cannot be resumed"
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
    # Sliding and chunked layers keep every position in prefixcache's live cache (a full layer); the model's own
    # masks (masking_utils' sliding and chunked overlays) then cut the window out of absolute cache indices.
    windowed = tuple(i for i, layer in enumerate(probe.layers) if type(layer) is DynamicSlidingWindowLayer)
    kinds_served = (DynamicLayer, DynamicSlidingWindowLayer)
    other = [i for i in layout.kv_layers if type(probe.layers[i]) not in kinds_served]
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
    window = (
        (getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)) if windowed else None
    )
    return Support(
        cache_kwarg,
        windowed,
        window,
        needs_equal_starts=bool(windowed) or config.model_type in _READS_CACHE_LENGTH,
    )


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What every layer's cache keeps per token: ``num_kv_heads`` heads of a ``key_dim`` K and a ``value_dim`` V.

    Where the two sizes agree the pool holds them as they are (``head_dim = key_dim``).  Where they differ
    (multi-head latent attention: DeepSeek-V2/V3 keep one head of a ``kv_lora_rank`` latent as K and a
    ``qk_rope_head_dim`` rotary key as V) the pool keeps its geometry with ``head_dim = ceil((key_dim + value_dim)
    / 2)`` and packs each token's K elements then V elements across its two ``[num_kv_heads, head_dim]`` slots
    (:meth:`pack`, :meth:`unpack`): no padding when ``key_dim + value_dim`` is even, else one element a head.
    """

    num_kv_heads: int
    key_dim: int
    value_dim: int

    @property
    def packed(self) -> bool:
        """Whether K and V differ in size, so the pool packs them."""
        return self.key_dim != self.value_dim

    @property
    def head_dim(self) -> int:
        """The pool's last dimension."""
        return -(-(self.key_dim + self.value_dim) // 2) if self.packed else self.key_dim

    def pack(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``keys [..., H, key_dim]`` and ``values [..., H, value_dim]`` as pool rows ``[2, ..., H, head_dim]``.
        A copy when packed, else a stack."""
        if not self.packed:
            return torch.stack([keys, values])
        lead = keys.shape[:-2]
        flat = torch.cat([keys.reshape(*lead, -1), values.reshape(*lead, -1)], dim=-1)
        spare = 2 * self.num_kv_heads * self.head_dim - flat.shape[-1]
        if spare:
            flat = torch.nn.functional.pad(flat, (0, spare))
        rows = flat.view(*lead, 2, self.num_kv_heads, self.head_dim)
        return rows.movedim(-3, 0)

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool rows ``[..., 2, n, H, head_dim]`` back to ``keys [..., n, H, key_dim]`` and ``values [..., n, H,
        value_dim]`` (views where not packed)."""
        if not self.packed:
            return rows.select(-4, 0), rows.select(-4, 1)
        heads = self.num_kv_heads
        flat = rows.movedim(-4, -3).flatten(-3)  # [..., n, 2 * H * head_dim]
        keys = flat[..., : heads * self.key_dim].unflatten(-1, (heads, self.key_dim))
        values = flat[..., heads * self.key_dim : heads * (self.key_dim + self.value_dim)]
        return keys, values.unflatten(-1, (heads, self.value_dim))


def probe_kv_layout(
    model: Any, cache_kwarg: str, kv_layers: tuple[int, ...] | None = None, cache: Any = None
) -> KVLayout:
    """The :class:`KVLayout` the model's layers really store, read from a one-token forward into a fresh cache.

    The config cannot always say: Falcon's multi-query attention keeps one K/V head whatever its config fields are,
    and a config may carry keys its architecture never reads (``num_key_value_heads`` on GPT-2); DeepSeek's latent
    attention caches a latent and a rotary key, not the per-head K/V its config sizes.  Costs one forward
    of one token.  Raises UnsupportedModelError when that forward fails (a config the model cannot run, such as more
    K/V heads than query heads), a layer keeps no K/V or the layers disagree on the layout.  ``kv_layers``: the
    layers to read (default all; a hybrid model's attention layers); ``cache``: the fresh cache to run into (default
    ``DynamicCache(config=...)``; MiniMax needs its own).
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
    if len(keys) != 4 or len(values) != 4 or keys[:3] != values[:3] or keys[0] != 1 or keys[2] != 1:
        raise UnsupportedModelError(
            f"{type(model).__name__} keeps K {keys} and V {values} after one token; expected [1, kv_heads, 1, K size] "
            "and [1, kv_heads, 1, V size]"
        )
    return KVLayout(num_kv_heads=keys[1], key_dim=keys[3], value_dim=values[3])


def output_embeddings(model: Any) -> Any:
    """The model's LM head module (``get_output_embeddings()``), or None."""
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def plain_head(model: Any) -> tuple[Any, str, Any] | None:
    """``(base model, its cache argument, LM head)`` when ``model``'s logits are exactly its ``nn.Linear`` LM head (or
    :class:`~prefixcache.models.quantize.QuantizedLinear`) applied to the base model's last hidden state (the tested
    model types, no logit scaling or soft-capping); else None, and the model's own forward computes the logits."""
    from torch import nn

    config = model.config
    if config.model_type not in TESTED_MODEL_TYPES or config.model_type in _OWN_HEAD_MODEL_TYPES:
        return None
    if any(getattr(config, name, None) not in (None, 1.0) for name in ("final_logit_softcapping", "logit_scale")):
        return None
    head = output_embeddings(model)
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(head, (nn.Linear, QuantizedLinear)) or not isinstance(base, nn.Module) or base is model:
        return None
    params = inspect.signature(base.forward).parameters
    cache_kwarg = next((name for name in ("cache", "past_key_values") if name in params), None)
    if cache_kwarg is None or "position_ids" not in params:
        return None
    return base, cache_kwarg, head


def decode_special_floats(value: Any) -> Any:
    """``value`` (parsed JSON) with transformers' tagged floats (``{"__float__": "Infinity"}``, as ``save_pretrained``
    writes an infinite ``time_step_limit``) turned back into floats."""
    if isinstance(value, dict):
        if value.keys() == {"__float__"} and value["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(value["__float__"].lower().replace("infinity", "inf"))
        return {key: decode_special_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [decode_special_floats(item) for item in value]
    return value


def read_config(config_path: str | os.PathLike[str], layers: int | None = None) -> Any:
    """The transformers config in ``config_path`` (a ``config.json`` or its folder), with only its first ``layers``
    layers when given: the layer count, ``layer_types`` and Nemotron-H's ``hybrid_override_pattern`` are cut before
    construction, so that fields derived per layer are built for N layers.  Raises InvalidArgumentError (unreadable
    config, unknown model type, ``layers`` < 1, a config that cannot be cut to ``layers``)."""
    from transformers import AutoConfig

    path = Path(config_path)
    path = path / "config.json" if path.is_dir() else path
    try:
        values = decode_special_floats(json.loads(path.read_text(encoding="utf-8")))
        model_type = values.pop("model_type")
    except (OSError, ValueError, KeyError, AttributeError) as error:
        raise InvalidArgumentError(f"cannot read a model config from {str(path)!r}: {error}") from None
    for key in ("torch_dtype", "dtype", "transformers_version", "architectures", "_name_or_path"):
        values.pop(key, None)
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise InvalidArgumentError(f"layers must be a positive int, got {layers!r}")
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if key in values:
                values[key] = layers
        for key in ("layer_types", "hybrid_override_pattern"):
            if isinstance(values.get(key), (list, str)):
                values[key] = values[key][:layers]
    try:
        config = AutoConfig.for_model(model_type, **values)
    except ValueError as error:
        raise InvalidArgumentError(f"{str(path)!r}: {error}") from None
    if layers is not None and config.num_hidden_layers != layers:
        raise InvalidArgumentError(f"{str(path)!r}: could not scale the config to {layers} layers")
    return config


def drops_in_training(module: torch.nn.Module) -> bool:
    """Whether ``module`` computes differently in training mode: a dropout with p > 0, a module holding a positive
    dropout rate it applies itself (transformers' attention: ``attention_dropout``), or a whole transformers model."""
    from transformers import PreTrainedModel

    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return module.p > 0
    rates = (getattr(module, name, None) for name in ("attention_dropout", "dropout", "attn_pdrop"))
    return isinstance(module, PreTrainedModel) or any(isinstance(r, float) and r > 0 for r in rates)
