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

The adapter's parts: the logits of a forward (:mod:`~prefixcache.models.hf_logits`), K/V between the pool and the
live caches (:mod:`~prefixcache.models.hf_pool`), rows batched in one padded forward
(:mod:`~prefixcache.models.hf_batch`).
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

from prefixcache.errors import InvalidArgumentError, SnapshotMismatchError, UnsupportedModelError
from prefixcache.host_allocator import release_freed_host_memory
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
from prefixcache.models.hf_batch import forward_padded
from prefixcache.models.hf_logits import HeadRunner
from prefixcache.models.hf_pool import PoolTransfer, flat_pool
from prefixcache.models.hf_state import (
    RecurrentState,
    StateLayout,
    check_resume,
    new_live_cache,
    probe_state,
    state_kinds,
    take_state,
)
from prefixcache.models.hf_state import (
    load_state as load_saved_state,
)
from prefixcache.models.hf_support import (
    TESTED_MODEL_TYPES,
    KVLayout,
    check_supported,
    drops_in_training,
    output_embeddings,
    probe_kv_layout,
    read_config,
)
from prefixcache.models.quantize import QuantizeSummary, quantize_modules, quantized_buffers

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
        self.head = HeadRunner(model, self._cache_kwarg, pack_head=pack_head, decode_layout=decode_layout)
        """Runs the model to its logits (:mod:`~prefixcache.models.hf_logits`)."""
        # The pool holds the K/V layers only (layout.kv_layers[i] in pool layer i); a model with none (pure Mamba-2)
        # gets a one-element placeholder per token that nothing reads.
        self.num_layers = len(self.layout.kv_layers) or 1
        if self.layout.kv_layers:
            probe_cache = new_live_cache(config, self.layout, 1)
            self.kv_layout = probe_kv_layout(model, self._cache_kwarg, self.layout.kv_layers, probe_cache)
        else:
            self.kv_layout = KVLayout(num_kv_heads=1, key_dim=1, value_dim=1)
        self.num_kv_heads, self.head_dim = self.kv_layout.num_kv_heads, self.kv_layout.head_dim
        self.transfer = PoolTransfer(model, self.layout, self.kv_layout, self.num_layers, self.name)
        """K/V between the pool and the live caches (:mod:`~prefixcache.models.hf_pool`)."""
        self.state_bytes = 0
        """Bytes of one recurrent-state snapshot (:meth:`take_state`); 0 for a model without recurrent layers."""
        self._state_kinds: dict[str, Any] = {}
        # A model without attention (pure Mamba-2) has no position limit of its own: 2**20 tokens then.
        self.max_position = int(getattr(config, "max_position_embeddings", None) or UNBOUNDED_POSITIONS)
        self._fingerprint: str | None = None
        self.quantization: QuantizeSummary | None = None
        """What :meth:`quantize` did; None for a dense model."""
        self._droppers: list[torch.nn.Module] = []  # the modules _check_eval watches (see there)
        self._droppers_version: int | None = None
        self.weights_version()  # makes the list
        self._fingerprint_version: int | None = None
        self.fingerprint()  # every weight hashed now, never on a request's path (until the weights change)
        if self.layout.recurrent:
            probe = probe_state(self)
            self.state_bytes = probe.nbytes
            self._state_kinds = state_kinds(probe)  # what a saved state's tensors must be (load_state)
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

    def truncate_live(self, live: LiveKV, num_tokens: int) -> None:
        """Keep only ``live``'s first ``num_tokens`` positions (a speculative verify's rejected rows dropped): each
        layer's filled length is cut, its buffer's later rows overwritten by the next append.  O(layers).  Where a
        layer is not the growing kind this model's live caches use, or the model has recurrent layers (whose state
        cannot be cut back), ``live`` is reset instead (refilled from the pool at the next call)."""
        layers = getattr(live.data, "layers", None)
        if self.layout.recurrent or not layers or num_tokens >= live.num_tokens:
            if num_tokens < live.num_tokens:
                live.reset()
            return
        if not all(
            getattr(layer, "key_buffer", None) is not None and layer.length == live.num_tokens for layer in layers
        ):
            live.reset()
            return
        for layer in layers:
            layer.length = num_tokens
            layer.keys = layer.key_buffer[..., :num_tokens, :]
            layer.values = layer.value_buffer[..., :num_tokens, :]
        live.num_tokens = num_tokens

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

    def load_state(self, position: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> RecurrentState:
        """A state a cache snapshot saved (:meth:`RecurrentState.snapshot_parts`), rebuilt on this model's device: what
        :meth:`RadixCache.restore`'s ``state_loader`` takes.  Raises SnapshotMismatchError for another model's state
        (other state layers, or a tensor of another shape or dtype)."""
        state = load_saved_state(self.layout, position, meta, tensors, self.device, self._state_kinds)
        if state.nbytes != self.state_bytes:
            raise SnapshotMismatchError(
                f"a saved recurrent state of {state.nbytes} bytes does not fit {self.name}: its states are "
                f"{self.state_bytes} bytes"
            )
        return state

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
        self.head.drop_weight_copies()

    def quantize(self, mode: str, *, group_size: int | None = None) -> QuantizeSummary:
        """Quantize every ``nn.Linear`` of the model once, in place, to ``mode`` (``"int8"`` or ``"int4"``; the LM head
        in int8: :func:`~prefixcache.models.quantize.quantize_modules`); an embedding tied to the head reads the
        head's quantized rows.  A layer the kernel cannot take stays dense (named in the summary).  The fingerprint
        changes.  Returns the summary, also kept as :attr:`quantization`.

        Raises InvalidArgumentError: another mode or group size, a model already quantized, or not on the CPU.
        """
        if self.quantization is not None:
            raise InvalidArgumentError(f"the model is already quantized ({self.quantization.describe()})")
        if self.device.type != "cpu":
            raise InvalidArgumentError(f"quantized weights run on the CPU only; the model is on {self.device}")
        summary = quantize_modules(self.model, mode, group_size, head=output_embeddings(self.model))
        self.quantization = summary
        self.head.drop_weight_copies()
        self.head.resolve()  # the head and the large layers it noted were replaced
        self._fingerprint = None
        self.fingerprint()
        release_freed_host_memory()  # the dense weights just freed, kept by the heap otherwise
        return summary

    def fingerprint(self) -> str:
        """xxh3-128 hex of the config JSON (less its load path), the model class, the dtype and every byte of every
        parameter with its name (:func:`~prefixcache.models.base.hash_weights`), and of a quantized model's codes and
        scales (:meth:`quantize`).

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
            if self.quantization is not None:
                digest.update(f"|quantized {self.quantization.describe()}|".encode())
                hash_weights(digest, quantized_buffers(self.model))
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
        flat = flat_pool(kv)
        cache = live.data if reuse else self.transfer.cache_from_pool(live, kv, table, start_pos, end_pos)
        try:
            logits = self.head.logits(
                cache, return_logits, **self._inputs(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0))
            )
            new_slots = table[positions // block_size] * block_size + positions % block_size
            flat.index_copy_(2, new_slots, self.transfer.new_rows(cache, start_pos, end_pos))
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
                out = forward_padded(group_rows, [checked[i] for i in members], kv, self.transfer, self.head.logits)
            except BaseException:
                for row in group_rows:
                    row.live.reset()
                raise
            for index, row_logits in zip(members, out, strict=True):
                logits[index] = row_logits
        return logits

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
        kwargs = self.head.keep_kwargs(keep)
        inputs = self._inputs(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0))
        out = self.model(**inputs, use_cache=False, **kwargs)
        # A model without logits_to_keep returns every position: keep the asked ones.
        return out.logits[0, -keep:].float()

    def _inputs(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """``inputs`` less ``position_ids`` for a forward that takes none (Mamba-2: no attention, no positions)."""
        if not self._takes_positions:
            inputs.pop("position_ids", None)
        return inputs

    def __repr__(self) -> str:
        quantized = f", quantized={self.quantization.describe()}" if self.quantization is not None else ""
        return f"HFCausalLM({self.name}, dtype={self.dtype}, device={self.device}{quantized})"


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
