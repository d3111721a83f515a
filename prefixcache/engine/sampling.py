"""Sampling parameters: what a request asks of the token picker (:mod:`prefixcache.engine.logits` applies them).

Greedy (argmax) by default.  Each knob is the definition of the system named beside it, so that a request asks here
what it asks vLLM or OpenAI:

- ``temperature`` and ``top_p`` (nucleus sampling: Holtzman et al., "The Curious Case of Neural Text Degeneration",
  2020), with a ``seed`` so that sampling repeats;
- ``top_k`` (Fan et al., "Hierarchical Neural Story Generation", 2018; vLLM: 0 or -1 is off) and ``min_p`` (vLLM and
  Nguyen et al., "Turning Up the Heat: Min-p Sampling", 2024: keep tokens whose probability is at least ``min_p``
  times the most probable one's);
- ``presence_penalty`` and ``frequency_penalty`` (OpenAI's API reference, on the counts of the tokens generated so
  far), ``repetition_penalty`` (Keskar et al., "CTRL", 2019, as Hugging Face and vLLM apply it, on the prompt and the
  tokens generated so far), ``logit_bias`` (OpenAI: a bias added to a token's logit, -100 .. 100);
- ``min_tokens`` and ``ignore_eos`` (vLLM: the stop tokens are masked until ``min_tokens`` tokens are generated; with
  ``ignore_eos`` a stop token does not end the request);
- ``logprobs`` (vLLM's ``SamplingParams.logprobs``, OpenAI's ``top_logprobs``: the log-probability of each sampled
  token and of its ``logprobs`` most probable alternatives, at most 20 as both allow) and ``prompt_logprobs`` (vLLM's:
  the same of each prompt token, what ``echo`` with ``logprobs`` returns on OpenAI's legacy completions);
- ``grammar`` (structured outputs: OpenAI's ``response_format``, vLLM's ``guided_decoding``): a
  :class:`~prefixcache.engine.grammar.Grammar` the answer must follow.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

from prefixcache.engine.grammar import Grammar
from prefixcache.errors import InvalidArgumentError

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_OPENAI_PENALTY",
    "SamplingParams",
    "check_logit_bias",
    "check_stop_token_ids",
]

MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a ``logit_bias`` value (either sign)."""

MAX_OPENAI_PENALTY = 2.0
"""OpenAI's (and vLLM's) bound on ``presence_penalty`` and ``frequency_penalty`` (either sign)."""

