"""Sampling parameters: what a request asks of the token picker (:mod:`prefixcache.engine.logits` applies them).

Greedy (argmax) by default; temperature and top-p (nucleus) sampling as in Holtzman et al., "The Curious Case of
Neural Text Degeneration" (2020), with a seed so that sampling repeats.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from prefixcache.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens.  ``temperature == 0`` is greedy (the default); ``top_p`` keeps the smallest set of
    tokens whose probability reaches it; ``seed`` makes sampling repeatable; generation stops after
    ``max_new_tokens`` tokens or on a token of ``stop_token_ids`` (which is kept in the output ids).
    ``vocab_limit`` restricts sampling to ids below it (``chat`` sets it to the tokenizer's vocabulary size, since
    a model's embedding table is often padded beyond the ids its tokenizer can decode).

    Raises:
        InvalidArgumentError: ``max_new_tokens < 0``, ``temperature < 0``, ``top_p`` outside (0, 1],
            ``stop_token_ids`` not a collection of non-negative ints.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    vocab_limit: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise InvalidArgumentError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise InvalidArgumentError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63
        ):
            raise InvalidArgumentError(f"seed must be None or an int in 0 .. 2**63 - 1, got {self.seed!r}")
        if not self.temperature >= 0:
            raise InvalidArgumentError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature != 0 and self.temperature < 1e-4:
            raise InvalidArgumentError(f"temperature must be 0 (greedy) or at least 1e-4, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.vocab_limit is not None and (
            isinstance(self.vocab_limit, bool) or not isinstance(self.vocab_limit, int) or self.vocab_limit < 1
        ):
            raise InvalidArgumentError(f"vocab_limit must be a positive int or None, got {self.vocab_limit!r}")
        object.__setattr__(self, "stop_token_ids", check_stop_token_ids(self.stop_token_ids))


def check_stop_token_ids(stop_token_ids: object) -> frozenset[int]:
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
