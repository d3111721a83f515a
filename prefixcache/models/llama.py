"""Our embedded Llama-style decoder with seeded random weights: the default model of prefixcache.

Per layer: RMSNorm -> grouped-query attention with half-rotation rotary embeddings -> residual, then
RMSNorm -> SwiGLU MLP -> residual; a final RMSNorm and an untied LM head.  Weights are drawn from
``torch.Generator().manual_seed(config.seed)`` on the CPU in fp32 and then cast, so a preset gives the
same weights on every machine and device.

Both entry points run one shared forward; they differ only in where a layer's keys and values come
from (the paged pool, or the tensors just computed), which is what makes cached and uncached logits
agree to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import xxhash

from prefixcache.errors import InvalidArgumentError
from prefixcache.host_allocator import release_freed_host_memory
from prefixcache.models.base import (
    BatchRow,
    LiveKV,
    ModelConfig,
    check_cached_call,
    check_live,
    check_logits_from,
    check_reference_call,
    config_fingerprint,
    resolve_device,
    weights_version_of,
)
from prefixcache.models.linear import WeightPacks, linear, one_row_layout
from prefixcache.models.paged_attention import PagedAttention, paged_attention_default, paged_attention_supported
from prefixcache.models.quantize import QuantizedWeight, QuantizeSummary, quantize_tensors, weight_tensors
from prefixcache.models.shared_prefix import plan_shared_prefix_groups, shared_prefix_decode_attention

# Names the forward and init code below; bump it whenever either changes the numbers, so that no
# cache built by older code is ever matched against a newer model.  /2: attention reads the KV heads without
# repeating them (grouped decode queries, SDPA's enable_gqa), which rounds differently from /1.
ARCHITECTURE = "prefixcache.llama/2"

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=176,
        max_position=32768,
        seed=1234,
        embed_std=0.05,
    ),
    "small": ModelConfig(
        name="small",
        vocab_size=512,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=1408,
        max_position=32768,
        seed=1234,
        embed_std=0.3,
    ),
}

_GROUPED_QUERIES = 16
"""Queries after a prefix up to which attention runs in the decode layout (one masked call per KV head group)."""

# Queries per attention call: bounds the [heads, queries, keys] score matrix of a long prefill.
_QUERY_CHUNK = 1024

# (layer index, new K [n, H_kv, D], new V [n, H_kv, D]) -> (K, V) of all positions [S, H_kv, D].
_KVSource = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (q [n, H, D], K, V from the source, position of the first query) -> [n, H * D].
_Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


_Weight = torch.Tensor | QuantizedWeight


@dataclass(slots=True)
class _LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: _Weight  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]; Q, K, V rows fused
    o: _Weight  # [hidden, num_heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: _Weight  # [2 * intermediate, hidden]; gate rows then up rows
    down: _Weight  # [hidden, intermediate]


_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class LlamaModel:
    """A seeded Llama-style decoder implementing :class:`prefixcache.models.base.CausalLM`.

    Build one with :func:`build_model`.  ``paged_attention`` (bool, default: on CUDA) makes :meth:`forward_cached`
    attend through the pool's block table instead of gathering the context.  Not thread-safe with respect to a
    shared pool: the caller (the runner) owns which slots are written.
    """

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidArgumentError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.config = config
        self.num_layers = config.num_layers
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.vocab_size = config.vocab_size
        self.max_position = config.max_position
        self.dtype = dtype
        self.device = resolve_device(device)
        # forward_cached attends through the pool's block table (models.paged_attention) instead of gathering.
        self.paged_attention = paged_attention_default(self.device)
        self._config_fingerprint = config_fingerprint(config, architecture=ARCHITECTURE, dtype=dtype)
        self._fingerprint: str | None = None
        self._packs = WeightPacks()  # oneDNN copies of the weights for forwards of 2-64 rows on the CPU
        self._fingerprint_version: int | None = None
        self.quantization: QuantizeSummary | None = None
        """What :meth:`quantize` did; None for a dense model."""
        self._init_weights()
        half = config.head_dim // 2
        # float64 for the exponent so the frequencies do not depend on fp32 pow rounding.
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / config.head_dim))
        self._inv_freq = inv_freq.to(device=self.device, dtype=torch.float32)

    def _init_weights(self) -> None:
        c = self.config
        gen = torch.Generator().manual_seed(c.seed)

        def normal(*shape: int, std: float = c.init_std) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen, dtype=torch.float32) * std
            return w.to(device=self.device, dtype=self.dtype)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device, dtype=self.dtype)

        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # Plain std-0.02 weights everywhere give near-uniform attention and tiny logits, and a residual
        # stream where the context average drowns the current token, so greedy decoding gets stuck on one
        # token.  Q/K and the LM head therefore get fan-in-scaled std (attention scores and logits of order
        # 1), and each preset sets embed_std near one layer's output scale (about init_std**2 * hidden) so
        # that both the current token and the context move the argmax.
        qk_std = 1.0 / math.sqrt(c.hidden_size)
        self.embed = normal(c.vocab_size, c.hidden_size, std=c.embed_std)
        self.layers: list[_LayerWeights] = []
        for _ in range(c.num_layers):
            qkv = torch.cat(
                [
                    normal(q_dim, c.hidden_size, std=qk_std),
                    normal(kv_dim, c.hidden_size, std=qk_std),
                    normal(kv_dim, c.hidden_size),
                ]
            )
            self.layers.append(
                _LayerWeights(
                    attn_norm=ones(c.hidden_size),
                    qkv=one_row_layout(qkv),
                    o=normal(c.hidden_size, q_dim),
                    mlp_norm=ones(c.hidden_size),
                    gate_up=one_row_layout(normal(2 * c.intermediate_size, c.hidden_size)),
                    down=normal(c.hidden_size, c.intermediate_size),
                )
            )
        self.final_norm = ones(c.hidden_size)
        # Widening weights column-major: a decode step's one-row products read them faster (see one_row_layout).
        self.lm_head: _Weight = one_row_layout(normal(c.vocab_size, c.hidden_size, std=2.0 / math.sqrt(c.hidden_size)))

    def quantize(self, mode: str, *, group_size: int | None = None) -> QuantizeSummary:
        """Quantize the weights of the projections (fused Q/K/V, O, fused gate/up, down) and the LM head once, in
        place, to ``mode`` (``"int8"`` or ``"int4"``, the head in int8: :mod:`~prefixcache.models.quantize`); a weight
        the kernel cannot take stays dense (named in the summary).  The embedding and the norms stay dense.  The
        fingerprint changes.  Returns the summary, also kept as :attr:`quantization`.

        Raises InvalidArgumentError: another mode or group size, a model already quantized, or not on the CPU.
        """
        if self.quantization is not None:
            raise InvalidArgumentError(f"the model is already quantized ({self.quantization.describe()})")
        if self.device.type != "cpu":
            raise InvalidArgumentError(f"quantized weights run on the CPU only; the model is on {self.device}")
        named = {"lm_head": self.lm_head}
        for i, layer in enumerate(self.layers):
            named.update({f"layers.{i}.{part}": getattr(layer, part) for part in _PROJECTIONS})
        quantized, summary = quantize_tensors(named, mode, group_size, head="lm_head")
        self.lm_head = quantized["lm_head"]
        for i, layer in enumerate(self.layers):
            for part in _PROJECTIONS:
                setattr(layer, part, quantized[f"layers.{i}.{part}"])
        self.quantization = summary
        self._config_fingerprint = f"{self._config_fingerprint}|quantized {summary.describe()}"
        self._fingerprint = None
        self._packs.clear()
        release_freed_host_memory()  # the dense weights just freed, kept by the heap otherwise
        return summary

    def fingerprint(self) -> str:
        """xxh64 hex of architecture version, config (seed included), dtype and every weight's bytes; equal across
        builds.  The weights are hashed again only when :meth:`weights_version` moved (O(parameters) then)."""
        version = self.weights_version()
        if self._fingerprint is None or version != self._fingerprint_version:
            digest = xxhash.xxh64(self._config_fingerprint.encode())
            for tensor in self._weights():
                digest.update(tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
            self._fingerprint = digest.hexdigest()
            self._fingerprint_version = version
        return self._fingerprint

    def weights_version(self) -> int:
        """Sum of the weights' version counters and storage addresses: moves on every in-place write to a weight and
        on every rebinding of one.  O(tensors)."""
        return weights_version_of(self._weights())

    def drop_weight_copies(self) -> None:
        """Drop the packed weight copies of :meth:`forward_batch` (made again on its next forward), for a weight
        write that :meth:`weights_version` does not see; :meth:`PrefixCachingRunner.invalidate` calls it."""
        self._packs.clear()

    def _weights(self) -> list[torch.Tensor]:
        weights = [self.embed, self.final_norm, self.lm_head]
        for layer in self.layers:
            weights += [layer.attn_norm, layer.qkv, layer.o, layer.mlp_norm, layer.gate_up, layer.down]
        return [tensor for weight in weights for tensor in weight_tensors(weight)]

    def parameter_count(self) -> int:
        """Number of weights (embedding, layers, final norm, LM head; a quantized weight counts its ``N * K``)."""
        weights = [self.embed, self.final_norm, self.lm_head]
        for layer in self.layers:
            weights += [layer.attn_norm, layer.qkv, layer.o, layer.mlp_norm, layer.gate_up, layer.down]
        return sum(weight.numel() for weight in weights)

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
            start_pos: number of positions already in the pool for this request (the cached prefix).
            kv: the pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, contiguous,
                in the model's dtype and device.  Only the slots of positions ``start_pos .. start_pos+n-1``
                are written; prefix slots may belong to blocks shared with other requests.
            block_table: ``[>= ceil((start_pos + n) / block_size)]`` block ids of this request, in order.
            return_logits: logits of every new position, not only the last (the LM head is the largest matmul
                of a small model's forward, so it runs only where asked).
            live: the request's :class:`~prefixcache.models.base.LiveKV`; when it holds ``start_pos`` positions
                the prefix is read from it (no gather), and the new rows are appended to it.  Its buffer is
                ``[num_layers, 2, capacity, H_kv, D]``, grown by doubling.

        Returns:
            float32 logits ``[1, vocab_size]`` of the last position, or ``[n, vocab_size]`` with
            ``return_logits``; row i predicts position ``start_pos + i + 1``.

        With ``paged_attention`` (default on CUDA) attention reads the pool through ``block_table`` in place (see
        :mod:`prefixcache.models.paged_attention`) and ``live`` is not used.
        Cost: O(n * (start_pos + n)) attention plus, without a filled ``live``, a gather of ``start_pos + n`` K/V
        rows per layer; with it, a copy of n rows per layer (amortised).
        Raises InvalidTokensError, InvalidArgumentError, CapacityError (see ``check_cached_call``).
        """
        ids, table = check_cached_call(self, token_ids, start_pos, kv, block_table)
        reuse = check_live(live, start_pos)
        num_blocks, block_size = kv.shape[2], kv.shape[3]
        end_pos = start_pos + ids.numel()
        all_pos = torch.arange(end_pos, device=self.device)
        positions = all_pos[start_pos:]
        slots_new = table[positions // block_size] * block_size + positions % block_size  # [n]
        # [num_layers, 2, num_blocks * block_size, H_kv, D]: a view, so index_copy_ writes the pool itself.
        flat = kv.view(self.num_layers, 2, num_blocks * block_size, self.num_kv_heads, self.head_dim)
        if self.paged_attention and paged_attention_supported(kv.device, block_size):

            def into_pool(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                flat[layer].index_copy_(1, slots_new, torch.stack([k, v]))
                return flat[layer, 0], flat[layer, 1]

            if live is not None:
                live.reset()  # its rows would go stale while the pool alone is written
            attend = PagedAttention(table, end_pos, num_blocks, block_size)
            return self._forward(ids, start_pos, into_pool, return_logits, attend)
        if live is not None:
            buffer = self._live_buffer(live, reuse, kv, table, start_pos, end_pos)

            def from_live(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                new = torch.stack([k, v])
                flat[layer].index_copy_(1, slots_new, new)
                buffer[layer, :, start_pos:end_pos] = new
                return buffer[layer, 0, :end_pos], buffer[layer, 1, :end_pos]

            logits = self._forward(ids, start_pos, from_live, return_logits)
            live.num_tokens = end_pos
            return logits
        slots_all = table[all_pos // block_size] * block_size + all_pos % block_size  # [start_pos + n]

        def from_pool(layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            flat[layer].index_copy_(1, slots_new, torch.stack([k, v]))
            kv_all = flat[layer].index_select(1, slots_all)  # [2, start_pos + n, H_kv, D]
            return kv_all[0], kv_all[1]

        return self._forward(ids, start_pos, from_pool, return_logits)

    @torch.inference_mode()
    def forward_batch(self, rows: list[BatchRow], kv: torch.Tensor) -> list[torch.Tensor]:
        """One packed forward over several requests' new tokens (continuous batching, as in vLLM and SGLang).

        Every row's tokens go through the projections, MLPs and LM head together (``[sum n, hidden]`` matmuls);
        attention runs per row over that row's live K/V (a varlen loop: rows have different contexts; with the KV heads
        never repeated, a decode row's attention reads its context once, and padding the rows into one batch would
        copy every context once more per step).  Each row's
        new K/V are written into its pool slots and appended to its ``live``.  Returns per row the float32 logits
        ``[1, vocab_size]`` of its last position, ``[n, vocab_size]`` for a row with ``return_logits`` (a speculative
        verify: its positions reach the LM head with the others).  Rows must belong to different requests.  Raises as
        :meth:`forward_cached` (checked for every row before anything is written).

        On the CPU in float32, forwards of 2-64 rows multiply by oneDNN-packed copies of the weights
        (:class:`~prefixcache.models.linear.WeightPacks`, made on first use and again after a weight changes: the
        model's size in memory once more); results equal ``F.linear``'s up to float rounding.
        """
        if not rows:
            return []
        num_blocks, block_size = kv.shape[2], kv.shape[3]
        flat = kv.view(self.num_layers, 2, num_blocks * block_size, self.num_kv_heads, self.head_dim)
        checked = [check_cached_call(self, r.token_ids, r.start_pos, kv, r.block_table) for r in rows]
        spans, buffers, slots, all_ids, all_pos = [], [], [], [], []
        offset = 0
        for row, (ids, table) in zip(rows, checked, strict=True):
            end_pos = row.start_pos + ids.numel()
            positions = torch.arange(row.start_pos, end_pos, device=self.device)
            reuse = check_live(row.live, row.start_pos)
            buffers.append(self._live_buffer(row.live, reuse, kv, table, row.start_pos, end_pos))
            slots.append(table[positions // block_size] * block_size + positions % block_size)
            spans.append((offset, offset + ids.numel(), row.start_pos, end_pos))
            all_ids.append(ids)
            all_pos.append(positions)
            offset += ids.numel()
        ids, positions, new_slots = torch.cat(all_ids), torch.cat(all_pos), torch.cat(slots)
        lasts = torch.tensor([hi - 1 for _, hi, _, _ in spans], device=self.device)
        # The positions that reach the LM head: each row's last, every one of a row that asks for its logits.
        to_head = [
            range(lo, hi) if row.return_logits else range(hi - 1, hi)
            for row, (lo, hi, _, _) in zip(rows, spans, strict=True)
        ]
        head_rows = torch.tensor([i for span in to_head for i in span], device=self.device)
        groups = plan_shared_prefix_groups(
            [table.tolist() for _, table in checked],
            [end for _, _, _, end in spans],
            [r for r, (lo, hi, _, _) in enumerate(spans) if hi - lo == 1],
            block_size,
            self.device,
        )
        grouped = {r for group in groups for r in group.rows}
        group_queries = [lasts[list(group.rows)] for group in groups]
        n, heads, kv_heads, d = ids.numel(), self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self._rope(positions)
        packs = self._packs
        x = self.embed[ids]
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.attn_norm)
            q, k, v = linear(h, layer.qkv, packs=packs).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
            q = self._apply_rope(q.view(n, heads, d), cos, sin)
            new = torch.stack([self._apply_rope(k.view(n, kv_heads, d), cos, sin), v.view(n, kv_heads, d)])
            final = i == len(self.layers) - 1
            flat[i].index_copy_(1, new_slots, new)  # rows write disjoint slots: one copy for all
            outs: list[torch.Tensor] = []
            for r, ((lo, hi, start, end), buffer) in enumerate(zip(spans, buffers, strict=True)):
                buffer[i, :, start:end] = new[:, lo:hi]
                # Last layer: only the queries that reach the LM head.
                q_lo = to_head[r].start if final else lo
                if r not in grouped:
                    outs.append(self._attention(q[q_lo:hi], buffer[i, 0, :end], buffer[i, 1, :end], end - hi + q_lo))
                else:
                    outs.append(q.new_empty(0))
            for group, rows_q in zip(groups, group_queries, strict=True):
                # Rows share the pool blocks of positions < shared_tokens: the first row's live copy serves them all.
                shared = buffers[group.rows[0]][i, :, : group.shared_tokens]
                suffix = flat[i].index_select(1, group.suffix_slots)  # [2, T, H_kv, D], every member's own keys
                o = shared_prefix_decode_attention(
                    q[rows_q], shared[0], shared[1], suffix[0], suffix[1], group.suffix_bias
                )
                for j, r in enumerate(group.rows):
                    outs[r] = o[j : j + 1]
            if final:
                x = x[head_rows]
            x = x + linear(torch.cat(outs), layer.o, packs=packs)
            h = self._rms_norm(x, layer.mlp_norm)
            x = x + linear(_swiglu(linear(h, layer.gate_up, packs=packs)), layer.down, packs=packs)
        logits = linear(self._rms_norm(x, self.final_norm), self.lm_head, packs=packs).float()
        for row, (_, _, _, end) in zip(rows, spans, strict=True):
            row.live.num_tokens = end
        return list(logits.split([len(span) for span in to_head]))

    batch_row_logits = True
    """:meth:`forward_batch` returns every position's logits of a row that asks (``BatchRow.return_logits``)."""

    def truncate_live(self, live: LiveKV, num_tokens: int) -> None:
        """Keep only ``live``'s first ``num_tokens`` positions (of those it holds): its buffer's later rows are
        overwritten by the next call's appends.  O(1)."""
        if live.data is not None and num_tokens < live.num_tokens:
            live.num_tokens = num_tokens

    def _live_buffer(
        self, live: LiveKV, reuse: bool, kv: torch.Tensor, table: torch.Tensor, start_pos: int, end_pos: int
    ) -> torch.Tensor:
        """The live buffer ``[L, 2, capacity >= end_pos, H_kv, D]`` holding positions ``0 .. start_pos - 1``.

        The prefix is read from the pool (``kv``, through ``table``) only when ``live`` does not hold it: whole blocks
        are copied block by block straight into the buffer (one copy, no per-token index), the partial last block
        token by token.
        """
        buffer = live.data if reuse else None
        if buffer is not None and buffer.shape[2] >= end_pos:
            return buffer
        capacity = max(live.room(end_pos), 2 * (buffer.shape[2] if buffer is not None else 0), 64)
        grown = torch.empty(
            (self.num_layers, 2, capacity, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device
        )
        if buffer is not None:
            grown[:, :, :start_pos] = buffer[:, :, :start_pos]
        elif start_pos:
            num_blocks, block_size = kv.shape[2], kv.shape[3]
            full = start_pos // block_size
            blocks = kv.view(self.num_layers, 2, num_blocks, -1)  # [L, 2, blocks, block_size * H_kv * D]
            flat = kv.view(self.num_layers, 2, num_blocks * block_size, self.num_kv_heads, self.head_dim)
            rest = start_pos - full * block_size
            rest_slots = table[full] * block_size + torch.arange(rest, device=self.device) if rest else None
            for layer in range(self.num_layers):
                for kind in range(2):
                    if full:
                        out = grown[layer, kind, : full * block_size].view(full, -1)
                        torch.index_select(blocks[layer, kind], 0, table[:full], out=out)
                    if rest_slots is not None:
                        torch.index_select(
                            flat[layer, kind], 0, rest_slots, out=grown[layer, kind, full * block_size : start_pos]
                        )
        live.data = grown
        live.num_tokens = start_pos
        return grown

    @torch.inference_mode()
    def forward_reference(
        self, token_ids: torch.Tensor, *, return_logits: bool = False, logits_from: int = 0
    ) -> torch.Tensor:
        """Uncached full causal forward of ``token_ids[T]``; float32 logits ``[1, vocab_size]`` of the last position,
        or ``[T - logits_from, vocab_size]`` of positions ``logits_from ..`` with ``return_logits``.

        Touches no pool.  Cost: O(T^2) attention.  Raises InvalidTokensError, CapacityError
        (``T > max_position``), InvalidArgumentError (``logits_from`` outside ``0 .. T - 1``).
        """
        ids = check_reference_call(self, token_ids)
        check_logits_from(logits_from, ids.numel())
        keep = logits_from if return_logits else ids.numel() - 1
        return self._forward(ids, 0, lambda _layer, k, v: (k, v), return_logits, logits_from=keep)

    def _forward(
        self,
        ids: torch.Tensor,
        start: int,
        kv_source: _KVSource,
        return_logits: bool,
        attend: _Attend | None = None,
        logits_from: int | None = None,
    ) -> torch.Tensor:
        """ids ``[n]`` at positions ``start .. start + n - 1``; K/V of earlier positions come from ``kv_source`` and
        are attended by ``attend(q, K, V, first query position)`` (default :meth:`_attention`).  Logits of the last
        position, of every position with ``return_logits``, or of ``ids[logits_from:]`` when given."""
        if logits_from is None:
            logits_from = 0 if return_logits else ids.numel() - 1
        attend = attend or self._attention
        # 2-64 rows (a speculative verify, a short chunk) multiply through the packed weights, as forward_batch's:
        # small-M GEMMs on the CPU are several times slower than the one-row product otherwise.
        packs = self._packs
        n, heads, kv_heads, d = ids.numel(), self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = self._rope(torch.arange(start, start + n, device=self.device))
        x = self.embed[ids]  # [n, hidden]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.attn_norm)
            q, k, v = linear(h, layer.qkv, packs=packs).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
            q = self._apply_rope(q.view(n, heads, d), cos, sin)
            k = self._apply_rope(k.view(n, kv_heads, d), cos, sin)
            k_all, v_all = kv_source(i, k, v.view(n, kv_heads, d))
            if i == last and logits_from:
                # Only these positions' hidden states reach the LM head: their attention queries and MLP suffice.
                q, x, start, n = q[logits_from:], x[logits_from:], start + logits_from, n - logits_from
            x = x + linear(attend(q, k_all, v_all, start), layer.o, packs=packs)
            h = self._rms_norm(x, layer.mlp_norm)
            x = x + linear(_swiglu(linear(h, layer.gate_up, packs=packs)), layer.down, packs=packs)
        h = self._rms_norm(x, self.final_norm)
        return linear(h, self.lm_head, packs=packs).float()

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q ``[n, H, D]`` at positions ``start .. start + n - 1``; k, v ``[start + n, H_kv, D]`` -> ``[n, H * D]``.

        Query i sees keys at positions <= start + i; head h reads KV head ``h // (H / H_kv)``.  The KV heads are never
        repeated (that copy of the whole context per step cost more than the attention itself): one query (decode)
        is laid out as ``[H_kv, H / H_kv, D]``, so each KV head's group of query heads attends it in one unmasked
        call; longer blocks use SDPA's ``enable_gqa`` with a causal mask, bottom-right aligned.
        """
        n, kv_heads = q.shape[0], self.num_kv_heads
        group = self.num_heads // kv_heads
        k = k.transpose(0, 1).unsqueeze(0)  # [1, H_kv, S, D] (a view)
        v = v.transpose(0, 1).unsqueeze(0)
        if n == 1:
            o = F.scaled_dot_product_attention(q.view(1, kv_heads, group, -1), k, v)  # [1, H_kv, group, D]
            return o.reshape(1, -1)
        if start and n <= _GROUPED_QUERIES:
            # A few queries after a prefix (a speculative verify): each KV head's group of query heads and queries in
            # one masked call, as decode lays them out, rather than SDPA's GQA path (measured 1.3-2x faster at 2k).
            d = q.shape[-1]
            grouped = q.view(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, d)
            key_pos = torch.arange(k.shape[2], device=q.device)
            mask = (key_pos[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]).repeat(group, 1)
            o = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)  # [1, H_kv, group * n, D]
            return o.view(kv_heads, group, n, d).permute(2, 0, 1, 3).reshape(n, -1)
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if start == 0 and n <= _QUERY_CHUNK:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1)
            return o[0].transpose(0, 1).reshape(n, -1)
        key_pos = torch.arange(k.shape[2], device=q.device)
        out = []
        for lo in range(0, n, _QUERY_CHUNK):
            hi = min(lo + _QUERY_CHUNK, n)
            query_pos = torch.arange(start + lo, start + hi, device=q.device)
            mask = key_pos[None, : start + hi] <= query_pos[:, None]  # [chunk, keys]: causal, prefix included
            out.append(
                F.scaled_dot_product_attention(
                    q[:, :, lo:hi], k[:, :, : start + hi], v[:, :, : start + hi], attn_mask=mask, enable_gqa=group > 1
                )
            )
        o = out[0] if len(out) == 1 else torch.cat(out, dim=2)  # [1, H, n, D]
        return o[0].transpose(0, 1).reshape(n, -1)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[n, 1, D]`` (fp32) for half-rotation RoPE at integer ``positions[n]``."""
        angles = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]  # [n, D/2]
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos(), angles.sin()

    def _apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x[n, heads, D]``: element i pairs with i + D/2 (Llama's rotate_half), in fp32."""
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (xf * cos + rotated * sin).to(self.dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim, computed in fp32 so bf16/fp16 models stay stable."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.config.rms_norm_eps)
        return (xf * weight.float()).to(self.dtype)

    def __repr__(self) -> str:
        quantized = f", quantized={self.quantization.describe()}" if self.quantization is not None else ""
        return (
            f"LlamaModel({self.config.name!r}, params={self.parameter_count():,}, dtype={self.dtype}, "
            f"device={self.device}{quantized})"
        )


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the MLP's product ``gate_up[n, 2 * intermediate]`` (gate columns, then up), computed
    in place in the gate half, returned as ``[n, intermediate]`` (a view of ``gate_up``, rows ``2 * intermediate``
    apart).  Equal to ``F.silu(gate) * up`` bit for bit; it allocates nothing where that allocates two
    ``[n, intermediate]`` tensors (40 MB at 1,024 tokens on Qwen2.5-0.5B's shape), each fresh pages to fault in."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def build_model(
    preset: str = "tiny", *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> LlamaModel:
    """Build the named preset (see ``PRESETS``); ``device=None`` picks CUDA when available, else CPU.

    Raises InvalidArgumentError for an unknown preset (the message lists the known ones) or a
    non-floating dtype.
    """
    if preset not in PRESETS:
        raise InvalidArgumentError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    return LlamaModel(PRESETS[preset], dtype=dtype, device=device)