MAX_LOGPROBS = 20
"""The most alternatives ``logprobs`` may ask for: OpenAI's bound on ``top_logprobs``, vLLM's default
``max_logprobs``."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens.

    ``temperature == 0`` is greedy (the default); ``top_p`` keeps the smallest set of tokens whose probability reaches
    it; ``top_k`` keeps the ``top_k`` most probable tokens (ties at the k-th logit kept; 0 or -1: off); ``min_p``
    keeps the tokens of probability ``>= min_p * max probability`` (0: off); ``seed`` makes sampling repeatable
    (whatever runs beside the request).  Generation stops after ``max_new_tokens`` tokens or on a token of
    ``stop_token_ids`` (which is kept in the output ids), unless ``ignore_eos``; before ``min_tokens`` tokens are
    generated the stop tokens cannot be picked (their logits are -inf; not with ``ignore_eos``, where they end
    nothing; a stop string of the chat layer still ends a request before ``min_tokens``, where vLLM would not look
    for it yet).  ``vocab_limit`` restricts sampling to ids below it (``chat`` sets it to the tokenizer's vocabulary
    size, since a model's embedding table is often padded beyond the ids its tokenizer can decode).

    Penalties, on the logits before temperature (greedy requests see them too): ``frequency_penalty`` and
    ``presence_penalty`` subtract ``frequency_penalty * count + presence_penalty * (count > 0)`` from each token's
    logit, ``count`` its occurrences among the tokens generated so far (OpenAI); ``repetition_penalty`` divides the
    positive logits and multiplies the negative ones of every token of the prompt or generated so far (CTRL, as
    Hugging Face and vLLM; 1: off); ``logit_bias`` maps token ids to a bias added to their logits (OpenAI).  It is
    given as a mapping or pairs and kept as a tuple of ``(token_id, bias)`` pairs in id order (so the record stays
    hashable); ids must be below the model's vocabulary (checked at submit).

    ``logprobs`` (None: off, the default, and no work is done for it) asks for a record of every sampled token: its
    log-probability and those of the ``logprobs`` most probable tokens (0: the sampled token's only; at most
    ``MAX_LOGPROBS``), in ``GenerationResult.logprobs``.  They are of the model's own distribution at that position,
    the log-softmax of its raw logits over the ids below ``vocab_limit``, before ``min_tokens``, the bias, the
    penalties and temperature (see :meth:`~prefixcache.engine.logits.LogitsPipeline.logprobs` for why).

    ``prompt_logprobs`` (None: off, the default) asks for the same record of each prompt token from the position
    before it, with the ``prompt_logprobs`` most probable tokens there, in ``GenerationResult.prompt_logprobs``: of the
    tokens whose position before is computed, so every one after the first with ``recompute_prompt`` (a cache keeps
    K/V, not logits).  The engine reduces each computed chunk of rows to these records as it goes
    (:meth:`~prefixcache.engine.logits.LogitsPipeline.prompt_logprobs`): the ``[prompt, vocab]`` logits are never
    kept, returned or sent from an engine process.

    ``grammar`` (None: off) constrains every picked token to what the :class:`~prefixcache.engine.grammar.Grammar`
    allows there (a stop token only where the text may end); a complete grammar ends the request (``"stop"``).

    Raises:
        InvalidArgumentError: ``max_new_tokens < 0``, ``temperature`` negative or infinite, ``top_p`` outside (0, 1],
            ``top_k`` not an int >= -1, ``min_p`` outside [0, 1], ``presence_penalty`` or ``frequency_penalty``
            outside [-2, 2], ``repetition_penalty`` not a finite number > 0, ``logit_bias`` not a mapping of
            non-negative int ids to numbers in [-100, 100], ``min_tokens`` not an int in 0 .. ``max_new_tokens``,
            ``ignore_eos`` not a bool, ``stop_token_ids`` not a collection of non-negative ints, ``logprobs`` or
            ``prompt_logprobs`` not None or an int in 0 .. ``MAX_LOGPROBS``; ``grammar`` not None or a Grammar; a
            value of the wrong type.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    vocab_limit: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: Grammar | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k", "min_tokens"):
            _check_int(name, getattr(self, name))
        if self.max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
            try:  # kept as a float: torch cannot scale logits by an int beyond int64 (2**70), nor Python beyond 1e308
                object.__setattr__(self, name, float(value))
            except OverflowError:
                raise InvalidArgumentError(
                    f"{name} must be a finite number, got an int of {value.bit_length()} bits"
                ) from None
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):
            raise InvalidArgumentError(f"seed must be None or an int in 0 .. 2**63 - 1, got {self.seed!r}")
        if not self.temperature >= 0:
            raise InvalidArgumentError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature == math.inf:  # -inf / inf is NaN (min_tokens' masked stop tokens)
            raise InvalidArgumentError("temperature must be finite, got inf")
        if self.temperature != 0 and self.temperature < 1e-4:
            raise InvalidArgumentError(f"temperature must be 0 (greedy) or at least 1e-4, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidArgumentError(f"top_k must be >= 1, or 0 or -1 (off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidArgumentError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_OPENAI_PENALTY <= getattr(self, name) <= MAX_OPENAI_PENALTY:
                raise InvalidArgumentError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < math.inf:
            raise InvalidArgumentError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}"
            )
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidArgumentError(
                f"min_tokens must be in 0 .. max_new_tokens ({self.max_new_tokens}), got {self.min_tokens}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.vocab_limit is not None and (
            isinstance(self.vocab_limit, bool) or not isinstance(self.vocab_limit, int) or self.vocab_limit < 1
        ):
            raise InvalidArgumentError(f"vocab_limit must be a positive int or None, got {self.vocab_limit!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise InvalidArgumentError(f"{name} must be None (off) or an int in 0 .. {MAX_LOGPROBS}, got {value!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InvalidArgumentError(f"grammar must be None or a Grammar, got {type(self.grammar).__name__}")
        object.__setattr__(self, "stop_token_ids", check_stop_token_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")


def check_stop_token_ids(stop_token_ids: object) -> frozenset[int]:
    """``stop_token_ids`` as a frozenset of ints.  Raises InvalidArgumentError unless it is a collection of
    non-negative ints (bools, floats and strings refused)."""
    # int() would turn 1.5 into 1 and "7" into 7: a stop token that silently differs from the one asked for.
    try:
        ids = list(stop_token_ids)  # type: ignore[call-overload]
        bad = [t for t in ids if isinstance(t, bool) or operator.index(t) < 0]
    except TypeError:
        bad = None
    if bad != []:
        raise InvalidArgumentError(
            f"stop_token_ids must be a collection of non-negative int token ids, got {stop_token_ids!r}"
        )
    return frozenset(operator.index(t) for t in ids)


def check_logit_bias(logit_bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a mapping of token id to bias, or ``(id, bias)`` pairs) as ``(id, bias)`` pairs sorted by id,
    biases as floats.  Raises InvalidArgumentError: not a mapping or pairs, an id that is not a non-negative int (a
    bool or a numeric string included), the same id twice, a bias that is not a number in [-100, 100] (OpenAI)."""
    try:
        items = logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias  # type: ignore[attr-defined]
        pairs = [(token_id, bias) for token_id, bias in items]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"logit_bias must map int token ids to numbers in [-100, 100], got {logit_bias!r}"
        ) from None
    checked: dict[int, float] = {}
    for key, bias in pairs:
        try:
            token_id = -1 if isinstance(key, bool) else operator.index(key)
        except TypeError:
            token_id = -1
        if token_id < 0:
            raise InvalidArgumentError(f"logit_bias: token ids must be non-negative ints, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) <= MAX_LOGIT_BIAS:
            raise InvalidArgumentError(f"logit_bias: token {token_id}: bias must be in [-100, 100], got {bias!r}")
        if token_id in checked:
            raise InvalidArgumentError(f"logit_bias: token {token_id} is given twice")
        checked[token_id] = float(bias)
    return tuple(sorted(checked.items()))
