"""Measure what verifying a draft costs: one forward of ``1 + k`` tokens against one decode step of one token.

``python -m prefixcache.replay.verify_cost [--preset small] [--context 2048] [--max-draft 8] [--threads N]`` builds
the embedded model, prefills ``context`` random tokens into a KV pool, then times the engine's own forward
(:meth:`~prefixcache.models.base.CausalLM.forward_cached` against the request's live K/V, every position's logits, as a
verify step needs them) of ``1 + k`` tokens at that position for ``k = 0 .. max_draft``, rewinding the live K/V after
each call as a rejected draft would, and prints the ratios to ``k = 0`` as a ``--verify-cost`` value
(:data:`~prefixcache.replay.speculate.DEFAULT_VERIFY_COST` holds one such measurement).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from prefixcache.models.base import LiveKV, kv_pool_shape, num_blocks_for
from prefixcache.models.llama import PRESETS, build_model

__all__ = ["measure_verify_cost"]


def measure_verify_cost(
    preset: str = "small", context: int = 2048, max_draft_tokens: int = 8, repeats: int = 40, block_size: int = 16
) -> list[float]:
    """Median seconds of a forward of ``1 + k`` tokens after ``context`` cached ones, for ``k = 0 ..
    max_draft_tokens``, each call interleaved with the others over ``repeats`` rounds.  Returns the seconds,
    index ``k``.

    Raises:
        InvalidArgumentError: an unknown preset.
    """
    torch.manual_seed(0)
    model = build_model(preset)
    total = context + max_draft_tokens + 1
    blocks = num_blocks_for(total, block_size)
    kv = torch.zeros(kv_pool_shape(model, blocks, block_size), dtype=model.dtype, device=model.device)
    table = torch.arange(blocks, dtype=torch.int32, device=model.device)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.vocab_size, (total,), generator=generator).to(model.device)
    live = LiveKV(capacity=total)
    with torch.inference_mode():
        model.forward_cached(ids[:context], 0, kv, table, live=live)
        seconds: list[list[float]] = [[] for _ in range(max_draft_tokens + 1)]
        for round_ in range(repeats + 2):  # two rounds of warm-up
            for k in range(max_draft_tokens + 1):
                start = time.perf_counter()
                model.forward_cached(ids[context : context + 1 + k], context, kv, table, return_logits=True, live=live)
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
                live.num_tokens = context  # the draft's rows are dropped, as after a rejection
                if round_ >= 2:
                    seconds[k].append(elapsed)
    return [statistics.median(s) for s in seconds]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixcache.replay.verify_cost", description=__doc__)
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--max-draft", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    seconds = measure_verify_cost(args.preset, args.context, args.max_draft, args.repeats)
    for k, s in enumerate(seconds):
        print(f"k={k}: {1e3 * s:.3f} ms, {s / seconds[0]:.2f}x one decode step")
    print("--verify-cost " + ",".join(f"{s / seconds[0]:.2f}" for s in seconds[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
