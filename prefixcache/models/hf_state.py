"""Recurrent state of hybrid Hugging Face models: which layers keep per-token K/V, which keep a fixed-size state, and
snapshots of that state a later request resumes from (extra ``prefixcache[hf]``).

Hybrid decoders (Qwen3-Next's Gated DeltaNet, Nemotron-H's and Granite-4.0-H's Mamba-2 mixers, MiniMax's lightning
attention, pure Mamba-2) carry, in their linear-attention / SSM layers, a state of fixed size that sums up every
token so far: a convolution window (``[batch, channels, kernel]``) and a recurrent state (e.g. ``[batch, heads,
head_k_dim, head_v_dim]``).  Unlike K/V it cannot be cut at an arbitrary position, so a cached prefix resumes only
where a snapshot of every such layer was kept (SGLang's MambaRadixCache keeps them on radix-tree nodes; vLLM caches
them at block boundaries).  :class:`StateLayout` reads the model's layer kinds from the cache transformers builds
for its config; :class:`RecurrentState` is one snapshot (cloned tensors, immutable once taken); :func:`take_state`
and :func:`restore_state` move states between a live transformers cache and a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prefixcache.errors import InvalidArgumentError, SnapshotMismatchError, UnsupportedModelError
from prefixcache.models.base import LiveKV, kv_pool_shape
from prefixcache.models.hf_cache import growing_layer_class

__all__ = [
    "RecurrentState",
    "StateLayout",
    "check_resume",
    "load_state",
    "new_live_cache",
    "probe_state",
    "probe_state_bytes",
    "restore_state",
    "start_state",
    "state_kinds",
    "take_state",
]


@dataclass(frozen=True, slots=True)
class StateLayout:
    """The kinds of a model's cache layers, by layer index.

    ``kv_layers``: layers that keep per-token K/V (full, sliding or chunked attention), in order; the pool's layer
    ``i`` holds layer ``kv_layers[i]``.  ``state_layers``: linear-attention / SSM layers (a transformers
    ``LinearAttentionLayer``), whose conv and recurrent states a snapshot holds.  ``minimax_layers``: MiniMax's
    lightning-attention layers, whose state lives in ``MiniMaxCache.linear_cache``.  Layers in none of them keep
    nothing (an MLP-only layer of Nemotron-H: transformers' ``DummyLayer``).
    """

    num_layers: int
    kv_layers: tuple[int, ...]
    state_layers: tuple[int, ...]
    minimax_layers: tuple[int, ...] = ()

    @property
    def recurrent(self) -> bool:
        """Whether any layer keeps a recurrent state (the model resumes only where a snapshot was kept)."""
        return bool(self.state_layers or self.minimax_layers)

    @staticmethod
    def of(model: Any) -> StateLayout:
        """Read the layout from the cache transformers builds for ``model.config`` (``DynamicCache(config=...)``).

        Raises UnsupportedModelError for a layer that keeps both a linear-attention state and K/V (transformers'
        ``hybrid`` layer type, Zamba / Falcon-H1) or any other kind of cache layer.
        """
        from transformers import DynamicCache
        from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionCacheLayerMixin

        config = model.config
        arch = type(model).__name__
        try:
            probe = DynamicCache(config=config)
        except Exception as error:  # noqa: BLE001 - any failure here means the cache layout is not one we understand
            raise UnsupportedModelError(f"cannot build a KV cache for {arch}: {error}") from None
        kv, state, minimax, other = [], [], [], []
        for index, layer in enumerate(probe.layers):
            linear = isinstance(layer, LinearAttentionCacheLayerMixin)
            if linear and isinstance(layer, DynamicLayer):
                other.append(index)
            elif linear:
                (minimax if config.model_type == "minimax" else state).append(index)
            elif isinstance(layer, DynamicLayer):
                kv.append(index)
            elif not isinstance(layer, DummyLayer):
                other.append(index)
        if other:
            kinds = sorted({type(probe.layers[i]).__name__ for i in other})
            raise UnsupportedModelError(
                f"{arch} has cache layers of kinds {kinds} (layers {other[:8]}{'...' if len(other) > 8 else ''}) "
                "that keep a recurrent state and K/V in one layer (Zamba, Falcon-H1), or a kind prefixcache does not "
                "know: a KV pool beside state snapshots cannot restore them"
            )
        if probe.layers and len(probe.layers) != config.num_hidden_layers:
            raise UnsupportedModelError(
                f"{arch} has {config.num_hidden_layers} layers but {len(probe.layers)} cache layers; cannot map them"
            )
        return StateLayout(len(probe.layers), tuple(kv), tuple(state), tuple(minimax))


@dataclass(frozen=True, eq=False, slots=True)
class RecurrentState:
    """The recurrent state of every state layer after the first ``position`` tokens of a sequence; read-only.

    ``layers`` maps a cache layer index to that layer's tensors: for a transformers ``LinearAttentionLayer``, a pair
    of tuples ``(conv states, recurrent states)`` (one entry per state index, None where the layer keeps none); for
    MiniMax, ``(linear_cache,)``.  Shapes are the model's, batch 1 (Qwen3-Next: conv ``[1, conv_dim, kernel]``,
    recurrent ``[1, v_heads, head_k_dim, head_v_dim]``).  ``nbytes`` is their total size in bytes, what the cache's
    state budget counts.  Resuming copies the tensors (the live cache updates its states in place).
    """

    position: int
    layers: dict[int, tuple[Any, ...]]
    nbytes: int

    def __repr__(self) -> str:
        return f"RecurrentState(position={self.position}, layers={len(self.layers)}, nbytes={self.nbytes})"

    def snapshot_parts(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """What a cache snapshot saves of this state (:mod:`prefixcache.cache.snapshot.states`): ``meta``, each layer's
        slot counts (``{"<layer>": [conv slots, recurrent slots]}``, MiniMax ``[1]``), and the tensors by name
        (``<layer>.<c|r|m>.<slot>``; empty slots absent).  The tensors themselves, not copies.  O(layers)."""
        meta: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}
        for index, groups in self.layers.items():
            meta[str(index)] = [len(group) for group in groups] if len(groups) == 2 else [1]
            kinds = ("c", "r") if len(groups) == 2 else ("m",)
            named = groups if len(groups) == 2 else ((groups[0],),)
            for kind, group in zip(kinds, named, strict=True):
                for slot, tensor in enumerate(group):
                    if tensor is not None:
                        tensors[f"{index}.{kind}.{slot}"] = tensor
        return meta, tensors


def load_state(
    layout: StateLayout,
    position: int,
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    device: Any,
    kinds: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> RecurrentState:
    """A state of a model with ``layout`` rebuilt from :meth:`RecurrentState.snapshot_parts` (tensors moved to
    ``device``).  ``kinds``: the shape and dtype of each tensor of the model's own states (:func:`state_kinds`), which
    every saved tensor must have.  Raises SnapshotMismatchError when the parts name other layers than the layout's
    state layers, slots that are not there, or a tensor of another shape or dtype (another model's state, or an edited
    one: a tensor of the right size in bytes but the wrong shape would fail the first request resuming it)."""
    expected = {str(i) for i in (*layout.state_layers, *layout.minimax_layers)}
    if set(meta) != expected:
        raise SnapshotMismatchError(
            f"a saved recurrent state holds layers {sorted(meta)}, the model's are {sorted(expected)}"
        )
    layers: dict[int, tuple[Any, ...]] = {}
    used = set()
    nbytes = 0
    for key, counts in meta.items():
        index = int(key)
        minimax = index in layout.minimax_layers
        well_formed = type(counts) is list and all(type(c) is int and 0 <= c <= 64 for c in counts)
        if not well_formed or len(counts) != (1 if minimax else 2):
            raise SnapshotMismatchError(f"a saved recurrent state has slots {counts!r} for layer {index}")
        groups = []
        for kind, count in zip(("m",) if minimax else ("c", "r"), counts, strict=True):
            group = []
            for slot in range(count):
                tensor = tensors.get(f"{index}.{kind}.{slot}")
                if tensor is not None:
                    name = f"{index}.{kind}.{slot}"
                    if kinds is not None and (tuple(tensor.shape), tensor.dtype) != kinds.get(name):
                        raise SnapshotMismatchError(
                            f"a saved recurrent state's tensor {name} is {tensor.dtype} {list(tensor.shape)}; the "
                            f"model's is {kinds.get(name, 'absent')}"
                        )
                    used.add(name)
                    nbytes += tensor.numel() * tensor.element_size()
                    tensor = tensor.to(device)
                group.append(tensor)
            groups.append(tuple(group))
        layers[index] = (groups[0][0],) if minimax else (groups[0], groups[1])
    if used != set(tensors):
        extra = sorted(set(tensors) - used)[:4]
        raise SnapshotMismatchError(f"a saved recurrent state holds tensors {extra} it names no slot for")
    return RecurrentState(position, layers, nbytes)


def _clone(tensors: dict[int, torch.Tensor | None], initialized: dict[int, bool]) -> tuple[torch.Tensor | None, ...]:
    return tuple(
        tensors[i].detach().clone() if initialized[i] and tensors[i] is not None else None for i in sorted(tensors)
    )


def take_state(cache: Any, layout: StateLayout, position: int) -> RecurrentState:
    """A snapshot (copies) of the state layers of the live transformers ``cache``, standing after ``position`` tokens.

    Raises UnsupportedModelError when a state layer holds no state yet (its forward has not run) while
    ``position > 0``: a snapshot would not resume the sequence.
    """
    layers: dict[int, tuple[Any, ...]] = {}
    nbytes = 0
    for index in layout.state_layers:
        layer = cache.layers[index]
        if position and not any(layer.has_previous_state.values()):
            raise UnsupportedModelError(f"state layer {index} holds no state after {position} tokens")
        conv = _clone(layer.conv_states, layer.is_conv_states_initialized)
        recurrent = _clone(layer.recurrent_states, layer.is_recurrent_states_initialized)
        layers[index] = (conv, recurrent)
        nbytes += sum(t.numel() * t.element_size() for t in (*conv, *recurrent) if t is not None)
    for index in layout.minimax_layers:
        linear = cache.linear_cache[index] if index < len(cache.linear_cache) else []
        if not isinstance(linear, torch.Tensor):
            if position:
                raise UnsupportedModelError(f"MiniMax layer {index} holds no state after {position} tokens")
            layers[index] = (None,)
            continue
        layers[index] = (linear.detach().clone(),)
        nbytes += linear.numel() * linear.element_size()
    return RecurrentState(position, layers, nbytes)


def restore_state(cache: Any, layout: StateLayout, state: RecurrentState) -> None:
    """Load copies of ``state``'s tensors into the state layers of the fresh live transformers ``cache``, so that its
    next forward continues from ``state.position`` exactly as the cache that was snapshot would have."""
    for index in layout.state_layers:
        layer = cache.layers[index]
        conv, recurrent = state.layers[index]
        for i, tensor in enumerate(conv):
            if tensor is not None:
                layer.conv_states[i] = tensor.clone()
                layer.conv_kernel_size[i] = tensor.shape[-1]
                layer.is_conv_states_initialized[i] = True
                layer.has_previous_state[i] = True
                layer.dtype, layer.device = tensor.dtype, tensor.device
        for i, tensor in enumerate(recurrent):
            if tensor is not None:
                layer.recurrent_states[i] = tensor.clone()
                layer.is_recurrent_states_initialized[i] = True
                layer.has_previous_state[i] = True
                layer.dtype, layer.device = tensor.dtype, tensor.device
    for index in layout.minimax_layers:
        (linear,) = state.layers[index]
        if linear is not None:
            cache.set_linear_cache(index, linear.clone())


def new_live_cache(config: Any, layout: StateLayout, capacity: int) -> Any:
    """A fresh transformers cache for a request's live K/V and state: the cache transformers builds for ``config``
    with prefixcache's growing full layer (:func:`~prefixcache.models.hf_cache.growing_layer_class`, buffers of
    ``capacity`` positions grown by doubling) in every K/V layer, sliding ones too (they keep every position); the
    state layers are transformers' own, fresh.  MiniMax gets its own ``MiniMaxCache`` (lightning-attention state in
    ``linear_cache``, placeholders in the other slots)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DummyLayer

    if layout.minimax_layers:
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        cache = MiniMaxCache()
        cache.layer_class_to_replicate = None
        cache.layers = [DummyLayer() for _ in range(layout.num_layers)]
        cache.linear_cache = [None] * layout.num_layers
    else:
        cache = DynamicCache(config=config)
    grow = growing_layer_class()
    for index in layout.kv_layers:
        cache.layers[index] = grow(capacity)
    return cache


