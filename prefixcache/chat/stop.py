"""String stop sequences matched on decoded text as tokens arrive, and incremental detokenization.

A stop string such as ``"Observation:"`` rarely lines up with token boundaries (BPE may split it anywhere, the byte
tokenizer spells it one byte per token), so it is matched on the decoded text: :class:`TextStream` turns token ids
into text deltas, holding back an incomplete UTF-8 character, and :class:`StopMatcher` holds back any tail that could
still grow into a stop string, so a streaming client never sees text that is later trimmed.  This is the behaviour
of OpenAI's ``stop`` parameter (the stop string itself is not returned) as vLLM and llama.cpp implement it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prefixcache.chat.tokenizer import Tokenizer
from prefixcache.errors import InvalidArgumentError

__all__ = ["StopMatcher", "TextStream", "check_stop"]


def check_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """Normalize OpenAI's ``stop`` (a string, a list of strings, or ``None``) to a tuple of non-empty strings.

    Any number of strings: OpenAI allows 4, vLLM has no limit and lm-eval's ``until`` lists may hold more.  Raises
    :class:`InvalidArgumentError` for another type or an empty string.
    """
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, Sequence) or not all(isinstance(s, str) for s in items):
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(not s for s in items):
        raise InvalidArgumentError("stop strings must not be empty")
    return tuple(items)


@dataclass(slots=True)
class StopMatcher:
    """Feed text deltas, get back what is safe to emit; :attr:`stopped` turns true at the first stop string.

    Memory is bounded by the longest stop string.  Each :meth:`feed` is O(len(delta) + held-back text) per stop string,
    so O(number of stop strings) per token.
    """

    stops: tuple[str, ...]
    stopped: bool = False
    _held: str = field(default="", repr=False)

    def feed(self, delta: str) -> str:
        """Text of ``delta`` (plus earlier held-back text) that can no longer be part of a stop string.

        Once a stop string is complete, returns the text before it and discards the rest; after that, returns ``""``.
        Of several stop strings in the text, the one that ends first counts (of those ending together, the longest),
        so the result does not depend on how the text was cut into deltas.
        """
        if self.stopped:
            return ""
        text = self._held + delta
        # Generation stops once a stop string is complete, so the one that ends first wins (of two ending together,
        # the longer); the earliest-starting one would make the answer depend on how tokens chunk the text.
        ends = [(i + len(s), i) for s in self.stops if (i := text.find(s)) >= 0]
        if ends:
            self.stopped = True
            self._held = ""
            return text[: min(ends)[1]]
        keep = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:length]):
                    keep = length
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back tail, at the end of generation (it never became a stop string)."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held


_MAX_HELD_IDS = 8
"""Ids :class:`TextStream` holds while their text ends in U+FFFD before it emits all but the last few."""


class TextStream:
    """Token ids in, text deltas out, for any :class:`Tokenizer`: incremental detokenization with a prefix offset.

    Each push decodes a short window, the ids of the previous delta (the context, already emitted) and the ids not
    yet emitted, and emits what that text adds to the context's own decode, as vLLM's ``detokenize_incrementally``
    does with its prefix and read offsets.  Decoding the new ids alone would lose text: a SentencePiece decoder
    (Llama 2, Mistral, Gemma: ``Metaspace``, or ``Replace("\u2581", " ") + ... + Strip(" ", 1, 0)``) drops the leading
    space of every decode, so each word came out glued to the last ("Helloworld,"); with the context in front, only
    a context token, whose text went out earlier, loses it.  A trailing U+FFFD (a multi-byte character cut by a token
    boundary, byte fallback spelling it one byte per token) is held back, as Hugging Face's ``TextStreamer`` does.

    The deltas add up to ``tokenizer.decode(all ids)`` wherever decoding more ids extends the text at a character
    boundary: byte-level BPE (GPT-2, Qwen, Llama 3), the byte tokenizer, and SentencePiece over valid UTF-8.  Hugging
    Face's ``ByteFallback`` renders a whole run of byte tokens as U+FFFD once any byte in it is invalid, so an answer
    that goes on (or is cut) inside a character after complete characters of the same run decodes those as U+FFFD
    too; the stream, which emitted them when they were complete, then gives the new ids' own decode.  ``skip`` ids
    (end-of-turn tokens) produce no text.

    Cost per token: one or two decodes of at most ``2 * _MAX_HELD_IDS`` ids (a delta ends at the latest after that
    many held ids), so O(1) in the length of the answer.
    """

    __slots__ = ("_context_text", "_ids", "_read", "_skip", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, skip: Iterable[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip = frozenset(skip)
        self._ids: list[int] = []  # the context (ids[:_read], emitted) then the ids not yet emitted
        self._read = 0
        self._context_text = ""  # decode(ids[:_read])

    def push(self, token_id: int) -> str:
        """Text completed by ``token_id`` (may be ``""``)."""
        if token_id in self._skip:
            return ""
        ids = self._ids
        ids.append(token_id)
        text = self._tokenizer.decode(ids)
        if not text.endswith("\ufffd"):
            return self._emit(len(ids), text)
        if len(ids) - self._read < _MAX_HELD_IDS:
            return ""
        # A long run of ids ending in U+FFFD is mostly invalid bytes: emit all but the last few ids (a UTF-8
        # character spans at most 4), cut where no character spans the cut (the tail's own decode is the rest of
        # the text; the tail holds byte tokens only, whose decode has no leading space to lose).
        for keep in range(3, 0, -1):
            head = self._tokenizer.decode(ids[:-keep])
            if head + self._tokenizer.decode(ids[-keep:]) == text:
                return self._emit(len(ids) - keep, head)
        return self._emit(len(ids), text)

    def flush(self) -> str:
        """Whatever is left, at the end of generation (an incomplete character decodes as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(len(self._ids), self._tokenizer.decode(self._ids))

    def _emit(self, upto: int, text: str) -> str:
        """The delta of ``ids[_read:upto]``, given ``text == decode(ids[:upto])``; those ids become the context."""
        ids, read = self._ids, self._read
        if text.startswith(self._context_text):
            delta = text[len(self._context_text) :]
            context_text = text if read == 0 else None
        else:
            # ByteFallback turned complete characters of the context into U+FFFD (see above): they went out already.
            delta = context_text = self._tokenizer.decode(ids[read:upto])
        del ids[:read]
        self._read = upto - read
        self._context_text = self._tokenizer.decode(ids[: self._read]) if context_text is None else context_text
        return delta
