"""The ``logprobs`` objects of OpenAI's two response shapes, made from the engine's
:class:`~prefixcache.engine.results.TokenLogprob` records (``ChatCompletion.logprobs``: one per generated token that is
not a stop token; see :class:`~prefixcache.engine.chat.ChatCompletion`).

- Chat completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": None}``, ``top_logprobs`` the ``k`` most probable tokens, most probable first.
- Completions (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, each
  ``top_logprobs`` entry a dict of token string to logprob holding the sampled token and the ``k`` most probable (so
  up to ``k + 1`` entries, as OpenAI documents; keyed by string, so of ids that decode alike the first stays: the
  sampled one, then the more probable), ``text_offset`` each token's start in the concatenated token strings.

A token's string is its id decoded alone by the tokenizer, and ``bytes`` that string's UTF-8 bytes, as vLLM writes
them: a byte of a character split across tokens decodes to U+FFFD (bytes ``[239, 191, 189]``), and a SentencePiece
word loses its leading space.  Logprobs below -9999 (and NaN) are written as -9999.0, OpenAI's stand-in for ``-inf``,
which JSON cannot carry.  Streamed chunks carry the entries of the tokens since the previous chunk; concatenated, they
are the whole answer's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from prefixcache.engine.results import TokenLogprob

__all__ = ["LOGPROB_FLOOR", "TokenStrings", "chat_logprobs", "completion_logprobs"]

LOGPROB_FLOOR = -9999.0
"""What a logprob of ``-inf`` (or below this, or NaN) is written as: OpenAI's value, which vLLM writes too."""


class TokenStrings:
    """Token id -> the string ``tokenizer.decode([id])``, kept for the most recent ``2**16`` ids (an LRU cache:
    thread-safe).  O(1) per id once cached."""

    def __init__(self, tokenizer: Any) -> None:
        decode = tokenizer.decode
        self._text: Callable[[int], str] = lru_cache(maxsize=1 << 16)(lambda token_id: decode([token_id]))

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)


def _value(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf and NaN fail the comparison


def _entry(strings: TokenStrings, token_id: int, logprob: float) -> dict[str, Any]:
    token = strings(token_id)
    return {"token": token, "logprob": _value(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}


def chat_logprobs(records: Sequence[TokenLogprob], strings: TokenStrings) -> dict[str, Any]:
    """The chat choice's ``logprobs``: ``{"content": [entry per record], "refusal": None}``.  O(records * (k + 1))
    token strings."""
    content = []
    for record in records:
        entry = _entry(strings, record.token_id, record.logprob)
        entry["top_logprobs"] = [_entry(strings, token_id, logprob) for token_id, logprob in record.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    records: Sequence[TokenLogprob], strings: TokenStrings, text_offset: int = 0
) -> tuple[dict[str, Any], int]:
    """The completion choice's legacy ``logprobs`` for ``records``, their ``text_offset`` counted from
    ``text_offset`` (a stream's chunks go on from the previous chunk's end), and the offset after the last token.
    O(records * (k + 1)) token strings."""
    tokens, values, tops, offsets = [], [], [], []
    for record in records:
        token = strings(record.token_id)
        top = {token: _value(record.logprob)}
        for token_id, logprob in record.top:
            top.setdefault(strings(token_id), _value(logprob))
        tokens.append(token)
        values.append(_value(record.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, text_offset
