"""The single-request rows of ``bench engine``: cold and warm TTFT and decode time per token through the runner,
against the model's own transformers calls on the same prompts (greedy tokens checked equal), on :func:`clock`."""

from __future__ import annotations

import copy
import statistics

import torch

from prefixcache.bench.common import ratio_spread
from prefixcache.bench.device_clock import clock, timed_runner_call
from prefixcache.bench.engine_setup import BLOCK_SIZE, random_ids
from prefixcache.bench.hybrid import own_forward
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams

__all__ = ["WARM_SUFFIX_TOKENS", "measure_cold", "measure_decode", "measure_warm"]

WARM_SUFFIX_TOKENS = 64
"""The uncached suffix of a warm TTFT's prompt, in tokens."""


def _timed(fn) -> tuple[float, object]:
    start = clock()
    value = fn()
    return clock() - start, value


@torch.inference_mode()
def _own_forward(hf, ids: list[int], cache=None) -> tuple[float, int]:
    """:func:`~prefixcache.bench.hybrid.own_forward` on ``cache``, a fresh ``DynamicCache`` by default."""
    from transformers import DynamicCache

    return own_forward(hf, ids, DynamicCache(config=hf.config) if cache is None else cache)


def _runner(model, tokens: int) -> PrefixCachingRunner:
    return PrefixCachingRunner(model, cache_tokens=tokens + 4 * BLOCK_SIZE, block_size=BLOCK_SIZE)


def measure_cold(model, length: int, repeats: int) -> dict:
    """Cold TTFT through the runner (fresh cache) vs the model's own full forward: medians in seconds, and the median,
    lowest and highest of the per-repeat ratios (each repeat runs both sides on the same prompt, one after the other,
    the side that runs first alternating)."""
    ours, theirs = [], []
    for rep in range(repeats):
        prompt = random_ids(model.vocab_size, length, seed=rep)
        runner = _runner(model, length + 1)
        # Which side runs first alternates: the second run of a repeat finds warmed caches and allocator.
        if rep % 2:
            seconds, token = _own_forward(model, prompt)
        ttft, _, result = timed_runner_call(runner, prompt, SamplingParams(max_new_tokens=1))
        if not rep % 2:
            seconds, token = _own_forward(model, prompt)
        ours.append(ttft)
        theirs.append(seconds)
        if token != result.token_ids[0]:
            raise AssertionError(f"cold prefill of {length} tokens: runner token {result.token_ids[0]} != {token}")
    return {
        "tokens": length,
        "repeats": repeats,
        "ours_s": statistics.median(ours),
        "model_s": statistics.median(theirs),
        **ratio_spread([a / b for a, b in zip(ours, theirs, strict=True)]),
    }


@torch.inference_mode()
def measure_warm(model, length: int, repeats: int) -> dict:
    """Warm TTFT (``length - WARM_SUFFIX_TOKENS`` cached) vs the model's own forward of the suffix on a prefilled
    cache."""
    from transformers import DynamicCache

    prefix = random_ids(model.vocab_size, length - WARM_SUFFIX_TOKENS, seed=100)
    runner = _runner(model, length + repeats * WARM_SUFFIX_TOKENS)
    runner.prefill(prefix)
    prefilled = DynamicCache(config=model.config)
    _own_forward(model, prefix, prefilled)
    ours, theirs = [], []
    for rep in range(repeats):
        suffix = random_ids(model.vocab_size, WARM_SUFFIX_TOKENS, seed=200 + rep)
        cache = copy.deepcopy(prefilled)  # outside the timed region: the baseline's cache is already warm
        if rep % 2:  # alternate which side runs first, as in measure_cold
            seconds, token = _own_forward(model, suffix, cache)
        ttft, _, result = timed_runner_call(runner, prefix + suffix, SamplingParams(max_new_tokens=1))
        if not rep % 2:
            seconds, token = _own_forward(model, suffix, cache)
        if result.usage.cached_tokens != len(prefix):
            raise AssertionError(f"warm run found {result.usage.cached_tokens} cached tokens, expected {len(prefix)}")
        ours.append(ttft)
        theirs.append(seconds)
        if token != result.token_ids[0]:
            raise AssertionError(f"warm prefill: runner token {result.token_ids[0]} != model's {token}")
    return {
        "tokens": length,
        "suffix": WARM_SUFFIX_TOKENS,
        "ours_s": statistics.median(ours),
        "model_s": statistics.median(theirs),
    }


@torch.inference_mode()
def measure_decode(model, context: int, steps: int, repeats: int) -> dict:
    """Seconds per generated token at ``context`` tokens: runner (live K/V), ``model.generate`` on its own prefilled
    ``DynamicCache``, and the gather-every-step path (``forward_cached`` without live K/V)."""
    from transformers import DynamicCache

    prompt = random_ids(model.vocab_size, context, seed=300)
    prefilled = DynamicCache(config=model.config)
    _own_forward(model, prompt[:-1], prefilled)
    runner = _runner(model, context + 3 * steps)  # room for the gather path's private blocks
    runner.prefill(prompt[:-1])
    params = SamplingParams(max_new_tokens=steps)
    ours, theirs, gather = [], [], []
    for _ in range(repeats):
        # Per token: the last prompt token's forward plus steps - 1 decode steps, as for generate below.
        _, total, result = timed_runner_call(runner, prompt, params)
        ours.append(total / steps)
        cache = copy.deepcopy(prefilled)
        seconds, out = _timed(
            lambda cache=cache: model.model.generate(
                torch.tensor([prompt], device=model.device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
                **{model.cache_kwarg: cache},
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                pad_token_id=0,
            )
        )
        theirs.append(seconds / steps)
        if out[0, len(prompt) :].tolist() != list(result.token_ids):
            raise AssertionError(f"decode at {context}: runner tokens differ from model.generate's")
        gather.append(_gather_decode(runner, prompt, list(result.token_ids)))
    return {
        "context": context,
        "steps": steps,
        "ours_s": statistics.median(ours),
        "generate_s": statistics.median(theirs),
        "gather_s": statistics.median(gather),
    }


def _gather_decode(runner: PrefixCachingRunner, prompt: list[int], tokens: list[int]) -> float:
    """Seconds per token of the pre-live-K/V decode: every step gathers the whole prefix out of the pool.

    Runs on private blocks after the cached ``prompt[:-1]`` (a lease whose last token differs from the prompt's, so
    that nothing shared is written), then releases them.
    """
    model = runner.model
    other = (prompt[-1] + 1) % model.vocab_size
    lease = runner.cache.acquire([*prompt[:-1], other], runner.namespace_key(None))
    try:
        runner.cache.reserve(lease, len(prompt) + len(tokens))
        table = runner.pool.block_table_tensor(lease.block_table)
        sequence = prompt + tokens
        start = clock()
        for position in range(len(prompt) - 1, len(sequence) - 1):
            step = torch.tensor([sequence[position]], device=model.device)
            model.forward_cached(step, position, runner.pool.kv, table)
        return (clock() - start) / len(tokens)
    finally:
        runner.cache.release(lease)
