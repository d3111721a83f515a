"""The uncached side of a model replay: the prefill of each prompt with no cache, timed as the baseline of the
speed-up, and ``--verify``'s reference forward, against which the cached run's logits are checked.

Both run in chunks of ``chunk_tokens`` tokens where they can, so that a Ctrl-C lands within one chunk's time
rather than one whole prompt's: the baseline as the cached prefill does (the model's paged forward on scratch
blocks, chunk after chunk; one forward for a model with recurrent layers, whose chunks would need its live state),
the reference as the model's own forward with no cache over the whole prompt, run once (a chunked reference would
be another cached path, not the uncached one it checks against).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence

import torch

from prefixcache.cache.pool import KVBlockPool
from prefixcache.errors import VerificationError
from prefixcache.models.base import CausalLM
from prefixcache.replay.requests import ReplayRequest

__all__ = ["UncachedReference", "same_greedy"]


DEFAULT_TIE_FREE_ATOL = 1e-4
"""Tolerances up to this (float32's) compare greedy tokens exactly; larger ones allow a flipped near tie."""


class UncachedReference:
    """The no-cache prefill of ``model`` (timed) and its reference logits (``verify``), ``atol`` the tolerance on
    float32 logits, ``chunk_tokens`` the baseline's chunk (None: one forward)."""

    def __init__(self, model: CausalLM, block_size: int, atol: float, chunk_tokens: int | None) -> None:
        self.model = model
        self.block_size = block_size
        self.atol = atol
        self.chunk_tokens = chunk_tokens

    def scratch_pool(self, requests: Sequence[ReplayRequest]) -> KVBlockPool:
        """Blocks for the longest prompt of ``requests``, which every baseline prefill overwrites."""
        return self._pool(max((len(r.prompt) for r in requests), default=1))

    def warm_up(self, prompt: array) -> None:
        """An untimed prefill of the start of ``prompt`` (one chunk and a block's worth more; 256 tokens unchunked)
        before anything is timed.  A process's first forwards pay once for torch's lazy set-up and for reading the
        library's code from disk (a first replay after an install measured 1.7x where later ones measured 5x), which
        would otherwise count against whichever side of the comparison ran first."""
        if not prompt:
            return
        chunk = self.chunk_tokens if self.chunk_tokens is not None else 256 - self.block_size
        length = min(len(prompt), chunk + self.block_size)
        self.prefill_s(prompt[:length], self._pool(length))

    def _pool(self, longest: int) -> KVBlockPool:
        model = self.model
        return KVBlockPool(
            -(-longest // self.block_size),
            self.block_size,
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=model.dtype,
            device=model.device,
        )

    def prefill_s(self, prompt: array, scratch: KVBlockPool) -> float:
        """Seconds to prefill the whole ``prompt`` with no cache: same model, same kernel, same chunks as the cached
        prefill, scratch blocks."""
        table = scratch.block_table_tensor(range(scratch.blocks_for_tokens(len(prompt))))
        ids = torch.tensor(prompt, dtype=torch.long, device=self.model.device)
        step = (
            len(prompt) if self.chunk_tokens is None or getattr(self.model, "recurrent", False) else self.chunk_tokens
        )
        start = time.perf_counter()
        for lo in range(0, len(prompt), step):
            logits = self.model.forward_cached(ids[lo : lo + step], lo, scratch.kv, table)
        int(torch.argmax(logits[-1]))
        return time.perf_counter() - start

    def verify(self, request: ReplayRequest, cached: int, prompt_logits: torch.Tensor) -> tuple[float, float]:
        """``(max abs logit difference, seconds)`` of the uncached reference of ``request.prompt``.

        The reference is a full forward of the prompt with no cache whose LM head runs only on the positions the
        cached run computed (from ``cached`` on), so it is also the uncached prefill that the report's speed-up
        divides by: a second full forward per request would double a verified replay's cost for the same figure.

        Raises:
            VerificationError: a logit differs by more than ``atol``, or a greedy token differs.
        """
        prompt = torch.tensor(request.prompt, dtype=torch.long)
        start = time.perf_counter()
        reference = self.model.forward_reference(prompt, return_logits=True, logits_from=cached).float().cpu()
        seconds = time.perf_counter() - start
        diff = float((prompt_logits - reference).abs().max())
        # Where the tolerance exists for rounding (recurrent scans, half precision), a near tie may flip too.
        tie = 0 if self.atol <= DEFAULT_TIE_FREE_ATOL else self.atol
        same_tokens = same_greedy(prompt_logits, reference, tie)
        if diff > self.atol or not same_tokens:
            raise VerificationError(
                f"{request.scenario} conversation {request.conversation_id} turn {request.turn}: cached logits "
                f"differ from the uncached reference by {diff:.3g} (tolerance {self.atol}); "
                f"greedy tokens {'equal' if same_tokens else 'DIFFER'}"
            )
        return diff, seconds


def same_greedy(logits: torch.Tensor, reference: torch.Tensor, tie: float) -> bool:
    """Whether the greedy tokens of ``logits`` are the reference's, a position where they differ allowed when the
    reference's own top two are within ``tie`` of each other (a split scan's rounding may flip a near tie; 0: none).
    O(positions x vocabulary)."""
    ours, theirs = logits.argmax(-1), reference.argmax(-1)
    differ = (ours != theirs).nonzero().flatten()
    if not len(differ):
        return True
    rows = reference[differ]
    gaps = rows.gather(1, theirs[differ, None]) - rows.gather(1, ours[differ, None])
    return bool((gaps <= tie).all())
