"""The logits pipeline: how one request turns a row of logits into its next token id, and whether that token ends it.

Every request of the engine, serial or batched, picks its tokens here and nowhere else, one :class:`LogitsPipeline`
per request.  The stages run in this order on the logits of the last computed position (vLLM's order: the logits
processors and penalties on the raw logits, then temperature, then the filters of the sampler):

1. the vocabulary limit (``vocab_limit``: ids the tokenizer cannot decode are never picked), then the ``grammar``'s
   mask (:mod:`prefixcache.engine.grammar`: the ids it disallows next get -inf);
2. ``min_tokens``: the stop tokens' logits are -inf while fewer than ``min_tokens`` tokens are generated (vLLM);
3. ``logit_bias`` added (OpenAI);
4. ``repetition_penalty`` on the tokens of the prompt and generated so far: a positive logit divided by it, a
   negative one multiplied (CTRL, Keskar et al. 2019, as Hugging Face's ``RepetitionPenaltyLogitsProcessor`` and
   vLLM's ``apply_penalties``);
5. ``frequency_penalty * count + presence_penalty * (count > 0)`` subtracted, ``count`` a token's occurrences among
   the generated tokens (OpenAI's definition; vLLM's);
6. greedy (``temperature == 0``) stops here: the argmax of the row stages 1-5 made;
7. temperature: the row divided by it;
8. ``min_p`` (tokens of probability below ``min_p`` times the top token's, at this temperature, get -inf: vLLM and
   Nguyen et al. 2024) and ``top_k`` (the logits below the k-th largest get -inf; ties kept: vLLM); the two keep a
   most-probable prefix each, so their order does not matter;
9. top-p (nucleus, Holtzman et al. 2020) on the softmax of what 8 kept: the smallest most-probable set whose
   probability reaches ``top_p``;
10. the draw from the request's own ``torch.Generator`` (seeded when a seed is given, so that a request's samples
    repeat whatever else runs beside it).

A request that sets none of stages 2-5 and 8 runs exactly the code it ran before they existed: the same ops on the
same row (greedy: one argmax), so neither its speed nor a seeded request's tokens change.  The token history the
penalties need is built once: the prompt's tokens as a ``[vocab]`` mask at creation (one scatter), the generated
tokens' counts updated by :meth:`LogitsPipeline.accept` (O(1) per token), and only for the penalties asked for.

Log-probabilities (``SamplingParams.logprobs``) are read beside the stages, not from them:
:meth:`LogitsPipeline.logprobs` gives the log-softmax of the row after stage 1 alone, the model's own distribution over
the ids the request may pick (vLLM's default ``logprobs_mode="raw_logprobs"``), and nothing else computes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from prefixcache.engine.results import TokenLogprob
from prefixcache.engine.sampling import SamplingParams

__all__ = ["PROMPT_LOGPROB_VALUES", "LogitsPipeline"]

PROMPT_LOGPROB_VALUES = 1 << 22
"""The most logits (4 Mi float32 values, 16 MiB) :meth:`LogitsPipeline.prompt_logprobs` takes the log-softmax of at
once: about 27 rows of a 151,936-token vocabulary."""


class LogitsPipeline:
    """One request's token picker, made at its first admission and kept across preemptions (its generator's state
    and its token history are the request's, so a resumed request samples on where it stopped).

    ``device`` is where the logits live (the generator and the history tensors are made there); ``vocab_size`` the
    width of a logits row (the model's ``vocab_size``); ``prompt_ids`` the request's prompt (read once, for
    ``repetition_penalty``; any sequence of ints or an ``array('I')``, ids below ``vocab_size``).  The engine calls
    :meth:`accept` with every token it appends to the request.  Not thread-safe: one request, one thread.
    """

    __slots__ = (
        "_adjusting",
        "_bias_ids",
        "_bias_values",
        "_counts",
        "_filtering",
        "_grammar",
        "_seen",
        "_stop_ids",
        "generator",
        "num_generated",
        "params",
    )

    def __init__(
        self, params: SamplingParams, device: torch.device, vocab_size: int, prompt_ids: Sequence[int] = ()
    ) -> None:
        self.params = params
        self.num_generated = 0
        """Tokens accepted so far (the request's generated tokens)."""
        self.generator: torch.Generator | None = None
        if params.temperature != 0 and params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        width = vocab_size if params.vocab_limit is None else min(vocab_size, params.vocab_limit)
        self._stop_ids = self._bias_ids = self._bias_values = self._counts = self._seen = None
        stops = sorted(t for t in params.stop_token_ids if t < width)
        if params.min_tokens and not params.ignore_eos and stops:
            self._stop_ids = torch.tensor(stops, dtype=torch.long, device=device)
        bias = [(t, b) for t, b in params.logit_bias if t < width and b != 0]
        if bias:
            self._bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=device)
            self._bias_values = torch.tensor([b for _, b in bias], dtype=torch.float32, device=device)
        if params.frequency_penalty != 0 or params.presence_penalty != 0:
            self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if params.repetition_penalty != 1:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = torch.from_numpy(np.asarray(prompt_ids, dtype=np.int64)).to(device)
            self._seen[ids] = True
        self._adjusting = any(x is not None for x in (self._stop_ids, self._bias_ids, self._counts, self._seen))
        self._filtering = params.min_p > 0 or params.top_k > 0
        self._grammar = None if params.grammar is None else params.grammar.start()
        """The request's place in its grammar: advanced by :meth:`accept` only, so never twice for one token."""

    def accept(self, token_id: int) -> None:
        """``token_id`` was appended to the request's generated tokens: count it, and advance the grammar past it.
        O(1) (two scalar writes on the device when penalties are asked for, none else) plus the grammar's step."""
        self.num_generated += 1
        if self._grammar is not None:
            self._grammar.accept(token_id, self._grammar_stops())
        if self._counts is not None:
            self._counts[token_id] += 1
        if self._seen is not None:
            self._seen[token_id] = True

    def draft_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of a speculative draft the request's grammar allows (all of them without a
        grammar), so that a draft is cut before its verify at the first token the grammar forbids.  Does not advance
        the grammar.  O(len(token_ids)) grammar steps."""
        if self._grammar is None:
            return len(token_ids)
        return self._grammar.valid_prefix(token_ids)

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """Stages 1-5 of the module docstring on ``logits[vocab_size]`` (any float dtype): ``[min(vocab_size,
        vocab_limit)]``, float32 where a stage 2-5 applied, else the (sliced) row itself.  Never writes into
        ``logits``.  O(vocab) per stage that applies."""
        if self.params.vocab_limit is not None:
            logits = logits[: self.params.vocab_limit]
        if self._grammar is not None:
            logits = self._constrain(logits)
        return self._adjust(logits) if self._adjusting else logits

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution the next token is drawn from, ``[min(vocab_size, vocab_limit)]`` float32 summing to 1:
        stages 1-9 on ``logits[vocab_size]``; greedy: one-hot on the argmax.  O(vocab log vocab) with top-p."""
        row = self.adjusted(logits)
        if self.params.temperature == 0:
            return torch.zeros(row.shape, dtype=torch.float32, device=row.device).index_fill_(
                0, torch.argmax(row).reshape(1), 1.0
            )
        weights, order = self._weights(row)
        if order is not None:
            weights = torch.zeros_like(weights).scatter_(0, order, weights)
        return weights / weights.sum()

    def pick(self, logits: torch.Tensor) -> int:
        """The next token id from ``logits[vocab_size]`` (any float dtype): the argmax of :meth:`adjusted` when
        greedy, else a draw from :meth:`probabilities` with the request's generator.  Does not :meth:`accept` it.
        O(vocab) greedy; O(vocab log vocab) with top-p (one sort) or top-k."""
        params = self.params
        if params.vocab_limit is not None:
            logits = logits[: params.vocab_limit]
        if self._grammar is not None:
            logits = self._constrain(logits)
        if self._adjusting:
            logits = self._adjust(logits)
        if params.temperature == 0:
            return int(torch.argmax(logits))
        weights, order = self._weights(logits)
        drawn = torch.multinomial(weights, 1, generator=self.generator)
        return int(drawn if order is None else order[drawn])

    def logprobs(self, logits: torch.Tensor, token_id: int) -> TokenLogprob:
        """The :class:`TokenLogprob` of ``token_id`` (the token :meth:`pick` chose from this row) and of the
        ``params.logprobs`` most probable ids: ``log_softmax(logits[:vocab_limit])`` in float32, natural logs.

        The distribution is the model's, before stages 2-10: not what the token was drawn from.  As vLLM's default
        (``logprobs_mode="raw_logprobs"``; OpenAI documents the logprob of a token as the model's), so that the value
        means one thing whatever the request's sampling asked: a greedy request's draw is one-hot (every other token
        would read -inf), a temperature or a penalty would change the score of the same text, and a scorer (perplexity,
        lm-eval's log-likelihoods) wants the model's.  Stage 1 does apply: ids at or above ``vocab_limit`` (a padded
        embedding table's rows, which the tokenizer cannot decode) are outside the distribution and never named as
        alternatives, as vLLM drops its vocabulary padding before it computes logprobs.  Ties among the top ids are
        in ``torch.topk``'s order.  O(vocab) for the log-softmax and the top-k; one device-to-host copy of
        ``1 + logprobs`` values and ``logprobs`` ids."""
        row = logits if self.params.vocab_limit is None else logits[: self.params.vocab_limit]
        logprobs = torch.log_softmax(row.float(), dim=-1)
        count = min(self.params.logprobs or 0, logprobs.shape[0])
        if count == 0:
            return TokenLogprob(token_id, float(logprobs[token_id]))
        top = torch.topk(logprobs, count)
        values = torch.cat((logprobs[token_id].reshape(1), top.values)).tolist()
        return TokenLogprob(token_id, values[0], tuple(zip(top.indices.tolist(), values[1:], strict=True)))

    def prompt_logprobs(self, logits: torch.Tensor, token_ids: Sequence[int]) -> list[TokenLogprob]:
        """One :class:`TokenLogprob` per prompt token: ``token_ids[i]`` from the row before it, ``logits[i]``
        (``[len(token_ids), vocab_size]``, any float dtype), with the ``params.prompt_logprobs`` most probable ids:
        the distribution of :meth:`logprobs` (raw, ids below ``vocab_limit``; a token at or above it reads -inf).

        The log-softmax runs on chunks of at most :data:`PROMPT_LOGPROB_VALUES` values (a few rows of a large
        vocabulary), so no float32 copy of the whole ``[n, vocab]`` is made beside the logits themselves; one
        device-to-host copy of ``1 + k`` values and ``k`` ids per row.  O(n * vocab)."""
        count = self.params.prompt_logprobs or 0
        width = logits.shape[1] if self.params.vocab_limit is None else min(self.params.vocab_limit, logits.shape[1])
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=logits.device)
        inside = ids < width
        step = max(1, PROMPT_LOGPROB_VALUES // width)
        records: list[TokenLogprob] = []
        for lo in range(0, len(ids), step):
            chunk = torch.log_softmax(logits[lo : lo + step, :width].float(), dim=-1)
            chosen_ids = ids[lo : lo + step]
            chosen = chunk.gather(1, torch.where(inside[lo : lo + step], chosen_ids, 0).unsqueeze(1)).squeeze(1)
            chosen = chosen.masked_fill(~inside[lo : lo + step], float("-inf"))
            values = chosen.tolist()
            if count == 0:
                records += map(TokenLogprob, chosen_ids.tolist(), values)
                continue
            top = torch.topk(chunk, min(count, width), dim=-1)
            for token_id, value, top_ids, top_values in zip(
                chosen_ids.tolist(), values, top.indices.tolist(), top.values.tolist(), strict=True
            ):
                records.append(TokenLogprob(token_id, value, tuple(zip(top_ids, top_values, strict=True))))
        return records

    def ends(self, token_id: int, num_generated: int, stop_requested: bool = False) -> str | None:
        """Why the request ends with ``token_id``, its ``num_generated``-th token: ``"stop"`` (a stop token after
        ``min_tokens`` tokens and without ``ignore_eos``, or the caller asked to stop there: a stop string matched on
        the decoded text), ``"length"`` (``max_new_tokens`` reached), or None to go on."""
        params = self.params
        if stop_requested:
            return "stop"
        if token_id in params.stop_token_ids and not params.ignore_eos and num_generated > params.min_tokens:
            return "stop"
        if self._grammar is not None and self._grammar.done:
            # Else the mask leaves only the stop tokens: the answer ends on one, as a free answer does, and the next
            # turn's prompt (which renders it) hits the cache for all of this one.
            if not self._grammar_stops() or num_generated < params.min_tokens:
                return "stop"
        if num_generated >= params.max_new_tokens:
            return "length"
        return None

    def _constrain(self, row: torch.Tensor) -> torch.Tensor:
        # Out of place, as _adjust.
        allowed = self._grammar.allowed(row.shape[0], self._grammar_stops(), row.device)
        return row.masked_fill(~allowed, float("-inf"))

    def _grammar_stops(self) -> frozenset[int]:
        # With ignore_eos the stop tokens end nothing, so the grammar never allows them.
        return frozenset() if self.params.ignore_eos else self.params.stop_token_ids

    def _adjust(self, row: torch.Tensor) -> torch.Tensor:
        # Out of place throughout: the row may be a view of logits the request returns (return_logits).
        params, width = self.params, row.shape[0]
        row = row.float()
        if self._stop_ids is not None and self.num_generated < params.min_tokens:
            row = row.index_fill(0, self._stop_ids, float("-inf"))
        if self._bias_ids is not None:
            row = row.index_add(0, self._bias_ids, self._bias_values)
        if self._seen is not None:
            penalty = params.repetition_penalty
            row = torch.where(self._seen[:width], torch.where(row > 0, row / penalty, row * penalty), row)
        if self._counts is not None:
            counts = self._counts[:width]
            row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        return row

    def _weights(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stages 7-9: unnormalized draw weights, and the order they are in (None: token order)."""
        params = self.params
        scaled = row.float() / params.temperature
        if self._adjusting:
            # A penalty or a bias can overflow a logit to +inf (repetition_penalty 1e-300), where softmax is NaN:
            # the limit of the distribution is uniform over the overflowed ids.  No sync: one where on the device.
            overflowed = torch.isposinf(scaled)
            scaled = torch.where(overflowed.any(), torch.where(overflowed, 0.0, float("-inf")), scaled)
        if self._filtering:
            if params.min_p > 0:
                probs = torch.softmax(scaled, dim=-1)
                scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
            if 0 < params.top_k < scaled.shape[0]:
                kth = torch.topk(scaled, params.top_k, sorted=False).values.min()
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
            keep[0] = True  # a top_p below float32's smallest (5e-324 rounds to 0) still keeps the top token
            return sorted_probs * keep, order
        return probs, None
