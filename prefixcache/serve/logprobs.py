"""The ``logprobs`` objects of OpenAI's two response shapes, made from the engine's
:class:`~prefixcache.engine.results.TokenLogprob` records (``ChatCompletion.logprobs``: one per generated token that is
not a stop token; see :class:`~prefixcache.engine.chat_decoder.ChatCompletion`).

- Chat completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": None}``, ``top_logprobs`` the ``k`` most probable tokens, most probable first.
- Completions (the legacy shape): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, each
  ``top_logprobs`` entry a dict of token string to logprob holding the sampled token and the ``k`` most probable (so
  ``k`` entries, or ``k + 1`` when the sampled token is not among them, as OpenAI documents).  Distinct ids that decode
  alike (bytes of split characters all decode to U+FFFD; SentencePiece's ``\u2581true`` and ``true``) keep distinct
  keys: the sampled token, then the most probable, keeps its string, and a later one whose string is taken is keyed
  ``token_id:N`` (vLLM's spelling under ``return_tokens_as_token_ids``).  ``text_offset`` is each token's start in
  the returned text, in characters: a token adds the characters it completes, so one holding part of a character
  (a byte-level BPE's split emoji) adds 0 and the token that completes it adds the character (:class:`TextOffset`).

A token's string is its id decoded alone by the tokenizer, as vLLM and OpenAI write it: a token holding part of a
character decodes to U+FFFD, and a SentencePiece word loses its leading space.  Its ``bytes`` are its own
(:meth:`Tokenizer.token_bytes <prefixcache.chat.tokenizer.Tokenizer.token_bytes>`), so the bytes of all of an
answer's tokens, joined, are the answer's UTF-8 (Qwen2.5's token 26525 is ``[32, 240, 159, 152]``, the space and
first three bytes of an emoji, not the replacement character's ``[32, 239, 191, 189]``).  The offsets are counted
from those bytes, which for a SentencePiece tokenizer hold the space its decode drops at the start of a text: there
the offsets after such a first token are one more than in the text.  Logprobs below -9999 (and NaN) are written as
-9999.0, OpenAI's stand-in for ``-inf``, which JSON cannot carry.  Streamed chunks carry the entries of the tokens
since the previous chunk; concatenated, they are the whole answer's.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

from prefixcache.engine.results import TokenLogprob

__all__ = ["LOGPROB_FLOOR", "TextOffset", "TokenStrings", "chat_logprobs", "completion_logprobs"]

LOGPROB_FLOOR = -9999.0
"""What a logprob of ``-inf`` (or below this, or NaN) is written as: OpenAI's value, which vLLM writes too."""


class TokenStrings:
    """Token id -> the string ``tokenizer.decode([id])`` and the bytes ``tokenizer.token_bytes(id)`` (a tokenizer
    without that method: the string's UTF-8), each kept for the most recent ``2**16`` ids (LRU caches: thread-safe).
    O(1) per id once cached."""

    def __init__(self, tokenizer: Any) -> None:
        decode = tokenizer.decode
        own_bytes = getattr(tokenizer, "token_bytes", None)
        self._text: Callable[[int], str] = lru_cache(maxsize=1 << 16)(lambda token_id: decode([token_id]))
        if own_bytes is None:
            self._bytes: Callable[[int], bytes] = lambda token_id: self._text(token_id).encode("utf-8", "replace")
        else:
            self._bytes = lru_cache(maxsize=1 << 16)(own_bytes)

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)

    def bytes_of(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to the text (part of a character, for a token that splits one)."""
        return self._bytes(token_id)


class TextOffset(NamedTuple):
    """Where the next token's text starts: after ``chars`` characters, with ``pending`` the bytes of a character the
    tokens so far began and did not complete (at most 3)."""

    chars: int
    pending: bytes = b""

    def after(self, data: bytes) -> TextOffset:
        """The offset after a token of bytes ``data``: ``chars`` plus the characters ``pending + data`` completes
        (an invalid byte is one U+FFFD, as the text decodes it).  O(len(data))."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text = decoder.decode(self.pending + data)
        return TextOffset(self.chars + len(text), decoder.getstate()[0])


def _value(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # -inf and NaN fail the comparison


def _entry(strings: TokenStrings, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": strings(token_id), "logprob": _value(logprob), "bytes": list(strings.bytes_of(token_id))}


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
    records: Sequence[TokenLogprob], strings: TokenStrings, text_offset: int | TextOffset = 0
) -> tuple[dict[str, Any], TextOffset]:
    """The completion choice's legacy ``logprobs`` for ``records``, their ``text_offset`` counted from
    ``text_offset`` (a count of characters, or the :class:`TextOffset` the previous chunk's call returned, which
    carries a character its last token began), and the offset after the last token.  O(records * (k + 1)) token
    strings."""
    offset = TextOffset(text_offset) if isinstance(text_offset, int) else text_offset
    tokens, values, tops, offsets = [], [], [], []
    for record in records:
        token = strings(record.token_id)
        top = {token: _value(record.logprob)}
        for token_id, logprob in record.top:
            if token_id != record.token_id:
                key = strings(token_id)
                top.setdefault(f"token_id:{token_id}" if key in top else key, _value(logprob))
        tokens.append(token)
        values.append(_value(record.logprob))
        tops.append(top)
        offsets.append(offset.chars)
        offset = offset.after(strings.bytes_of(record.token_id))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset
