"""The model protocol that prefix caching drives, its configuration record, and the shared input checks.

A model here is anything that can (a) prefill new tokens against a prefix whose K/V already sit in the
paged pool, and (b) recompute a whole sequence with no cache at all, on the same weights.  The second
exists to prove the first exact.

Pool layout, shared with the block pool: one tensor
``kv[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K, 1 = V).  The token at
absolute position ``p`` of a request lives in block ``block_table[p // block_size]``, row
``p % block_size``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import xxhash

from prefixcache.errors import CapacityError, InvalidArgumentError, InvalidTokensError


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Architecture and weight seed of a decoder; two equal configs build bit-identical weights.

    Sizes are counts (``head_dim`` in elements, not bytes); ``max_position`` is the most positions one
    sequence may use, prefix included.  ``init_std`` and ``embed_std`` are the standard deviations of the
    seeded random projection and embedding weights.  Raises :class:`InvalidArgumentError` on construction if a size
    is not positive or the heads do not divide into KV groups.
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    seed: int = 0
    init_std: float = 0.02
    embed_std: float = 0.02

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        # Half-rotation RoPE pairs element i with i + head_dim / 2.
        if self.head_dim % 2:
            raise InvalidArgumentError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0 and self.init_std > 0 and self.embed_std > 0):
            raise InvalidArgumentError("rope_theta, rms_norm_eps, init_std and embed_std must be positive")

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of pool one cached token occupies across all layers, K and V: ``2 * L * H_kv * D * element_size``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    def canonical_json(self) -> str:
        """The config as JSON with sorted keys and no whitespace; the input of every fingerprint."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


@runtime_checkable
class CausalLM(Protocol):
    """What the prefix cache needs from a decoder-only model (ours, or an adapter around another).

    Implementations must be exact: ``forward_cached`` over a pool filled by earlier ``forward_cached``
    calls returns the same logits as ``forward_reference`` on the whole sequence (fp32: within 1e-4).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    dtype: torch.dtype
    device: torch.device

    def fingerprint(self) -> str:
        """Stable hex id of architecture, weights and KV dtype; caches are never shared across fingerprints."""
        ...

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
        """Prefill ``token_ids[n]`` at positions ``start_pos .. start_pos + n - 1`` against the pooled prefix.

        Writes the K/V of the n new tokens into their slots of ``kv`` (and no other slot), attends over
        positions ``0 .. start_pos + n - 1`` reading the prefix from the pool through ``block_table``
        (at least ``ceil((start_pos + n) / block_size)`` ids), and returns float32 logits: ``[1, vocab_size]``
        for the last position only (the LM head runs on nothing else), or ``[n, vocab_size]`` with
        ``return_logits=True``.  With ``live`` (see :class:`LiveKV`) the prefix is read from the request's live
        K/V instead of the pool when it holds exactly ``start_pos`` positions, and the new rows are appended to it.
        Raises InvalidTokensError, InvalidArgumentError or CapacityError (see :func:`check_cached_call`).
        """
        ...

    def forward_reference(
        self, token_ids: torch.Tensor, *, return_logits: bool = False, logits_from: int = 0
    ) -> torch.Tensor:
        """Full causal recompute of ``token_ids[T]`` with no pool; float32 logits ``[1, vocab_size]`` of the last
        position, or ``[T - logits_from, vocab_size]`` (positions ``logits_from .. T - 1``; the LM head runs on
        nothing else) with ``return_logits=True``.  ``logits_from`` must be in ``0 .. T - 1``."""
        ...


class LiveKV:
    """One request's K/V kept alive across its ``forward_cached`` calls (decode against live KV).

    Without it every decode step would gather the request's whole prefix out of the pool again, a copy that grows
    with the context at every token.  With it, the first call fills the live K/V from the pool once; each later call
    at ``start_pos == num_tokens`` reads the prefix from here, appends its new rows here and writes them into the
    pool (so the pool stays the source of truth that the tree caches).  A call at any other ``start_pos`` refills it
    from the pool.  The live rows are bit-identical copies of the pool's rows, so outputs are unchanged.

    The model owns ``data`` (a transformers ``Cache`` for :class:`~prefixcache.models.hf.HFCausalLM`, per-layer
    ``[capacity, H_kv, D]`` buffers for the embedded model); callers create an empty one per request, pass it to
    every call of that request, and drop it when the request ends.  ``capacity`` (positions; 0, the default: not
    known) is how far the request may grow, prompt plus tokens to generate: the first fill reserves room for that
    many (at most twice what it fills, as growth by doubling would), so that the first decode step does not regrow
    (copy) a buffer sized to the prompt.  Not thread-safe: one request, one thread.
    """

    __slots__ = ("capacity", "data", "num_tokens", "start_state")

    def __init__(self, capacity: int = 0) -> None:
        self.num_tokens = 0
        self.capacity = capacity
        self.data: Any = None
        # A recurrent model's state snapshot at the position the next fill from the pool starts at (the cache's
        # resume point, from the lease); None: the initial state.  Models without recurrent layers ignore it.
        self.start_state: Any = None

    def room(self, end_pos: int) -> int:
        """Positions to allocate when a fill must hold ``end_pos``: ``capacity``, within ``end_pos .. 2 * end_pos``."""
        return max(end_pos, min(self.capacity, 2 * end_pos))

    def reset(self) -> None:
        """Forget the live K/V and recurrent state (the next call refills from the pool and ``start_state``)."""
        self.num_tokens = 0
        self.data = None

    def __repr__(self) -> str:
        return f"LiveKV(num_tokens={self.num_tokens}, capacity={self.capacity})"


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One request's part of a batched step: ``token_ids[n]`` at positions ``start_pos ..`` through ``block_table``,
    with the request's :class:`LiveKV` (a prefill chunk has n >= 1 tokens, a decode step one).  ``return_logits``
    asks for the logits of every one of its positions, not only the last."""

    token_ids: torch.Tensor
    start_pos: int
    block_table: torch.Tensor
    live: LiveKV
    return_logits: bool = False


