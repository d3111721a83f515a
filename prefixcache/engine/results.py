"""The records a request ends with: its usage (token accounting and timing) and its result, for every caller of the
engine (serial calls, the batching engine, the chat layer, the server)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prefixcache.cache.radix_cache import InsertResult

__all__ = ["ChatResult", "GenerationResult", "TokenLogprob", "Usage"]


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting and timing of one request.

    ``cached_tokens`` counts every prompt token whose KV was reused, shared or copied (``copied_tokens`` is the
    copied part), so ``cached_tokens + prefilled_tokens == prompt_tokens``.  ``ttft_s`` is the prefill time up to
    the first token's logits; ``decode_s`` the time after it (decode steps, or the teacher-forced tokens).
    ``host_cached_tokens`` of the cached tokens were promoted from the host-memory tier (0 without one); the rest
    were on the device.  ``unresumed_tokens`` prompt tokens past ``cached_tokens`` matched the cache but could not
    be resumed: a model with recurrent layers resumes only where a state snapshot was kept (0 for other models).
    ``drafted_tokens`` speculative draft tokens were verified (engine option ``speculate="tree"``; greedy requests
    only), ``accepted_tokens`` of them accepted: each accepted token is a generated token that cost no forward of its
    own.
    """

    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    copied_tokens: int
    generated_tokens: int
    ttft_s: float
    decode_s: float
    host_cached_tokens: int = 0
    unresumed_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    def to_openai(self) -> dict[str, Any]:
        """OpenAI-style usage: ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
        ``prompt_tokens_details.cached_tokens``, plus our extra counts (speculation's ``drafted_tokens`` and
        ``accepted_tokens`` among them)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.generated_tokens,
            "total_tokens": self.prompt_tokens + self.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "prefilled_tokens": self.prefilled_tokens,
            "copied_tokens": self.copied_tokens,
            "host_cached_tokens": self.host_cached_tokens,
            "unresumed_tokens": self.unresumed_tokens,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "ttft_s": self.ttft_s,
            "decode_s": self.decode_s,
        }


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of one sampled token (natural log, <= 0) and of the ``SamplingParams.logprobs`` most
    probable tokens at its position, ``top``: ``(token_id, logprob)`` pairs, most probable first (empty when 0 were
    asked for; the sampled token is among them only if it ranks there).  The distribution is the model's own at that
    position (:meth:`~prefixcache.engine.logits.LogitsPipeline.logprobs`)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """Output of one request: the new token ids, why it stopped (``"stop"``, ``"length"``, ``"forced"`` for
    teacher forcing, ``"prefill"`` when nothing was generated), usage, and, when asked for, the float32 logits of
    the prefilled prompt positions (``[prefilled_tokens, vocab_size]``, on the CPU) and ``logprobs``: one
    :class:`TokenLogprob` per sampled token, in order (``SamplingParams.logprobs`` set; None otherwise).  Forced
    tokens are not sampled and get none: a forced or prefill-only request's ``logprobs`` is ``()``.
    ``prompt_logprobs`` (``SamplingParams.prompt_logprobs`` set; None otherwise): one :class:`TokenLogprob` per
    prompt token whose position before it was prefilled, in order, so prompt tokens ``cached_tokens + 1 ..`` (every
    one after the first with ``recompute_prompt``)."""

    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    prompt_logits: torch.Tensor | None = None
    insert: InsertResult | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, slots=True)
class ChatResult:
    """Output of :meth:`PrefixCachingRunner.chat`: decoded text (stop tokens and strings removed), token ids, finish
    reason (``"tool_calls"`` when calls were parsed), usage, the OpenAI ``tool_calls``, and with ``logprobs`` asked
    for, a :class:`TokenLogprob` per generated token that is not a stop token (None otherwise)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    tool_calls: tuple[dict[str, Any], ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None
