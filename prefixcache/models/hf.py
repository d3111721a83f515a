"""Hugging Face causal LMs behind the :class:`~prefixcache.models.base.CausalLM` protocol (extra ``prefixcache[hf]``).

:class:`HFCausalLM` wraps a local ``AutoModelForCausalLM``.  A cached prefill gathers the prefix's K/V from the
paged pool (a copy: the model never holds a view of the pool), hands them to the model as a ``DynamicCache``, runs
only the new tokens with explicit ``position_ids`` starting at the cached length, and scatters the new tokens' K/V
from the cache back into their pool slots.  The reference path is the model's own forward with no cache.

Served exactly (tested with transformers 5.24, ``TESTED_MODEL_TYPES``): full attention (Llama, Qwen2/3, Qwen3-MoE,
Gemma, GLM-4-MoE, Phi-3, OLMo2, GPT-2), sliding-window or chunked attention (Mistral with a window, Qwen2 with
``use_sliding_window``, Gemma 2/3, gpt-oss with its sinks, Cohere2, EXAONE 4, Llama 4 text), DeepSeek-V2/V3's latent
attention, and hybrid and recurrent models (Qwen3-Next, Nemotron-H, Granite-4.0-H, MiniMax, Mamba-2), whose
linear-attention / SSM layers carry a fixed-size state kept in snapshots (:mod:`~prefixcache.models.hf_state`) while
the pool holds their attention layers' K/V only.  The pool keeps every position's K/V in every attention layer,
sliding ones included, and the live cache is a full layer, so the model's own window and chunk masks (on absolute
cache indices) cut the window exactly; SGLang's SWARadixCache instead frees a sliding layer's K/V outside the window
of every live path (bytes this costs: :mod:`~prefixcache.models.hf_support`).  Latent attention caches a latent (K)
and a rotary key (V) of different sizes, packed across the pool's two slots
(:class:`~prefixcache.models.hf_support.KVLayout`).  Refused with :class:`~prefixcache.errors.UnsupportedModelError`:
recurrent state of other kinds (Mamba-1, whose prefill does not continue a kept state; RWKV, xLSTM, RecurrentGemma;
layers keeping both a state and K/V, as Zamba's and Falcon-H1's), rotary scalings that depend on the call's length
(dynamic NTK, LongRoPE), encoder-decoders.  Other architectures that pass the checks are untested; replay them with
``--verify``.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import xxhash

from prefixcache.errors import InvalidArgumentError, UnsupportedModelError
from prefixcache.models.base import (
    BatchRow,
    LiveKV,
    check_cached_call,
    check_live,
    check_logits_from,
    check_reference_call,
    hash_weights,
    resolve_device,
    weights_version_of,
)
from prefixcache.models.hf_cache import PaddedBatch
from prefixcache.models.hf_decode_attention import grouped_decode
from prefixcache.models.hf_decode_step import decode_logits
from prefixcache.models.hf_last_position import last_layer_mlp, last_position_mlp
from prefixcache.models.hf_state import (
    RecurrentState,
    StateLayout,
    check_resume,
    new_live_cache,
    probe_state_bytes,
    restore_state,
    start_state,
    take_state,
)
from prefixcache.models.hf_support import (
    TESTED_MODEL_TYPES,
    KVLayout,
    check_supported,
    drops_in_training,
    output_embeddings,
    plain_head,
    probe_kv_layout,
    read_config,
)
from prefixcache.models.linear import WeightPacks, large_cpu_linears, lay_out_for_decode, project, tall_skinny_linears

logger = logging.getLogger(__name__)

__all__ = ["TESTED_MODEL_TYPES", "HFCausalLM", "load_hf_model", "random_model_from_config"]

UNBOUNDED_POSITIONS = 1 << 20
"""``max_position`` of a model whose config sets none (no attention layers, no positions): a bound for checks."""


class HFCausalLM:
    """A Hugging Face ``*ForCausalLM`` implementing :class:`~prefixcache.models.base.CausalLM`.

    Sizes: ``num_layers`` (``num_hidden_layers``) and ``max_position`` (``max_position_embeddings``) from the config;
    ``num_kv_heads`` and ``head_dim`` from what the layers store after a one-token forward at wrap time
    (:func:`~prefixcache.models.hf_support.probe_kv_layout`).  ``dtype`` and ``device`` are the model's, read at each
    use.  The pool must be in the model's dtype and on its device.  Puts the model in eval mode; a forward while any
    module is in training mode again raises InvalidArgumentError (dropout would break exactness).

    ``pack_head`` (default True): on the CPU in float32, batched decode (2 .. 64 rows a forward) multiplies by a
    oneDNN-packed copy of the LM head weight (:class:`~prefixcache.models.linear.WeightPacks`; Qwen2.5-0.5B's head,
    8 rows: 95 -> 51 ms), made on the first such forward and again after the weight changes.  It costs the head's
    size in memory once more (544 MB for a 151,936 x 896 float32 head); ``pack_head=False`` keeps to ``W @ h.T``.
    ``decode_layout`` (default True): on the CPU in float32, the widening large layers (LM head, MLP gate and up) get
    weights column-major in place, same values (:func:`.linear.lay_out_for_decode`): decode reads them faster.

    Raises:
        UnsupportedModelError: the architecture has layers a per-token K/V pool cannot serve exactly (recurrent or
            linear state), is an encoder-decoder, or its forward takes no cache or
            ``position_ids``, or it has no LM head (a base model); the layers disagree on their K/V layout.
    """

    def __init__(self, model: Any, *, pack_head: bool = True, decode_layout: bool = True) -> None:
        config = getattr(model, "config", None)
        if config is None or not callable(model):
            raise InvalidArgumentError(f"expected a transformers *ForCausalLM model, got {type(model).__name__}")
        self.model = model.eval()
        self.config = config
        self.layout = StateLayout.of(model)
        self.support = check_supported(model, self.layout)
        self._cache_kwarg = self.support.cache_kwarg
        self._takes_positions = "position_ids" in inspect.signature(model.forward).parameters
        if output_embeddings(model) is None:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no LM head (get_output_embeddings() is None); wrap the *ForCausalLM "
                "model, not its base model"
            )
        # Older or custom heads without logits_to_keep compute every position's logits; we still return the last.
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._decode_layout = decode_layout
        self._resolve_head()
        self._head_packs = WeightPacks() if pack_head else None  # the LM head's oneDNN copy, batched CPU decode
        # The pool holds the K/V layers only (layout.kv_layers[i] in pool layer i); a model with none (pure Mamba-2)
        # gets a one-element placeholder per token that nothing reads.
        self.num_layers = len(self.layout.kv_layers) or 1
        if self.layout.kv_layers:
            self.kv_layout = probe_kv_layout(model, self._cache_kwarg, self.layout.kv_layers, self._new_cache(1))
        else:
            self.kv_layout = KVLayout(num_kv_heads=1, key_dim=1, value_dim=1)
        self.num_kv_heads, self.head_dim = self.kv_layout.num_kv_heads, self.kv_layout.head_dim
        self.state_bytes = 0
        """Bytes of one recurrent-state snapshot (:meth:`take_state`); 0 for a model without recurrent layers."""
        # A model without attention (pure Mamba-2) has no position limit of its own: 2**20 tokens then.
        self.max_position = int(getattr(config, "max_position_embeddings", None) or UNBOUNDED_POSITIONS)
        self._fingerprint: str | None = None
        self._droppers: list[torch.nn.Module] = []  # the modules _check_eval watches (see there)
        self._droppers_version: int | None = None
        self.weights_version()  # makes the list
        self._fingerprint_version: int | None = None
        self.fingerprint()  # every weight hashed now, never on a request's path (until the weights change)
        if self.layout.recurrent:
            self.state_bytes = probe_state_bytes(self)
            check_resume(self)
        if config.model_type not in TESTED_MODEL_TYPES:
            logger.warning(
                "%s (model_type %r) passes the support checks but its cached prefill is untested; replay with "
                "--verify to check it",
                type(model).__name__,
                config.model_type,
            )

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype, read at each use: ``model.to(...)`` after wrapping changes it (and the fingerprint)."""
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        """The model's device, read at each use like :attr:`dtype`."""
        return self.model.device

    def _check_eval(self) -> None:
        """Raise InvalidArgumentError when the model, or a module whose output training mode changes (dropout with
        p > 0, attention with a positive ``attention_dropout``), is in training mode: every forward would differ.
        Modules made in training mode by ``resize_token_embeddings`` (a new embedding or head) do not count.
        O(such modules), usually none: it runs before every forward, decode steps included; the list is made again
        when :meth:`weights_version` moves (new modules bring new parameters, as a LoRA adapter does)."""
        if self.model.training or any(module.training for module in self._droppers):
            raise InvalidArgumentError(
                f"{type(self.model).__name__} (or one of its modules) is in training mode: dropout makes cached and "
                "recomputed outputs differ; call model.eval() before serving"
            )

    @property
    def vocab_size(self) -> int:
        """``config.vocab_size``, read at each use: ``resize_token_embeddings`` changes it."""
        return int(self.config.vocab_size)

    def _resolve_head(self) -> None:
        """Find the head and base this adapter runs itself (:func:`.hf_support.plain_head`), noted by head module."""
        self._head_module = output_embeddings(self.model)
        self._head = plain_head(self.model)
        self._linears = large_cpu_linears(self._head[0]) if self._head is not None else []
        self._last_mlp = last_layer_mlp(self._head[0], self.config) if self._head is not None else None
        if self._decode_layout:
            lay_out_for_decode(self.model)

    @property
    def cache_kwarg(self) -> str:
        """The wrapped model's forward argument that takes a cache: ``"cache"`` (transformers >= 5.x releases that
        renamed it) or ``"past_key_values"``; pass a cache to the model's own calls under this name."""
        return self._cache_kwarg

    @property
    def name(self) -> str:
        """Class name and size, for reports: ``"Qwen2ForCausalLM(4 layers)"``."""
        return f"{type(self.model).__name__}({self.config.num_hidden_layers} layers)"

    @property
    def recurrent(self) -> bool:
        """Whether some layers carry a recurrent state (linear attention, SSM): a cached prefix then resumes only at
        a position where a :class:`~prefixcache.models.hf_state.RecurrentState` was kept (:meth:`take_state`)."""
        return self.layout.recurrent

    def take_state(self, live: LiveKV) -> RecurrentState:
        """A snapshot (copies) of the recurrent layers' state in ``live``, standing after ``live.num_tokens`` tokens;
        what the cache keeps on a tree node for later requests to resume from.  Its ``nbytes`` is
        :attr:`state_bytes`.  Raises InvalidArgumentError when the model has no recurrent layers or ``live`` holds
        no cache."""
        if not self.layout.recurrent:
            raise InvalidArgumentError(f"{self.name} has no recurrent layers: there is no state to take")
        if not isinstance(live, LiveKV) or live.data is None:
            raise InvalidArgumentError("take_state needs the LiveKV of a request whose forward has run")
        return take_state(live.data, self.layout, live.num_tokens)

    def weights_version(self) -> int:
        """Sum of the version counters and storage addresses of the parameters and buffers: moves on every in-place
        write to a weight (``load_state_dict``, a merged LoRA delta, ``mul_``) and on every rebinding of one.
        O(parameters) integer reads."""
        version = weights_version_of(itertools.chain(self.model.parameters(), self.model.buffers()))
        if version != self._droppers_version:
            self._droppers = [module for module in self.model.modules() if drops_in_training(module)]
            self._droppers_version = version
        return version

    def drop_weight_copies(self) -> None:
        """Drop the packed copy of the LM head (made again on the next batched forward), for a weight write that
        :meth:`weights_version` does not see; :meth:`PrefixCachingRunner.invalidate` calls it."""
        if self._head_packs is not None:
            self._head_packs.clear()

    def fingerprint(self) -> str:
        """xxh3-128 hex of the config JSON (less its load path), the model class, the dtype and every byte of every
        parameter with its name (:func:`~prefixcache.models.base.hash_weights`).

        Two checkpoints that differ in any weight (a retrained embedding row, an adapter, PEFT's trainable tokens)
        differ here, so a cache or snapshot of one is never served by the other.  Taken at wrap time and again only
        when :meth:`weights_version` moved: O(parameters) integer reads otherwise, O(weight bytes) then, on one CPU
        core about 10-25 GB/s (Qwen2.5-0.5B: 40-50 ms in bf16, 0.2 s in float32; a 7B in bf16, 15 GB: about 1.1 s).
        """
        version = self.weights_version()
        if self._fingerprint is None or version != self._fingerprint_version:
            digest = xxhash.xxh3_128()
            config = json.loads(self.config.to_json_string(use_diff=False))
            config.pop("_name_or_path", None)  # where it was loaded from, not what it computes
            digest.update(json.dumps(config, sort_keys=True).encode())
            digest.update(f"|{type(self.model).__name__}|{self.dtype}|".encode())
            hash_weights(digest, sorted(self.model.named_parameters(), key=lambda item: item[0]))
            self._fingerprint = digest.hexdigest()
            self._fingerprint_version = version
        return self._fingerprint

    @torch.inference_mode()
    def forward_cached(
        self,
        token_ids: torch.Tensor,
        start_pos: int,
        kv: torch.Tensor,
        block_table: torch.Tensor,
        *,
        return_logits: bool = False,
        live: LiveKV | None = None,
    ) -> torch.Tensor:
        """Prefill ``token_ids[n]`` at positions ``start_pos ..`` against the prefix K/V in the pool.

        Args:
            token_ids: ``[n]`` integer ids in ``[0, vocab_size)``.
            start_pos: positions already in the pool for this request (the cached prefix).
            kv: the pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, in the
                model's dtype and device.  Only the slots of positions ``start_pos .. start_pos + n - 1`` are
                written, after the forward; the prefix is read through a gather (a copy) unless ``live`` holds it.
            block_table: ``[>= ceil((start_pos + n) / block_size)]`` block ids of this request, in order.
            return_logits: logits of every new position; by default the model runs its LM head on the last
                position only (``logits_to_keep=1``).
            live: the request's :class:`~prefixcache.models.base.LiveKV`, holding one transformers cache for the
                request's lifetime: filled from the pool once, then reused and appended to by each call.

        Returns:
            float32 logits ``[1, vocab_size]`` (last position) or ``[n, vocab_size]`` with ``return_logits``; row i
            predicts position ``start_pos + i + 1``.

        Cost: the model's forward over n queries and ``start_pos + n`` keys, a scatter of n K/V rows per layer into
        the pool, and, unless ``live`` holds the prefix, a gather of ``start_pos`` rows per layer.  The cache's
        layers keep a buffer grown by doubling, so appending n rows copies n rows (amortised), not the context.
        Raises InvalidTokensError, InvalidArgumentError, CapacityError (see ``check_cached_call``), and
        UnsupportedModelError if the model's cache holds K/V of another shape than the config says.
        """
        self._check_eval()
        ids, table = check_cached_call(self, token_ids, start_pos, kv, block_table)
        reuse = check_live(live, start_pos)
        block_size = kv.shape[3]
        end_pos = start_pos + ids.numel()
        positions = torch.arange(start_pos, end_pos, device=self.device)
        flat = _flat(kv)
        cache = live.data if reuse else self._cache_from_pool(live, kv, table, start_pos, end_pos)
        try:
            logits = self._logits(
                cache, return_logits, **self._inputs(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0))
            )
            new_slots = table[positions // block_size] * block_size + positions % block_size
            flat.index_copy_(2, new_slots, self._new_kv(cache, start_pos, end_pos))
        except BaseException:
            if live is not None:
                live.reset()  # some layers may already hold rows of this failed call
            raise
        if live is not None:
            live.num_tokens = end_pos
        return logits[0].float() if return_logits else logits[0, -1:].float()

    @torch.inference_mode()
    def forward_batch(self, rows: list[BatchRow], kv: torch.Tensor) -> list[torch.Tensor]:
        """Run several requests' new tokens together; per row the float32 logits ``[1, vocab_size]`` of its last token.

        Rows with the same number of new tokens (all decode rows, for one) go through the model as one padded batch:
        each row's prefix K/V (its live cache, else gathered from the pool) is copied into one batch cache of
        ``[B, H_kv, P, D]`` per layer, ``P`` the longest prefix, the gap after a shorter prefix masked out by the
        attention mask; ``position_ids`` continue each row's own prefix, so RoPE and learned positions see exactly
        the positions of a serial call.  While the same rows step on together the batch cache is kept and appended
        to (:class:`~prefixcache.models.hf_cache.PaddedBatch`), so a decode step copies no context.  The new K/V are
        also appended to each row's live cache and written into its pool slots.  A group of one row is a plain
        :meth:`forward_cached`.  (Padded batching with per-row positions, as Hugging Face ``generate`` batches.)
        Models whose masks read cache indices as positions (windowed layers, ``Support.needs_equal_starts``) group
        only rows of equal ``start_pos``, so that no row has a gap.
        Rows must belong to different requests and write disjoint pool slots.  Raises as :meth:`forward_cached`,
        every row checked before anything runs; the rows of a failed group have their live K/V reset.
        """
        self._check_eval()
        checked = [check_cached_call(self, r.token_ids, r.start_pos, kv, r.block_table) for r in rows]
        # Rows of windowed models group only with rows at the same start: no gap, so cache index = position.
        equal_starts = self.support.needs_equal_starts
        groups: dict[tuple[int, int], list[int]] = {}
        for index, (row, (ids, _)) in enumerate(zip(rows, checked, strict=True)):
            groups.setdefault((ids.numel(), row.start_pos if equal_starts else 0), []).append(index)
        logits: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        for members in groups.values():
            if len(members) == 1 or self.layout.recurrent:
                # A recurrent model's rows run one by one: their states are per row, and the padded batch's gap
                # would run through the recurrent layers.
                for index in members:
                    row = rows[index]
                    logits[index] = self.forward_cached(
                        row.token_ids, row.start_pos, kv, row.block_table, live=row.live
                    )
                continue
            group_rows = [rows[i] for i in members]
            try:
                out = self._forward_padded(group_rows, [checked[i] for i in members], kv)
            except BaseException:
                for row in group_rows:
                    row.live.reset()
                raise
            for index, row_logits in zip(members, out, strict=True):
                logits[index] = row_logits
        return logits

    def _forward_padded(
        self, rows: list[BatchRow], checked: list[tuple[torch.Tensor, torch.Tensor]], kv: torch.Tensor
    ) -> list[torch.Tensor]:
        """One forward of ``B`` rows of ``n`` new tokens each over a padded batch cache (see :meth:`forward_batch`)."""
        n, batch = checked[0][0].numel(), len(rows)
        caches = []
        for row, (_, table) in zip(rows, checked, strict=True):
            reuse = check_live(row.live, row.start_pos)
            end_pos = row.start_pos + n
            caches.append(
                row.live.data if reuse else self._cache_from_pool(row.live, kv, table, row.start_pos, end_pos)
            )
        starts = [row.start_pos for row in rows]
        offsets = torch.arange(n, device=self.device)
        positions = torch.stack([offsets + start for start in starts])  # [B, n]
        state = PaddedBatch.find(caches, starts)
        if state is not None:
            mask = torch.cat([state.mask, state.mask.new_ones(batch, n)], dim=1)
        else:
            longest = max(starts)
            mask = torch.ones(batch, longest + n, dtype=torch.long, device=self.device)
            for b, start in enumerate(starts):
                mask[b, start:longest] = 0
            # Room for the longest any member may still grow, so that decode steps append without regrowing.
            batch_cache = self._new_cache(max(r.live.room(r.start_pos + n) - r.start_pos + longest for r in rows))
            for index, layer in enumerate(batch_cache.layers):
                keys = [
                    cache.layers[index].keys if start else None for cache, start in zip(caches, starts, strict=True)
                ]
                values = [
                    cache.layers[index].values if start else None for cache, start in zip(caches, starts, strict=True)
                ]
                layout = self.kv_layout
                layer.fill_padded(
                    keys,
                    values,
                    starts,
                    longest,
                    (layout.num_kv_heads, layout.key_dim, layout.value_dim),
                    self.dtype,
                    self.device,
                )
            state = PaddedBatch.attach(caches, mask, batch_cache)
        width = mask.shape[1] - n
        batch_cache = state.cache
        logits = self._logits(
            batch_cache,
            False,
            input_ids=torch.stack([ids for ids, _ in checked]),
            attention_mask=mask,
            position_ids=positions,
        )
        new = self._new_kv(batch_cache, width, width + n, batch)  # [L, 2, B, n, H_kv, D]
        state.mask, state.ends = mask, tuple(start + n for start in starts)
        slots = []
        for b, (row, (_, table)) in enumerate(zip(rows, checked, strict=True)):
            row_positions = offsets + row.start_pos
            slots.append(table[row_positions // kv.shape[3]] * kv.shape[3] + row_positions % kv.shape[3])
            keys, values = self.kv_layout.unpack(new[:, :, b])  # [L, n, H_kv, D_k], [L, n, H_kv, D_v]
            for layer_index, layer in enumerate(caches[b].layers):
                # [1, H_kv, n, D], the layout the model appends in.
                layer.update(keys[layer_index].transpose(0, 1)[None], values[layer_index].transpose(0, 1)[None])
            row.live.num_tokens = row.start_pos + n
        _flat(kv).index_copy_(2, torch.cat(slots), new.flatten(2, 3))
        return list(logits[:, -1].float().split(1))

    @torch.inference_mode()
    def forward_reference(
        self, token_ids: torch.Tensor, *, return_logits: bool = False, logits_from: int = 0
    ) -> torch.Tensor:
        """The model's own full forward of ``token_ids[T]`` with no cache; float32 logits ``[1, vocab_size]`` of the
        last position (``logits_to_keep=1``), or ``[T - logits_from, vocab_size]`` of positions ``logits_from ..``
        with ``return_logits`` (``logits_to_keep=T - logits_from``).

        Touches no pool.  Raises InvalidTokensError, CapacityError (``T > max_position``), InvalidArgumentError
        (``logits_from`` outside ``0 .. T - 1``).
        """
        self._check_eval()
        ids = check_reference_call(self, token_ids)
        check_logits_from(logits_from, ids.numel())
        positions = torch.arange(ids.numel(), device=self.device)
        keep = ids.numel() - logits_from if return_logits else 1
        kwargs = {"logits_to_keep": keep} if self._keeps_logits else {}
        inputs = self._inputs(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0))
        out = self.model(**inputs, use_cache=False, **kwargs)
        # A model without logits_to_keep returns every position: keep the asked ones.
        return out.logits[0, -keep:].float()

    def _inputs(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """``inputs`` less ``position_ids`` for a forward that takes none (Mamba-2: no attention, no positions)."""
        if not self._takes_positions:
            inputs.pop("position_ids", None)
        return inputs

    def _cache_from_pool(
        self, live: LiveKV | None, kv: torch.Tensor | None, table: torch.Tensor | None, start_pos: int, end_pos: int
    ) -> Any:
        """A new cache (capacity ``end_pos``, or ``live.room(end_pos)``) holding positions
        ``0 .. start_pos - 1`` gathered from the pool (a copy); it becomes ``live``'s cache when ``live`` is given.
        A recurrent model's state layers start from ``live.start_state``, which must stand at ``start_pos``
        (InvalidArgumentError otherwise: K/V alone cannot resume a recurrent layer)."""
        layout = self.layout
        state = start_state(layout, live, start_pos, self.name)
        cache = self._new_cache(live.room(end_pos) if live is not None else end_pos)
        if start_pos and layout.kv_layers:
            prefix = torch.arange(start_pos, device=self.device)
            block_size = kv.shape[3]
            slots = table[prefix // block_size] * block_size + prefix % block_size
            # index_select copies; [L, 2, start_pos, H_kv, D] -> per layer [1, H_kv, start_pos, D_k or D_v] (HF layout).
            keys, values = self.kv_layout.unpack(_flat(kv).index_select(2, slots))
            for pool_layer, layer in enumerate(layout.kv_layers):
                cache.update(keys[pool_layer].transpose(0, 1)[None], values[pool_layer].transpose(0, 1)[None], layer)
        if state is not None:
            restore_state(cache, layout, state)
        if live is not None:
            live.data, live.num_tokens = cache, start_pos
        return cache

    def _logits(self, cache: Any, return_logits: bool, **inputs: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, n or 1, vocab]`` (model dtype) of one cached forward of ``inputs``: every position with
        ``return_logits``, else the last.  A plain head (:func:`.hf_support.plain_head`) is run by us on the base's
        hidden state (few tokens: tall-skinny products; the last layer's MLP on the last position alone unless
        ``return_logits``, :mod:`.hf_last_position`); else the model's own forward with ``logits_to_keep``."""
        if output_embeddings(self.model) is not self._head_module:
            self._resolve_head()  # replaced since we looked (resize_token_embeddings, a new lm_head)
        # One decode query on the CPU attends its KV heads grouped (.hf_decode_attention), and where the layers allow,
        # through our own layer loop (.hf_decode_step); an attention mask (a padded batch) goes through the model.
        decode = inputs["input_ids"].shape[-1] == 1 and self.device.type == "cpu"
        if decode and self._head is not None:
            logits = decode_logits(self._head, self.config, cache, inputs, self._linears, self._head_packs)
            if logits is not None:
                return logits
        grouped = grouped_decode(self.config, decode)
        if self._head is None:
            with grouped:
                out = self.model(
                    **inputs, use_cache=True, **self._logits_kwargs(return_logits), **{self._cache_kwarg: cache}
                )
            return out.logits if return_logits else out.logits[:, -1:]
        base, base_cache_kwarg, head = self._head
        last = self._last_mlp if not return_logits and inputs["input_ids"].shape[-1] > 1 else None
        with tall_skinny_linears(self._linears, inputs["input_ids"].numel()), last_position_mlp(last), grouped:
            hidden = base(**inputs, use_cache=True, **{base_cache_kwarg: cache}).last_hidden_state
        return project(hidden if return_logits else hidden[:, -1:], head.weight, head.bias, self._head_packs)

    def _logits_kwargs(self, return_logits: bool) -> dict[str, int]:
        # logits_to_keep=0 means every position in transformers.
        return {"logits_to_keep": 0 if return_logits else 1} if self._keeps_logits else {}

    def _new_cache(self, capacity: int) -> Any:
        """A live transformers cache of this model's layout (:func:`~prefixcache.models.hf_state.new_live_cache`)."""
        return new_live_cache(self.config, self.layout, capacity)

    def _new_kv(self, cache: Any, start_pos: int, end_pos: int, batch: int | None = None) -> torch.Tensor:
        """K/V of positions ``start_pos .. end_pos - 1`` from ``cache`` as pool rows ``[num_layers, 2, n, H_kv, D]``
        (packed by :attr:`kv_layout` where K and V differ in size), or with ``batch`` rows as ``[num_layers, 2,
        batch, n, H_kv, D]``."""
        layout = self.kv_layout
        if not self.layout.kv_layers:  # the placeholder pool of a model without attention layers
            shape = (1, 2, end_pos - start_pos, 1, 1) if batch is None else (1, 2, batch, end_pos - start_pos, 1, 1)
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        want_k = (batch or 1, layout.num_kv_heads, end_pos, layout.key_dim)
        want_v = (*want_k[:3], layout.value_dim)
        keys, values = [], []
        for index in self.layout.kv_layers:
            layer = cache.layers[index]
            if tuple(layer.keys.shape) != want_k or tuple(layer.values.shape) != want_v:
                raise UnsupportedModelError(
                    f"{type(self.model).__name__} layer {index} cached K {tuple(layer.keys.shape)} and V "
                    f"{tuple(layer.values.shape)}, expected {want_k} and {want_v} [batch, kv_heads, positions, size] "
                    "as after its one-token probe; its attention does not keep plain per-token K/V"
                )
            keys.append(layer.keys[..., start_pos:, :])
            values.append(layer.values[..., start_pos:, :])
        if len(keys) != self.num_layers:
            raise UnsupportedModelError(
                f"{type(self.model).__name__} filled {len(keys)} cache layers, expected {self.num_layers}"
            )
        # [L, B, H_kv, n, D_k or D_v] -> [L, B, n, H_kv, D_k or D_v] -> pool rows [2, L, B, n, H_kv, D].
        rows = layout.pack(torch.stack(keys).transpose(2, 3), torch.stack(values).transpose(2, 3)).transpose(0, 1)
        return rows[:, :, 0] if batch is None else rows

    def __repr__(self) -> str:
        return f"HFCausalLM({self.name}, dtype={self.dtype}, device={self.device})"


def _flat(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` as ``[num_layers, 2, num_blocks * block_size, H_kv, D]``: a view, so index_copy_ writes the pool."""
    return kv.view(kv.shape[0], 2, kv.shape[2] * kv.shape[3], kv.shape[4], kv.shape[5])


def load_hf_model(
    path: str | os.PathLike[str], dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> HFCausalLM:
    """Load a local model folder (``config.json`` + weights) offline and wrap it; ``hf:PATH`` on the CLI.

    ``dtype=None`` keeps the checkpoint's dtype; ``device=None`` picks CUDA when available, else the CPU.
    Raises InvalidArgumentError (no such folder, or transformers cannot load it) and UnsupportedModelError.
    """
    from transformers import AutoModelForCausalLM

    folder = Path(path)
    if not folder.is_dir():
        raise InvalidArgumentError(f"model path {str(folder)!r} is not a folder")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype if dtype is not None else "auto", local_files_only=True
        )
    except (OSError, ValueError) as error:
        raise InvalidArgumentError(f"cannot load a causal LM from {str(folder)!r}: {error}") from None
    return HFCausalLM(model.to(resolve_device(device)))


def random_model_from_config(
    config_path: str | os.PathLike[str],
    layers: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> HFCausalLM:
    """A randomly initialised model of the architecture in ``config_path`` (a ``config.json`` or its folder).

    ``layers`` keeps only the first N layers (for timing runs of a large config on small hardware).  Weights come
    from the architecture's own initialiser under ``torch.manual_seed(seed)`` (the global RNG state is restored),
    so equal arguments give equal weights.  Raises InvalidArgumentError (unreadable config, unknown model type,
    ``layers`` < 1) and UnsupportedModelError.
    """
    from transformers import AutoModelForCausalLM

    config = read_config(config_path, layers)
    # Built on the CPU, so only the CPU generator needs saving and restoring.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError as error:  # no causal LM for this config class (an encoder-decoder such as T5)
            raise UnsupportedModelError(f"{config.model_type}: no causal LM for this config: {error}") from None
    return HFCausalLM(model.to(resolve_device(device)))
