"""The structured-output rows of ``prefixcache bench engine``: what a grammar costs a batched decode step.

Eight requests decode together on one :class:`~prefixcache.engine.batching.BatchEngine` behind a cached prompt, each
sampled (temperature 1, its own seed), once unconstrained and once constrained to a small JSON schema
(:class:`~prefixcache.engine.grammar.Grammar`, llguidance); the figure is CPU time per engine step, medians of
interleaved repeats, the mask and the grammar's advance included.  Constrained answers end when their JSON does, so
per step is the comparable measure, not per request.  Needs the ``structured`` extra; without it the rows say so.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from typing import Any

import torch

from prefixcache.bench.common import ms_cells
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams

__all__ = ["SCHEMA", "grammar_rows", "measure_grammar"]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer"},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
ROWS, NEW_TOKENS = 8, 48


def _per_step(runner: PrefixCachingRunner, prompt: list[int], grammar: Any, repeat: int) -> float:
    """CPU seconds per engine step of ROWS requests decoding ``prompt``'s answers together (``grammar`` or none)."""
    engine = BatchEngine(runner)
    try:
        for row in range(ROWS):
            params = SamplingParams(
                max_new_tokens=NEW_TOKENS, temperature=1.0, seed=100 * repeat + row, grammar=grammar
            )
            engine.submit(prompt, params)
        start = time.thread_time()
        engine.run_until_idle()
        return (time.thread_time() - start) / max(engine.core.steps, 1)
    finally:
        engine.close()


@torch.inference_mode()
def measure_grammar(quick: bool, repeats: int, device: torch.device | str = "cpu") -> dict:
    """Median CPU seconds per batched decode step, constrained and not, on the embedded ``tiny`` (quick) or ``small``
    model; ``available`` False (and no figures) without llguidance."""
    # The grammar module imports without llguidance; compiling a grammar then raises InvalidArgumentError.
    if importlib.util.find_spec("llguidance") is None:
        return {"available": False}
    from prefixcache.engine.grammar import Grammar
    from prefixcache.models.llama import build_model

    runner = PrefixCachingRunner(build_model("tiny" if quick else "small", device=device), cache_tokens=1 << 14)
    grammar = Grammar.json_schema(SCHEMA, runner.tokenizer)
    prompt = runner.tokenizer.encode("Give a city's forecast as JSON. " * 8)
    runner.generate(prompt, SamplingParams(max_new_tokens=0))  # cached: both sides decode behind it
    plain, constrained = [], []
    for repeat in range(repeats):
        order = (None, grammar) if repeat % 2 else (grammar, None)
        for which in order:
            (constrained if which is grammar else plain).append(_per_step(runner, prompt, which, repeat))
    return {
        "available": True,
        "model": "tiny" if quick else "small",
        "rows": ROWS,
        "constrained_s": statistics.median(constrained),
        "plain_s": statistics.median(plain),
    }


def grammar_rows(grammar: dict) -> list[tuple[str, ...]]:
    """The table row of :func:`measure_grammar`'s figures, or a row saying the extra is missing."""
    measure = f"JSON schema decode (ms/step, {ROWS} rows)"
    if not grammar["available"]:
        return [(measure, "-", "unconstrained (needs prefixcache[structured])", "-", "-", "-")]
    baseline = f"unconstrained, same rows ({grammar['model']}, embedded)"
    return [(measure, f"{NEW_TOKENS} new", baseline, *ms_cells(grammar["constrained_s"], grammar["plain_s"]))]
