"""The batching rows of ``bench engine``: sessions behind one system prompt served together against one at a time
(aggregate generated tokens per second), and prefix-aware scheduling against arrival order (prefilled tokens, time)."""

from __future__ import annotations

import statistics
import time

import torch

from prefixcache.bench.common import ratio_spread
from prefixcache.bench.device_clock import clock
from prefixcache.bench.engine_setup import BLOCK_SIZE, EngineSetup, random_ids
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams

__all__ = ["measure_batching", "measure_shared_prefill"]


def measure_batching(setup: EngineSetup, model=None, device: torch.device | str = "cpu") -> dict:
    """Aggregate generated tokens/s of ``batch_sessions`` sessions served together over the same sessions one at a
    time, both behind a cached system prompt, on ``model`` (default: the embedded ``batch_preset`` on ``device``).

    Both sides do the same work: each session's uncached question (``batch_question_tokens``) is prefilled and
    ``batch_new_tokens`` tokens are decoded, on a fresh runner whose cache holds the system prompt alone; the batched
    tokens are checked equal to the serial ones.  ``batch_repeats`` interleaved repeats (the side that runs first
    alternates); tokens/s from the median seconds of each side, and the median, lowest and highest per-repeat ratio.
    One untimed batched call of two sessions comes first: one-time costs of batched decode (on the CPU the oneDNN
    copy of the weights, :class:`~prefixcache.models.linear.WeightPacks`) are paid before timing, as loading is.
    """
    from prefixcache.models.llama import build_model

    name = getattr(model, "name", setup.batch_preset)
    model = build_model(setup.batch_preset, device=device) if model is None else model
    system = torch.randint(0, 259, (setup.batch_system_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    questions = [random_ids(259, setup.batch_question_tokens, seed=500 + i) for i in range(setup.batch_sessions)]
    prompts = [system + q for q in questions]
    params = SamplingParams(max_new_tokens=setup.batch_new_tokens)
    per_session = setup.batch_question_tokens + 2 * setup.batch_new_tokens
    tokens = setup.batch_system_tokens + setup.batch_sessions * per_session

    def timed(together: bool) -> tuple[float, list]:
        runner = PrefixCachingRunner(model, cache_tokens=tokens, block_size=BLOCK_SIZE)
        runner.prefill(system)  # outside the timed region
        start = clock()
        results = runner.generate_many(prompts, params) if together else [runner.generate(p, params) for p in prompts]
        return clock() - start, results

    PrefixCachingRunner(model, cache_tokens=tokens, block_size=BLOCK_SIZE).generate_many(prompts[:2], params)
    serial_s, batched_s = [], []
    for rep in range(setup.batch_repeats):
        runs = {together: timed(together) for together in ((False, True) if rep % 2 == 0 else (True, False))}
        (s_seconds, s_results), (b_seconds, b_results) = runs[False], runs[True]
        if [r.token_ids for r in b_results] != [r.token_ids for r in s_results]:
            raise AssertionError("batched tokens differ from serial tokens")
        serial_s.append(s_seconds)
        batched_s.append(b_seconds)
    generated = sum(len(r.token_ids) for r in b_results)
    return {
        "model": name,
        "sessions": setup.batch_sessions,
        "system_tokens": setup.batch_system_tokens,
        "generated_tokens": generated,
        "repeats": setup.batch_repeats,
        "serial_tokens_per_s": generated / statistics.median(serial_s),
        "batched_tokens_per_s": generated / statistics.median(batched_s),
        **ratio_spread([s / b for s, b in zip(serial_s, batched_s, strict=True)]),
    }


def measure_shared_prefill(setup: EngineSetup) -> dict:
    """``batch_sessions`` sessions behind one uncached ``batch_system_tokens`` system prompt, submitted together to a
    :class:`~prefixcache.engine.batching.BatchEngine` with prefix-aware scheduling (``"lpm"``) and without
    (``"fcfs"``), each on a fresh cache: prefilled tokens, wall seconds (``time.perf_counter``) and thread CPU
    seconds (:func:`~prefixcache.bench.device_clock.clock`) of each.  Raises AssertionError when the two disagree on
    any session's tokens."""
    from prefixcache.engine.batching import BatchEngine
    from prefixcache.models.llama import build_model

    model = build_model(setup.batch_preset, device="cpu")
    system = random_ids(259, setup.batch_system_tokens, seed=2)
    prompts = [system + random_ids(259, setup.batch_question_tokens, seed=600 + i) for i in range(setup.batch_sessions)]
    params = SamplingParams(max_new_tokens=setup.batch_new_tokens)
    tokens = setup.batch_sessions * (len(prompts[0]) + setup.batch_new_tokens) + setup.batch_system_tokens
    out: dict = {"model": setup.batch_preset, "sessions": setup.batch_sessions, "system_tokens": len(system)}
    outputs = {}
    for policy in ("lpm", "fcfs"):
        engine = BatchEngine(PrefixCachingRunner(model, cache_tokens=tokens, block_size=BLOCK_SIZE), policy=policy)
        wall, cpu = time.perf_counter(), clock()
        handles = [engine.submit(prompt, params) for prompt in prompts]
        engine.run_until_idle()
        results = [handle.result() for handle in handles]
        out[policy] = {
            "prefilled_tokens": sum(r.usage.prefilled_tokens for r in results),
            "wall_s": time.perf_counter() - wall,
            "cpu_s": clock() - cpu,
            "steps": engine.steps,
        }
        outputs[policy] = [r.token_ids for r in results]
    if outputs["lpm"] != outputs["fcfs"]:
        raise AssertionError("prefix-aware scheduling changed a session's tokens")
    return out
