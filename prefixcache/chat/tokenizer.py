"""Tokenizers: the protocol the rest of prefixcache codes against, and the embedded byte tokenizer.

The cache only ever sees token ids, so a tokenizer's job here is to turn chat messages into the exact ids a
server would prefill.  :class:`ByteTokenizer` needs no download: ids 0..255 are UTF-8 bytes and three ChatML
specials follow.  Byte-level encoding is prefix-stable (``encode(a + b) == encode(a) + encode(b)``), so a
conversation's next prompt always extends its previous prompt token for token; BPE tokenizers do not promise
that at segment boundaries, which is why the chat template is rendered segment by segment.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from prefixcache.chat.template import check_template_kwargs, encode_segments, render_segments
from prefixcache.errors import InvalidArgumentError, InvalidTokensError

__all__ = ["BYTE_SPECIAL_TOKENS", "ByteTokenizer", "Tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What prefixcache needs from a tokenizer.

    ``name`` identifies the tokenizer *and* its chat template: it goes into the cache fingerprint, so two
    tokenizers that could map the same text to different ids must have different names.
    """

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]:
        """Token ids of plain ``text``; special-token strings inside it are encoded as ordinary text."""
        ...

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; raises :class:`InvalidTokensError` for ids outside ``[0, vocab_size)``."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to decoded text, whole or part of a UTF-8 character (a byte-level BPE token
        may hold the first bytes of an emoji): the bytes of all the ids of a text, joined, are its UTF-8.
        :class:`InvalidTokensError` for an id outside ``[0, vocab_size)``."""
        ...

    def special_token_id(self, name: str) -> int:
        """Id of the special token spelled ``name`` (``"<|im_start|>"``); :class:`InvalidArgumentError` if unknown."""
        ...

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Ids of the chat-template rendering of ``messages`` and ``tools``, ``template_kwargs`` given to the template
        as extra variables (a template may ignore them); :class:`TemplateError` if invalid.  Callers pass
        ``template_kwargs`` only when there are some, so a tokenizer without the keyword still renders plain chats."""
        ...


BYTE_SPECIAL_TOKENS: Mapping[str, int] = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
"""Special tokens of :class:`ByteTokenizer`, spelled as in ChatML, numbered right after the 256 bytes."""

_BYTE_SPECIAL_NAMES: dict[int, str] = {token_id: name for name, token_id in BYTE_SPECIAL_TOKENS.items()}
_ENCODE_CHUNK_BYTES = 1 << 18


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus ChatML specials 256..258; vocabulary size 259.

    ``encode`` is O(len(text)) and never fails; ``decode`` replaces partial UTF-8 sequences with U+FFFD, so it
    can decode any slice of an encoding.  Instances are stateless and interchangeable.
    """

    __slots__ = ()

    @property
    def name(self) -> str:
        # Bump the version suffix whenever the byte map, the specials or the chat template change, so stale
        # cache fingerprints stop matching.
        return "byte-utf8+chatml-v2"

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def eos_token_ids(self) -> frozenset[int]:
        # <|im_end|> ends an assistant turn in ChatML; <|endoftext|> ends a document.
        return frozenset({BYTE_SPECIAL_TOKENS["<|endoftext|>"], BYTE_SPECIAL_TOKENS["<|im_end|>"]})

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids; ``"<|im_end|>"`` in the text stays 10 byte ids, not id 258.

        Raises :class:`InvalidArgumentError` if ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise InvalidArgumentError(f"encode expects str, got {type(text).__name__}")
        # surrogatepass: lone surrogates (possible in JSON-escaped input) must not make encoding fail.
        data = text.encode("utf-8", errors="surrogatepass")
        if len(data) <= _ENCODE_CHUNK_BYTES:
            return list(data)
        # In pieces: one list() of 30 MB holds the GIL ~2 s, stalling every other thread (a server's event loop).
        ids: list[int] = []
        for start in range(0, len(data), _ENCODE_CHUNK_BYTES):
            ids += data[start : start + _ENCODE_CHUNK_BYTES]
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: bytes decoded as UTF-8 (invalid sequences become U+FFFD), specials as their names.

        Accepts any iterable of integers (list, ``array``, 1-D integer tensor).  O(len(ids)).
        Raises :class:`InvalidTokensError` for a non-integer id or one outside ``[0, 259)``.
        """
        parts: list[str] = []
        pending = bytearray()
        for position, raw in enumerate(ids):
            try:
                token_id = operator.index(raw)
            except TypeError:
                raise InvalidTokensError(f"token at position {position} is not an integer: {raw!r}") from None
            if 0 <= token_id < 256:
                pending.append(token_id)
                continue
            special = _BYTE_SPECIAL_NAMES.get(token_id)
            if special is None:
                raise InvalidTokensError(
                    f"token id {token_id} at position {position} is outside [0, {self.vocab_size})"
                )
            # Flush bytes before a special so a multi-byte character is never glued across it.
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            parts.append(special)
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_bytes(self, token_id: int) -> bytes:
        """The byte ``token_id`` is (ids 0..255), or a special's name in UTF-8.  O(1).

        Raises :class:`InvalidTokensError` for a non-integer id or one outside ``[0, 259)``.
        """
        try:
            token_id = operator.index(token_id)
        except TypeError:
            raise InvalidTokensError(f"token id is not an integer: {token_id!r}") from None
        if 0 <= token_id < 256:
            return bytes((token_id,))
        special = _BYTE_SPECIAL_NAMES.get(token_id)
        if special is None:
            raise InvalidTokensError(f"token id {token_id} is outside [0, {self.vocab_size})")
        return special.encode("utf-8")

    def special_token_id(self, name: str) -> int:
        """Id of special token ``name``; raises :class:`InvalidArgumentError` naming the known specials."""
        try:
            return BYTE_SPECIAL_TOKENS[name]
        except (KeyError, TypeError):
            known = ", ".join(BYTE_SPECIAL_TOKENS)
            raise InvalidArgumentError(f"unknown special token {name!r}; known: {known}") from None

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Ids of the ChatML rendering (see :mod:`prefixcache.chat.template`); :class:`TemplateError` if invalid.

        O(total characters).  The result for ``messages[:i]`` with a generation prompt is a prefix of the result
        for ``messages[:i + 1]`` without one whenever ``messages[i]`` is an assistant turn.  The ChatML template
        reads no variables: ``template_kwargs`` are checked (:func:`~prefixcache.chat.template.check_template_kwargs`)
        and change nothing.
        """
        check_template_kwargs(template_kwargs)
        segments = render_segments(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        return encode_segments(segments, self.encode, self.special_token_id)

    def __repr__(self) -> str:
        return "ByteTokenizer()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(ByteTokenizer)
