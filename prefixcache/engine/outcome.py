"""A finished engine request's result record: its tokens, usage (token counts and times), prompt logits and logprobs."""

from __future__ import annotations

import torch

from prefixcache.cache.radix_cache import InsertResult
from prefixcache.engine.request import EngineRequest
from prefixcache.engine.results import GenerationResult, Usage

__all__ = ["generation_result"]


def generation_result(request: EngineRequest, reason: str, insert: InsertResult, now: float) -> GenerationResult:
    """The :class:`GenerationResult` of ``request``, ended for ``reason`` at ``now`` (``time.perf_counter()``
    seconds) after its commit did ``insert``.  Its TTFT runs from its submit to its first token (``now`` if it has
    none); the prompt logits, when asked for, are its kept chunks joined (one chunk is returned as is, not copied)."""
    first = request.first_token_at if request.first_token_at is not None else now
    usage = Usage(
        prompt_tokens=len(request.prompt),
        cached_tokens=request.cached,
        prefilled_tokens=len(request.prompt) - request.cached,
        copied_tokens=request.copied,
        generated_tokens=len(request.generated),
        ttft_s=first - request.submitted_at,
        decode_s=now - first,
        host_cached_tokens=request.host_cached,
        unresumed_tokens=request.unresumed,
        drafted_tokens=request.drafted_tokens,
        accepted_tokens=request.accepted_tokens,
    )
    logits = None
    if request.return_logits and request.prompt_logits:
        # One chunk (a prompt prefilled in one forward) is returned as is: a copy of [n, vocab] doubles the peak.
        chunks = request.prompt_logits
        logits = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    logprobs = None if request.sampling.logprobs is None else tuple(request.logprobs)
    prompt_logprobs = None if request.sampling.prompt_logprobs is None else tuple(request.prompt_logprobs)
    return GenerationResult(tuple(request.generated), reason, usage, logits, insert, logprobs, prompt_logprobs)