def truncate_live(model: CausalLM, live: LiveKV, num_tokens: int) -> None:
    """Make ``live`` hold only the first ``num_tokens`` of the positions it holds (a speculative verify wrote rows
    for draft tokens that were rejected): the model's own ``truncate_live(live, num_tokens)`` where it has one (O(1)),
    else ``live.reset()`` (the next call refills it from the pool: correct, one gather slower).  The pool's rows past
    ``num_tokens`` are left as they are; the next call at ``start_pos == num_tokens`` overwrites them."""
    if live.data is None or live.num_tokens <= num_tokens:
        return
    own = getattr(model, "truncate_live", None)
    if own is not None:
        own(live, num_tokens)
    else:
        live.reset()


def forward_batch(model: CausalLM, rows: list[BatchRow], kv: torch.Tensor) -> list[torch.Tensor]:
    """Run every row's tokens in one step; returns per row the float32 logits ``[1, vocab_size]`` of its last position
    (``[n, vocab_size]`` for a row with ``return_logits``).

    Uses the model's own ``forward_batch`` for two rows or more when it has one (one packed forward: the embedded
    model); a lone row, a model without one, and rows that ask for every position's logits run through
    ``forward_cached`` (same results; a lone row is exactly a serial call), except in a model whose ``forward_batch``
    returns them (``batch_row_logits``: the embedded model, so a speculative verify packs with the decode rows).
    Rows must write disjoint pool slots.
    Raises as ``forward_cached``; a row that failed leaves its ``live`` to be refilled.
    """
    own = getattr(model, "forward_batch", None)
    row_logits = bool(getattr(model, "batch_row_logits", False))
    packed = (
        [i for i, row in enumerate(rows) if row_logits or not row.return_logits]
        if own is not None and len(rows) > 1
        else []
    )
    out: list[torch.Tensor | None] = [None] * len(rows)
    if len(packed) > 1:
        for i, logits in zip(packed, own([rows[i] for i in packed], kv), strict=True):
            out[i] = logits
    for i, row in enumerate(rows):
        if out[i] is None:
            out[i] = model.forward_cached(
                row.token_ids, row.start_pos, kv, row.block_table, return_logits=row.return_logits, live=row.live
            )
    return out  # type: ignore[return-value]


