"""K/V between the paged pool and a Hugging Face model's live transformers cache: a request's cached prefix gathered
into a new cache, and the K/V a forward appended taken out as pool rows (extra ``prefixcache[hf]``).

The pool holds the attention layers' K/V only (``layout.kv_layers[i]`` in pool layer ``i``), packed by
:class:`~prefixcache.models.hf_support.KVLayout` where K and V differ in size; a model with no attention layers (pure
Mamba-2) gets a one-element placeholder per token that nothing reads.
"""

from __future__ import annotations

from typing import Any

import torch

from prefixcache.errors import UnsupportedModelError
from prefixcache.models.base import LiveKV
from prefixcache.models.hf_state import StateLayout, new_live_cache, restore_state, start_state
from prefixcache.models.hf_support import KVLayout

__all__ = ["PoolTransfer", "flat_pool"]


def flat_pool(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` as ``[num_layers, 2, num_blocks * block_size, H_kv, D]``: a view, so index_copy_ writes the pool."""
    return kv.view(kv.shape[0], 2, kv.shape[2] * kv.shape[3], kv.shape[4], kv.shape[5])


class PoolTransfer:
    """Copies K/V between the pool and live caches of ``model`` (a transformers ``*ForCausalLM``; its dtype and device
    read at each use), whose layers ``layout`` describes and whose pool rows ``kv_layout`` packs; ``num_layers`` is
    the pool's layer count and ``name`` the model's name in errors."""

    def __init__(self, model: Any, layout: StateLayout, kv_layout: KVLayout, num_layers: int, name: str) -> None:
        self.model = model
        self.layout = layout
        self.kv_layout = kv_layout
        self.num_layers = num_layers
        self.name = name

    def new_cache(self, capacity: int) -> Any:
        """A live transformers cache of this model's layout (:func:`~prefixcache.models.hf_state.new_live_cache`)."""
        return new_live_cache(self.model.config, self.layout, capacity)

    def cache_from_pool(
        self, live: LiveKV | None, kv: torch.Tensor | None, table: torch.Tensor | None, start_pos: int, end_pos: int
    ) -> Any:
        """A new cache (capacity ``end_pos``, or ``live.room(end_pos)``) holding positions
        ``0 .. start_pos - 1`` gathered from the pool (a copy); it becomes ``live``'s cache when ``live`` is given.
        A recurrent model's state layers start from ``live.start_state``, which must stand at ``start_pos``
        (InvalidArgumentError otherwise: K/V alone cannot resume a recurrent layer)."""
        layout = self.layout
        state = start_state(layout, live, start_pos, self.name)
        cache = self.new_cache(live.room(end_pos) if live is not None else end_pos)
        if start_pos and layout.kv_layers:
            prefix = torch.arange(start_pos, device=self.model.device)
            block_size = kv.shape[3]
            slots = table[prefix // block_size] * block_size + prefix % block_size
            # index_select copies; [L, 2, start_pos, H_kv, D] -> per layer [1, H_kv, start_pos, D_k or D_v] (HF layout).
            keys, values = self.kv_layout.unpack(flat_pool(kv).index_select(2, slots))
            for pool_layer, layer in enumerate(layout.kv_layers):
                cache.update(keys[pool_layer].transpose(0, 1)[None], values[pool_layer].transpose(0, 1)[None], layer)
        if state is not None:
            restore_state(cache, layout, state)
        if live is not None:
            live.data, live.num_tokens = cache, start_pos
        return cache

    def new_rows(self, cache: Any, start_pos: int, end_pos: int, batch: int | None = None) -> torch.Tensor:
        """K/V of positions ``start_pos .. end_pos - 1`` from ``cache`` as pool rows ``[num_layers, 2, n, H_kv, D]``
        (packed by ``kv_layout`` where K and V differ in size), or with ``batch`` rows as ``[num_layers, 2, batch, n,
        H_kv, D]``.  Raises UnsupportedModelError when the cache's layers hold K/V of another shape than probed."""
        layout = self.kv_layout
        dtype, device = self.model.dtype, self.model.device
        if not self.layout.kv_layers:  # the placeholder pool of a model without attention layers
            shape = (1, 2, end_pos - start_pos, 1, 1) if batch is None else (1, 2, batch, end_pos - start_pos, 1, 1)
            return torch.zeros(shape, dtype=dtype, device=device)
        want_k = (batch or 1, layout.num_kv_heads, end_pos, layout.key_dim)
        want_v = (*want_k[:3], layout.value_dim)
        keys, values = [], []
        model_class = type(self.model).__name__
        for index in self.layout.kv_layers:
            layer = cache.layers[index]
            if tuple(layer.keys.shape) != want_k or tuple(layer.values.shape) != want_v:
                raise UnsupportedModelError(
                    f"{model_class} layer {index} cached K {tuple(layer.keys.shape)} and V "
                    f"{tuple(layer.values.shape)}, expected {want_k} and {want_v} [batch, kv_heads, positions, size] "
                    "as after its one-token probe; its attention does not keep plain per-token K/V"
                )
            keys.append(layer.keys[..., start_pos:, :])
            values.append(layer.values[..., start_pos:, :])
        if len(keys) != self.num_layers:
            raise UnsupportedModelError(f"{model_class} filled {len(keys)} cache layers, expected {self.num_layers}")
        # [L, B, H_kv, n, D_k or D_v] -> [L, B, n, H_kv, D_k or D_v] -> pool rows [2, L, B, n, H_kv, D].
        rows = layout.pack(torch.stack(keys).transpose(2, 3), torch.stack(values).transpose(2, 3)).transpose(0, 1)
        return rows[:, :, 0] if batch is None else rows
