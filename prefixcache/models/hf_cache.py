"""Transformers caches for prefixcache's live K/V (extra ``prefixcache[hf]``): a layer that appends in place, and the
padded batch cache that several requests decode in together."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from prefixcache.errors import UnsupportedModelError


@functools.cache
def growing_layer_class() -> type:
    """A transformers ``DynamicLayer`` that appends into a preallocated buffer instead of concatenating.

    ``DynamicLayer.update`` concatenates, copying the whole context at every decode step; this layer writes the new
    rows into spare capacity (doubling when full) and exposes ``keys``/``values`` as views of the filled part, so
    the attention sees exactly the tensors it would have seen.  Built lazily: transformers is an optional extra.
    """
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def __init__(self, capacity: int = 0) -> None:
            super().__init__()
            self.capacity_hint = capacity
            self.length = 0
            self.key_buffer: torch.Tensor | None = None
            self.value_buffer: torch.Tensor | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if self.key_buffer is None or end > self.key_buffer.shape[-2]:
                size = max(end, self.capacity_hint, 2 * (0 if self.key_buffer is None else self.key_buffer.shape[-2]))
                self.key_buffer = self._grown(self.key_buffer, key_states, size)
                self.value_buffer = self._grown(self.value_buffer, value_states, size)
            self.key_buffer[..., self.length : end, :] = key_states
            self.value_buffer[..., self.length : end, :] = value_states
            self.length = end
            self.keys = self.key_buffer[..., :end, :]
            self.values = self.value_buffer[..., :end, :]
            return self.keys, self.values

        def fill_padded(
            self,
            keys: list[torch.Tensor | None],
            values: list[torch.Tensor | None],
            lengths: list[int],
            width: int,
            sizes: tuple[int, int, int],
            dtype: torch.dtype,
            device: torch.device,
        ) -> None:
            """Hold ``len(keys)`` rows, row b's ``[1, H_kv, lengths[b], D_k]`` K and ``[.., D_v]`` V at positions
            ``0 .. lengths[b] - 1`` and zeros up to ``width`` (finite, so that masked-out positions add exactly
            nothing); ``sizes`` is ``(H_kv, D_k, D_v)``."""
            heads, key_dim, value_dim = sizes
            rows = (len(keys), heads, max(self.capacity_hint, width))
            self.key_buffer = torch.empty((*rows, key_dim), dtype=dtype, device=device)
            self.value_buffer = torch.empty((*rows, value_dim), dtype=dtype, device=device)
            for b, (k, v, length) in enumerate(zip(keys, values, lengths, strict=True)):
                if length:
                    self.key_buffer[b, :, :length] = k[0, :, :length]
                    self.value_buffer[b, :, :length] = v[0, :, :length]
                self.key_buffer[b, :, length:width] = 0
                self.value_buffer[b, :, length:width] = 0
            self.length = width
            self.keys = self.key_buffer[..., :width, :]
            self.values = self.value_buffer[..., :width, :]
            self.device = device
            self.is_initialized = True

        def _grown(self, old: torch.Tensor | None, like: torch.Tensor, size: int) -> torch.Tensor:
            shape = (*like.shape[:-2], size, like.shape[-1])
            buffer = like.new_empty(shape)
            if old is not None:
                buffer[..., : self.length, :] = old[..., : self.length, :]
            return buffer

        def reset(self) -> None:
            self.length = 0
            self.key_buffer = self.value_buffer = None
            super().reset()

        def crop(self, tokens_to_remove: int) -> None:
            # Cropping would drop rows the request's pool blocks still hold; nothing in prefixcache's path crops.
            raise UnsupportedModelError("prefixcache's live K/V cannot be cropped (assisted decoding is not supported)")

    return GrowingLayer


@dataclass(eq=False)
class PaddedBatch:
    """The batch cache of a padded forward over several requests, kept while the same requests go on together.

    ``cache`` holds every member's K/V as one batch (``[B, H_kv, width, D]`` per layer), where ``mask[B, width]`` is
    1 at a member's real positions and 0 in the gap after a shorter prefix; ``ends`` are the members' positions after
    the last step.  Each member's own live cache points at it (attribute ``prefixcache_batch``), and it refers to them
    only weakly, so it lives exactly as long as a member does.  Rebuilding it every step would copy every member's
    context once per step.
    """

    members: tuple[weakref.ref, ...]
    ends: tuple[int, ...]
    mask: torch.Tensor
    cache: Any

    @staticmethod
    def attach(caches: list[Any], mask: torch.Tensor, cache: Any) -> PaddedBatch:
        """A new batch over the members' live ``caches``, each of which now points at it."""
        state = PaddedBatch(tuple(weakref.ref(c) for c in caches), (), mask, cache)
        for member in caches:
            member.prefixcache_batch = state
        return state

    @staticmethod
    def find(caches: list[Any], starts: list[int]) -> PaddedBatch | None:
        """The batch these live ``caches`` (in this order) stepped in last, if they all continue from where it left
        them (``starts`` equal to its ``ends``); else None.  O(B)."""
        state = getattr(caches[0], "prefixcache_batch", None)
        if state is None or state.ends != tuple(starts) or len(state.members) != len(caches):
            return None
        if any(ref() is not member for ref, member in zip(state.members, caches, strict=True)):
            return None
        return state
