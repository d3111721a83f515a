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

__all__ = ["MAX_STOP_SEQUENCES", "StopMatcher", "TextStream", "check_stop"]

MAX_STOP_SEQUENCES = 4
"""OpenAI's limit on the number of stop strings in one request."""


def check_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """Normalize OpenAI's ``stop`` (a string, a list of strings, or ``None``) to a tuple of non-empty strings.

    Raises :class:`InvalidArgumentError` for another type, an empty string or more than :data:`MAX_STOP_SEQUENCES`.
    """
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, Sequence) or not all(isinstance(s, str) for s in items):
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(not s for s in items):
        raise InvalidArgumentError("stop strings must not be empty")
    if len(items) > MAX_STOP_SEQUENCES:
        raise InvalidArgumentError(f"at most {MAX_STOP_SEQUENCES} stop strings, got {len(items)}")
    return tuple(items)


@dataclass(slots=True)
class StopMatcher:
    """Feed text deltas, get back what is safe to emit; :attr:`stopped` turns true at the first stop string.

    Memory is bounded by the longest stop string.  Each :meth:`feed` is O(len(delta) + held-back text) per stop string.
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
    """Token ids in, text deltas out, for any :class:`Tokenizer`.

    Decodes the ids since the last emitted character boundary and holds back a trailing U+FFFD (a multi-byte
    character cut by a token boundary), as Hugging Face's ``TextStreamer`` does; the deltas add up to the decode of
    all the ids.  ``skip`` ids (end-of-turn tokens) produce no text.  Cost per token: O(ids since the last boundary).
    """

    __slots__ = ("_pending", "_skip", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer, skip: Iterable[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip = frozenset(skip)
        self._pending: list[int] = []

    def push(self, token_id: int) -> str:
        """Text completed by ``token_id`` (may be ``""``)."""
        if token_id in self._skip:
            return ""
        pending = self._pending
        pending.append(token_id)
        text = self._tokenizer.decode(pending)
        if not text.endswith("\ufffd"):
            pending.clear()
            return text
        if len(pending) < _MAX_HELD_IDS:
            return ""
        # A long run of ids ending in U+FFFD is mostly invalid bytes: emit all but the last few ids (a UTF-8
        # character spans at most 4), cut where no character spans the cut, so the text stays decode(all ids).
        for keep in range(3, 0, -1):
            head = self._tokenizer.decode(pending[:-keep])
            if head + self._tokenizer.decode(pending[-keep:]) == text:
                del pending[:-keep]
                return head
        pending.clear()
        return text

    def flush(self) -> str:
        """Whatever is left (an incomplete character decodes as U+FFFD)."""
        text = self._tokenizer.decode(self._pending) if self._pending else ""
        self._pending.clear()
        return text