def start_state(layout: StateLayout, live: Any, start_pos: int, name: str) -> RecurrentState | None:
    """The snapshot a fill of a live cache at ``start_pos`` resumes the state layers from: None when the model has
    no state layers or starts at 0, else ``live.start_state``, which must stand at ``start_pos``.  Raises
    InvalidArgumentError otherwise (K/V alone cannot resume a recurrent layer); ``name`` names the model."""
    if not layout.recurrent or not start_pos:
        return None
    state = getattr(live, "start_state", None)
    if not isinstance(state, RecurrentState) or state.position != start_pos:
        where = "none" if state is None else f"one at {getattr(state, 'position', '?')}"
        raise InvalidArgumentError(
            f"{name} has recurrent layers: resuming at position {start_pos} needs their state snapshot there "
            f"(LiveKV.start_state), got {where}"
        )
    return state


def _scratch_pool(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-block pool of 16 positions for ``model`` and its block table: where the wrap-time probes run."""
    kv = torch.zeros(kv_pool_shape(model, 1, 16), dtype=model.dtype, device=model.device)
    return kv, torch.zeros(1, dtype=torch.int32, device=model.device)


def state_kinds(state: RecurrentState) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of each tensor of ``state`` by its :meth:`~RecurrentState.snapshot_parts` name: what
    :func:`load_state` checks a saved state against.  O(layers)."""
    return {name: (tuple(t.shape), t.dtype) for name, t in state.snapshot_parts()[1].items()}


def probe_state_bytes(model: Any) -> int:
    """Bytes of one state snapshot of the adapter ``model`` (an :class:`~prefixcache.models.hf.HFCausalLM` with
    recurrent layers), from a one-token forward into a one-block scratch pool.  Raises UnsupportedModelError when
    that forward fails (a model that cannot run one token with a cache cannot be served)."""
    return probe_state(model).nbytes


def probe_state(model: Any) -> RecurrentState:
    """One state snapshot of the adapter ``model`` (see :func:`probe_state_bytes`), after a one-token forward."""
    kv, table = _scratch_pool(model)
    live = LiveKV()
    try:
        model.forward_cached(torch.zeros(1, dtype=torch.long, device=model.device), 0, kv, table, live=live)
    except Exception as error:  # noqa: BLE001 - a model that cannot run one token cannot be served at all
        raise UnsupportedModelError(
            f"{type(model.model).__name__} failed a one-token forward into a cache of its recurrent and attention "
            f"layers: {type(error).__name__}: {error}"
        ) from error
    return model.take_state(live)


def check_resume(model: Any) -> None:
    """Raise UnsupportedModelError unless the adapter ``model``'s forward of several tokens continues a kept state:
    from the state after 7 of 12 tokens, the last 5 in one forward must agree with the same 5 fed one at a time (the
    decode path, which ``generate`` itself runs from the state), within 1% of the largest logit in float32, 25% in
    half precision.  Measured on tiny random models: served models agree to 3e-4 in float32 and 7% in bf16 (their
    chunked and step kernels round differently); transformers' Mamba-1 and Falcon-Mamba, whose prefill restarts the
    scan from zeros, miss by 9-31% (they are refused by type too, :mod:`~prefixcache.models.hf_support`).  Seven
    forwards of a few tokens, at wrap time."""
    ids = torch.arange(1, 13, device=model.device) % model.vocab_size
    kv, table = _scratch_pool(model)
    live = LiveKV()
    model.forward_cached(ids[:7], 0, kv, table, live=live)
    state = model.take_state(live)
    chunk, step = LiveKV(), LiveKV()
    chunk.start_state = step.start_state = state
    logits = model.forward_cached(ids[7:], 7, kv, table, return_logits=True, live=chunk)
    steps = torch.cat([model.forward_cached(ids[t : t + 1], t, kv, table, live=step) for t in range(7, 12)])
    miss = float((logits - steps).abs().max()) / max(float(steps.abs().max()), 1e-30)
    if not miss <= (0.01 if model.dtype == torch.float32 else 0.25):
        raise UnsupportedModelError(
            f"{type(model.model).__name__}'s forward of several tokens does not continue a kept recurrent state (it "
            f"misses the same tokens fed one at a time by {miss:.1%} of the largest logit): its scan restarts"
        )
