"""The logits pipeline: how one request turns a row of logits into its next token id, and whether that token ends it.

Every request of the engine, serial or batched, picks its tokens here and nowhere else, one :class:`LogitsPipeline`
per request.  The stages run in this order on the float logits of the last computed position:

1. the vocabulary limit (``vocab_limit``: ids the tokenizer cannot decode are never picked);
2. temperature, then top-p (nucleus) filtering (Holtzman et al., 2020);
3. the pick: argmax when greedy, else a draw from the request's own ``torch.Generator`` (seeded when a seed is given,
   so that a request's samples repeat whatever else runs beside it).

Masks and biases that change which tokens may come next (a grammar's allowed tokens, repetition and frequency
penalties, a logit bias) and the log-probabilities a caller asks for belong between stage 1 and stage 3.
"""

from __future__ import annotations

import torch

from prefixcache.engine.sampling import SamplingParams

__all__ = ["LogitsPipeline"]


class LogitsPipeline:
    """One request's token picker, made at its first admission and kept across preemptions (its generator's state
    is the request's, so a resumed request samples on where it stopped).

    ``device`` is where the logits live (the generator must be on it).  Not thread-safe: one request, one thread.
    """

    __slots__ = ("generator", "params")

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature != 0 and params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)

    def pick(self, logits: torch.Tensor) -> int:
        """The next token id from ``logits[vocab_size]`` (any float dtype).  O(vocab) greedy; O(vocab log vocab)
        with top-p (one sort)."""
        params = self.params
        if params.vocab_limit is not None:
            logits = logits[: params.vocab_limit]
        if params.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / params.temperature, dim=-1)
        if params.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
            return int(order[torch.multinomial(sorted_probs * keep, 1, generator=self.generator)])
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def ends(self, token_id: int, num_generated: int, stop_requested: bool = False) -> str | None:
        """Why the request ends with ``token_id``, its ``num_generated``-th token: ``"stop"`` (a stop token, or the
        caller asked to stop there: a stop string matched on the decoded text), ``"length"`` (``max_new_tokens``
        reached), or None to go on."""
        if stop_requested or token_id in self.params.stop_token_ids:
            return "stop"
        if num_generated >= self.params.max_new_tokens:
            return "length"
        return None