def check_logits_from(logits_from: object, num_tokens: int) -> int:
    """Return ``logits_from`` if it is an int in ``0 .. num_tokens - 1`` (a position of the sequence).

    Raises InvalidArgumentError otherwise.
    """
    if isinstance(logits_from, bool) or not isinstance(logits_from, int) or not 0 <= logits_from < num_tokens:
        raise InvalidArgumentError(f"logits_from must be an int in 0..{num_tokens - 1}, got {logits_from!r}")
    return logits_from


def check_live(live: object, start_pos: int) -> bool:
    """True when ``live`` holds exactly the ``start_pos`` prefix positions of this request (read it, not the pool).

    Raises InvalidArgumentError when ``live`` is neither None nor a :class:`LiveKV`.
    """
    if live is None:
        return False
    if not isinstance(live, LiveKV):
        raise InvalidArgumentError(f"live must be a LiveKV or None, got {type(live).__name__}")
    return live.data is not None and live.num_tokens == start_pos


def weights_version_of(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of the tensors' version counters (torch bumps one on every in-place write) and storage addresses (which
    move when a weight is rebound).  Equal sums before and after mean no weight was written through torch's in-place
    ops or swapped.  Inference-mode tensors keep no version counter: only their address counts.  O(len(tensors))."""
    total = 0
    for tensor in tensors:
        total += tensor.data_ptr()
        if not tensor.is_inference():
            total += tensor._version
    return total


WEIGHT_HASH_CHUNK_BYTES = 1 << 26
"""Bytes of a weight on an accelerator copied to the host at a time to be hashed (64 MiB)."""


def hash_weights(digest: Any, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Feed every byte of every tensor to ``digest`` (an ``xxhash`` object), after its name, dtype and shape.

    A tensor is hashed as its raw bytes (a ``uint8`` view, so bf16 and float8 are exact: no conversion, no
    reduction).  On the CPU the bytes are hashed in place; on an accelerator each tensor is copied to the host once,
    in pieces of ``WEIGHT_HASH_CHUNK_BYTES``, so the host never holds more than one piece.  O(weight bytes): about
    memory bandwidth on the CPU, the device-to-host bandwidth otherwise."""
    with torch.no_grad():
        for name, tensor in named_tensors:
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
            if raw.device.type == "cpu":
                digest.update(raw.numpy())
                continue
            for first in range(0, raw.numel(), WEIGHT_HASH_CHUNK_BYTES):
                digest.update(raw[first : first + WEIGHT_HASH_CHUNK_BYTES].cpu().numpy())


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` positions: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def kv_pool_shape(model: CausalLM, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int, int]:
    """Shape of a pool for ``model``: ``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``."""
    return (model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)


def config_fingerprint(config: ModelConfig, *, architecture: str, dtype: torch.dtype) -> str:
    """xxh64 hex of the canonical config plus the code version of the architecture and the KV dtype.

    ``architecture`` names the forward/init code (bump it when either changes the numbers); the dtype is
    part of the identity because K/V computed in bf16 are not the K/V an fp32 model would read.
    """
    payload = f'{{"architecture":{json.dumps(architecture)},"config":{config.canonical_json()},"dtype":"{dtype}"}}'
    return xxhash.xxh64(payload.encode()).hexdigest()


def _is_integer_tensor(x: object) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and not x.dtype.is_floating_point
        and not x.dtype.is_complex
        and x.dtype != torch.bool
    )


def _check_token_shape(model: CausalLM, token_ids: object) -> torch.Tensor:
    if not _is_integer_tensor(token_ids):
        kind = f"tensor of dtype {token_ids.dtype}" if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__
        raise InvalidTokensError(f"token_ids must be a 1-D integer torch.Tensor, got a {kind}")
    assert isinstance(token_ids, torch.Tensor)
    if token_ids.dim() != 1 or token_ids.numel() == 0:
        raise InvalidTokensError(f"token_ids must be a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}")
    return token_ids.to(device=model.device, dtype=torch.long)


def _raise_if_out_of_vocab(model: CausalLM, lo: int, hi: int) -> None:
    if lo < 0 or hi >= model.vocab_size:
        bad = lo if lo < 0 else hi
        raise InvalidTokensError(f"token id {bad} is outside the vocabulary: ids must be in [0, {model.vocab_size})")


def check_reference_call(model: CausalLM, token_ids: object) -> torch.Tensor:
    """Validate ``forward_reference`` input; returns the ids as int64 on the model's device.

    Cost: one device sync (min/max of the ids).  Raises InvalidTokensError (not a non-empty 1-D integer
    tensor, or an id outside ``[0, vocab_size)``) and CapacityError (more than ``max_position`` tokens).
    """
    ids = _check_token_shape(model, token_ids)
    if ids.numel() > model.max_position:
        raise CapacityError(f"{ids.numel()} tokens exceed the model's max_position {model.max_position}")
    lo, hi = torch.aminmax(ids)
    _raise_if_out_of_vocab(model, int(lo), int(hi))
    return ids


def check_cached_call(
    model: CausalLM, token_ids: object, start_pos: object, kv: object, block_table: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``forward_cached`` inputs; returns ``(ids, used_block_table)``, both int64 on the model device.

    ``used_block_table`` is the first ``ceil((start_pos + n) / block_size)`` entries; extra entries are
    ignored.  Cost: one device sync (min/max of ids and used block ids together).

    Raises:
        InvalidTokensError: ids not a non-empty 1-D integer tensor, or an id outside ``[0, vocab_size)``.
        InvalidArgumentError: ``start_pos`` not an int >= 0; ``kv`` not a contiguous tensor of shape
            ``[num_layers, 2, *, *, num_kv_heads, head_dim]`` with the model's dtype and device (a copy
            would silently drop our writes); ``block_table`` not a 1-D integer tensor, too short, or
            naming a block outside ``[0, num_blocks)``.
        CapacityError: ``start_pos + n > max_position``.
    """
    ids = _check_token_shape(model, token_ids)
    if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
        raise InvalidArgumentError(f"start_pos must be an int >= 0, got {start_pos!r}")
    end_pos = start_pos + ids.numel()
    if end_pos > model.max_position:
        raise CapacityError(
            f"positions up to {end_pos} (start_pos {start_pos} + {ids.numel()} tokens) exceed the model's "
            f"max_position {model.max_position}"
        )
    if not isinstance(kv, torch.Tensor):
        raise InvalidArgumentError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    want = (model.num_layers, 2, "num_blocks", "block_size", model.num_kv_heads, model.head_dim)
    if kv.dim() != 6 or any(isinstance(w, int) and w != s for w, s in zip(want, kv.shape, strict=False)):
        raise InvalidArgumentError(f"kv has shape {tuple(kv.shape)}, the model needs {want}")
    if kv.dtype != model.dtype or kv.device != model.device:
        raise InvalidArgumentError(f"kv is {kv.dtype} on {kv.device}, the model needs {model.dtype} on {model.device}")
    if not kv.is_contiguous():
        raise InvalidArgumentError("kv must be contiguous so that writes through a flat view land in the pool")
    num_blocks, block_size = kv.shape[2], kv.shape[3]
    if not _is_integer_tensor(block_table) or block_table.dim() != 1:
        if isinstance(block_table, torch.Tensor):
            desc = f"shape {tuple(block_table.shape)} {block_table.dtype}"
        else:
            desc = type(block_table).__name__
        raise InvalidArgumentError(f"block_table must be a 1-D integer tensor, got {desc}")
    assert isinstance(block_table, torch.Tensor)
    needed = num_blocks_for(end_pos, block_size)
    if block_table.numel() < needed:
        raise InvalidArgumentError(
            f"block_table has {block_table.numel()} blocks, positions 0..{end_pos - 1} at block_size "
            f"{block_size} need {needed}"
        )
    used = block_table[:needed].to(device=model.device, dtype=torch.long)
    lo_tok, hi_tok, lo_blk, hi_blk = torch.stack([ids.min(), ids.max(), used.min(), used.max()]).tolist()
    _raise_if_out_of_vocab(model, lo_tok, hi_tok)
    if lo_blk < 0 or hi_blk >= num_blocks:
        bad = lo_blk if lo_blk < 0 else hi_blk
        raise InvalidArgumentError(f"block_table names block {bad}, the pool has blocks [0, {num_blocks})")
    return ids, used


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device``, or CUDA when available else the CPU for None; a bare ``"cuda"`` as the current device's index
    (pools report ``"cuda:0"``, never bare ``"cuda"``, so device checks compare like with like)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
