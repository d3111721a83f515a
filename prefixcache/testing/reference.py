"""The uncached reference a cached path is checked against: greedy tokens and prompt logits from
``forward_reference`` on the whole sequence at every step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixcache.models.base import CausalLM

__all__ = ["greedy_reference"]


def greedy_reference(model: CausalLM, prompt: Sequence[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and prompt logits computed with no cache at all (``forward_reference`` on the whole sequence
    at every step).  Returns ``(new_token_ids, prompt_logits[len(prompt), vocab])``.  O(n^2) forwards: for tests
    with short sequences."""
    ids = [int(t) for t in prompt]
    prompt_logits = model.forward_reference(torch.tensor(ids, dtype=torch.long), return_logits=True).float().cpu()
    logits = prompt_logits
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(torch.argmax(logits[-1]))
        generated.append(token)
        if len(generated) == max_new_tokens:
            break
        logits = model.forward_reference(torch.tensor(ids + generated, dtype=torch.long)).float().cpu()
    return generated, prompt_logits
