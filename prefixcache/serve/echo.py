"""``echo`` on ``/v1/completions``: the prompt returned before the completion, with the logprobs of its tokens when
``logprobs`` is asked (lm-eval's log-likelihood tasks score a continuation this way), and the running usage of
``stream_options.continuous_usage_stats``.

Cached prompt positions have no logits: a cache keeps K/V, not the LM head's output.  So a request with ``echo`` and
``logprobs`` first runs a prefill of its prompt that reuses nothing cached (``recompute_prompt``) and computes every
position's logits; its usage says so (``cached_tokens`` 0, every prompt token prefilled).  That prefill caches the
prompt, so the completion after it finds the prompt cached.  A prompt token's logprob is the model's
``log_softmax`` at the position before it (vLLM's raw logprobs, as for generated tokens:
:meth:`~prefixcache.engine.logits.LogitsPipeline.logprobs`); the first token has none (``null``), as OpenAI writes.
The engine reduces each chunk of logits to those records as the prefill goes (``SamplingParams.prompt_logprobs``), so
what it returns, and what crosses from an engine process, is ``k + 1`` values per token, not ``[prompt, vocab]``
floats (869 MB for 1,500 tokens of a 151,936-token vocabulary, issue 44).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

from prefixcache.engine.request import RequestHandle
from prefixcache.engine.results import GenerationResult, Usage
from prefixcache.engine.sampling import SamplingParams
from prefixcache.serve.logprobs import TextOffset, TokenStrings, completion_logprobs

__all__ = ["echoed_logprobs", "echoed_usage", "merge_logprobs", "prompt_logprobs_job", "running_usage"]


def prompt_logprobs_job(
    engine: Any, ids: list[int], namespace: str | None, vocab_limit: int, logprobs: int
) -> tuple[RequestHandle, Future[GenerationResult]]:
    """Submit the prefill of ``ids`` that reuses nothing cached and returns the logprob record of every prompt token
    after the first (``GenerationResult.prompt_logprobs``: token i's from position i - 1, with the ``logprobs`` most
    probable ids below ``vocab_limit``).  Raises as ``engine.submit``."""
    params = SamplingParams(max_new_tokens=0, vocab_limit=vocab_limit, prompt_logprobs=logprobs)
    handle = engine.submit(ids, params, namespace=namespace, recompute_prompt=True)
    return handle, handle.future


def echoed_logprobs(
    result: GenerationResult, ids: list[int], strings: TokenStrings
) -> tuple[dict[str, Any], TextOffset]:
    """The legacy ``logprobs`` of the prompt tokens ``ids`` from ``result.prompt_logprobs`` (of
    :func:`prompt_logprobs_job`), and the text offset after them (:class:`~prefixcache.serve.logprobs.TextOffset`):
    the first token's logprob and alternatives are ``None``.  O(len(ids) * (k + 1)) token strings."""
    records = result.prompt_logprobs
    rest, offset = completion_logprobs(records, strings, TextOffset(0).after(strings.bytes_of(ids[0])))
    return {
        "tokens": [strings(ids[0]), *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }, offset


def merge_logprobs(prompt: dict[str, Any] | None, completion: dict[str, Any] | None) -> dict[str, Any] | None:
    """The prompt's legacy ``logprobs`` followed by the completion's (either may be None)."""
    if prompt is None or completion is None:
        return prompt if completion is None else completion
    return {key: prompt[key] + completion[key] for key in prompt}


def echoed_usage(prefill: Usage | None, completion: Usage) -> Usage:
    """The usage of an echoed request: the completion's, with the prompt counted as the recomputing prefill
    ``prefill`` found it (nothing cached) when there was one."""
    if prefill is None:
        return completion
    return dataclasses.replace(
        completion,
        cached_tokens=prefill.cached_tokens,
        prefilled_tokens=prefill.prefilled_tokens,
        copied_tokens=prefill.copied_tokens,
        ttft_s=prefill.ttft_s + completion.ttft_s,
    )


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """``stream_options.continuous_usage_stats``' usage of a chunk: the tokens so far, as vLLM writes it."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
