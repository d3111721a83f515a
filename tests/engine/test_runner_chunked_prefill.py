"""``PrefixCachingRunner.generate(max_batch_tokens=..., on_step=...)``: one request's prefill in chunks, each
reported, with the same tokens cached and the same logits as in one forward (what replay's progress and Ctrl-C
rest on)."""

from __future__ import annotations

import random

import torch

from prefixcache import PrefixCachingRunner
from prefixcache.models import LlamaModel


def test_a_chunked_prefill_reports_each_chunk_and_equals_one_forward(tiny: LlamaModel) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(1000)]
    answer = [rng.randrange(256) for _ in range(40)]
    positions: list[int] = []

    chunked = PrefixCachingRunner(tiny, num_blocks=128, block_size=16)
    steps = chunked.generate(
        prompt, forced_tokens=answer, return_logits=True, max_batch_tokens=256, on_step=positions.append
    )
    whole = PrefixCachingRunner(tiny, num_blocks=128, block_size=16).generate(
        prompt, forced_tokens=answer, return_logits=True
    )

    assert positions == [256, 512, 768, 1000, 1040]  # four prompt chunks, then the forced answer
    assert steps.usage.prompt_tokens == whole.usage.prompt_tokens == 1000
    assert float((steps.prompt_logits - whole.prompt_logits).abs().max()) < 1e-4
    assert torch.equal(steps.prompt_logits.argmax(-1), whole.prompt_logits.argmax(-1))
    again = chunked.generate(prompt, forced_tokens=answer, max_batch_tokens=256)
    assert again.usage.cached_tokens == 999  # all but the last token, which is prefilled for its logits (7 copied)
