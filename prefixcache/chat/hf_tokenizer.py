"""Hugging Face tokenizers behind our :class:`~prefixcache.chat.tokenizer.Tokenizer`
protocol (extra ``prefixcache[hf]``).

:class:`HFTokenizer` loads a local tokenizer folder offline and renders chats with the folder's own chat template,
tools included, exactly as a server that calls ``apply_chat_template`` would.  Unlike the embedded ChatML renderer,
such a template renders the whole history in one piece, and BPE may merge tokens across a turn boundary, so a
turn's prompt is not always a token-level extension of the previous prompt + answer; replay marks those requests
(``drift_at``).  Tested with transformers 5.24.

Speed: a fast tokenizer cuts its input at added tokens (``<|im_start|>``, ``<tool_call>``) before normalising and
encoding each piece on its own, so the ids of a rendering are the ids of its pieces between added tokens.
``render_chat`` therefore renders the template to text, splits it there, and encodes only pieces it has not seen
(in one batch call), reusing the rest from a memo: a system prompt with its tool schemas, or an earlier message, is
encoded once per process however many turns repeat it.  This holds only where every added token is matched on the
raw text and strips nothing (checked at load; otherwise every rendering is tokenized whole).
"""

from __future__ import annotations

import functools
import json
import operator
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from prefixcache.chat.generic_tools import for_template
from prefixcache.chat.template import check_template_kwargs, validate_messages, validate_tools
from prefixcache.chat.tool_calls import call_arguments, call_name
from prefixcache.errors import InvalidArgumentError, InvalidTokensError, TemplateError

__all__ = ["BYTE_LEVEL_ALPHABET", "HFTokenizer"]

# Pieces remembered by render_chat before the memo is cleared (a bound on memory, not a tuning knob).
_MEMO_PIECES = 1 << 16


def _byte_level_alphabet() -> dict[str, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{chr(byte): byte for byte in printable}, **{chr(256 + n): byte for n, byte in enumerate(others)}}


BYTE_LEVEL_ALPHABET: Mapping[str, int] = _byte_level_alphabet()
"""The character a byte-level BPE vocabulary (GPT-2's, Qwen's, Llama 3's) writes for each byte -> that byte: GPT-2's
``bytes_to_unicode`` inverted (printable Latin-1 bytes stand for themselves, the other 68 for U+0100 onwards).
transformers keeps its copy in ``convert_slow_tokenizer``, whose import takes about a second."""

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class HFTokenizer:
    """A local Hugging Face tokenizer folder (``vocab.json`` + ``merges.txt``, or ``tokenizer.json``), or the tokenizer
    and chat template inside a ``.gguf`` file (read by transformers with the ``gguf`` package).

    ``name`` is ``<tokenizer class>:<folder name>:<xxh64>``, the hash covering the vocabulary (ids and strings) and
    the chat template, so a changed template or vocabulary never matches an old cache.  ``vocab_size`` counts added
    tokens too (``len(tokenizer)``).  ``eos_token_ids`` are the tokenizer's EOS plus those of a sibling
    ``generation_config.json`` (Qwen ends turns with ``<|im_end|>`` and documents with ``<|endoftext|>``).

    ``chat_template`` (Jinja source) replaces the folder's own template, or supplies one to a folder without it.

    Raises:
        InvalidArgumentError: ``path`` is neither a folder nor a ``.gguf`` file, a folder lacks the files that say
            which tokenizer it holds (named in the message, with the fix), or transformers cannot load a tokenizer
            from it.
        ImportError: transformers is not installed (the ``hf`` extra).
    """

    def __init__(self, path: str | os.PathLike[str], *, chat_template: str | None = None) -> None:
        folder = Path(path)
        gguf_file = folder.is_file() and folder.suffix == ".gguf"  # transformers' own test: lower case only
        if not folder.is_dir() and not gguf_file:
            raise InvalidArgumentError(f"tokenizer path {str(folder)!r} is not a folder or a .gguf file")
        if not gguf_file:
            _check_tokenizer_files(folder)
        from transformers import AutoTokenizer

        try:
            if gguf_file:
                # transformers rebuilds a fast tokenizer from the file's tokenizer.ggml.* fields, template included.
                self.tokenizer = AutoTokenizer.from_pretrained(
                    str(folder.parent), gguf_file=folder.name, local_files_only=True
                )
            else:
                self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as error:  # noqa: BLE001 - the tokenizers library raises bare Exception for broken files
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise InvalidArgumentError(f"cannot load a tokenizer from {str(folder)!r}: {first_line}") from None
        if chat_template is not None:
            if not isinstance(chat_template, str) or not chat_template.strip():
                raise InvalidArgumentError("chat_template must be non-empty Jinja source")
            self.tokenizer.chat_template = chat_template
        self.path = folder
        tok = self.tokenizer
        self._vocab_size = len(tok)
        self._added: dict[str, int] = dict(tok.get_added_vocab())
        eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        eos |= set() if gguf_file else _generation_config_eos(folder)
        self._eos = frozenset(int(t) for t in eos)
        template = tok.chat_template if isinstance(tok.chat_template, str) else json.dumps(tok.chat_template)
        digest = xxhash.xxh64()
        digest.update(f"{self._vocab_size}|{template}|".encode())
        digest.update(json.dumps(sorted(tok.get_vocab().items(), key=lambda kv: kv[1]), ensure_ascii=False).encode())
        self._name = f"{type(tok).__name__}:{folder.resolve().name}:{digest.hexdigest()}"
        self._splitter = _added_token_splitter(tok)
        self._memo: dict[str, list[int]] = {}
        self._added_content = {token_id: name for name, token_id in self._added.items()}
        self._decoders = _decoder_types(tok)

    @property
    def name(self) -> str:
        return self._name

    @property
    def has_chat_template(self) -> bool:
        """Whether :meth:`render_chat` has a template to render with (the folder's own or one given)."""
        return bool(self.tokenizer.chat_template)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no BOS/EOS added; ``"<|im_end|>"`` inside it is encoded as plain text.

        Raises :class:`InvalidArgumentError` if ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise InvalidArgumentError(f"encode expects str, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens spelled out.  O(len(ids)).

        Raises :class:`InvalidTokensError` for a non-integer id or one outside ``[0, vocab_size)``.
        """
        checked: list[int] = []
        for position, raw in enumerate(ids):
            try:
                token_id = operator.index(raw)
            except TypeError:
                raise InvalidTokensError(f"token at position {position} is not an integer: {raw!r}") from None
            if not 0 <= token_id < self._vocab_size:
                raise InvalidTokensError(
                    f"token id {token_id} at position {position} is outside [0, {self._vocab_size})"
                )
            checked.append(token_id)
        return self.tokenizer.decode(checked, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to decoded text, read from its vocabulary string: through
        :data:`BYTE_LEVEL_ALPHABET` for a byte-level BPE (Qwen2.5's id 26525, ``"\u0120\u00f0\u0178\u013a"``, is
        ``b" \xf0\x9f\x98"``, the space and first three bytes of an emoji); a byte-fallback piece ``<0xF0>`` is that
        byte and ``\u2581`` a space (SentencePiece: Llama 2, Mistral, whose decode drops the space that starts a
        text); an added token is its text in UTF-8.  Any other tokenizer gives ``decode([token_id])`` in UTF-8.
        O(length of the token).

        Raises :class:`InvalidTokensError` for a non-integer id or one outside ``[0, vocab_size)``.
        """
        try:
            token_id = operator.index(token_id)
        except TypeError:
            raise InvalidTokensError(f"token id is not an integer: {token_id!r}") from None
        if not 0 <= token_id < self._vocab_size:
            raise InvalidTokensError(f"token id {token_id} is outside [0, {self._vocab_size})")
        added = self._added_content.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if "ByteLevel" in self._decoders and all(char in BYTE_LEVEL_ALPHABET for char in piece):
                return bytes(BYTE_LEVEL_ALPHABET[char] for char in piece)
            byte = _BYTE_PIECE.fullmatch(piece) if "ByteFallback" in self._decoders else None
            if byte is not None:
                return bytes((int(byte[1], 16),))
            if self._decoders & {"Metaspace", "ByteFallback"} or "Replace" in self._decoders:
                return piece.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id]).encode("utf-8", "replace")

    def special_token_id(self, name: str) -> int:
        """Id of the added token spelled ``name`` (``"<|im_start|>"``, ``"<tool_call>"``).

        Raises :class:`InvalidArgumentError` naming the known added tokens.
        """
        token_id = self._added.get(name) if isinstance(name, str) else None
        if token_id is None:
            known = ", ".join(sorted(self._added, key=self._added.__getitem__)) or "none"
            raise InvalidArgumentError(f"unknown special token {name!r}; known: {known}")
        return token_id

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Ids of the tokenizer's own chat-template rendering of ``messages`` and ``tools``; ``template_kwargs`` are
        extra template variables, as ``apply_chat_template(**kwargs)`` takes them (Qwen3's ``enable_thinking``,
        gpt-oss's ``reasoning_effort``; a template that does not read one renders as without it).

        A template that does not render ``tools`` (SmolLM2's, Llama 2's) gets the chat rewritten by
        :func:`~prefixcache.chat.generic_tools.for_template`: the tools described in the system prompt, calls and tool
        results written as the model reads and writes them (probed once per template; a template that renders tools,
        or a chat without any, is rendered exactly as before).

        Cost: the whole history is rendered and tokenized, O(total characters).  Raises :class:`TemplateError` for
        invalid messages, tools or template variables (a reserved name:
        :data:`~prefixcache.chat.template.RESERVED_TEMPLATE_VARIABLES`), a tokenizer without a chat template, or an
        error raised by the template.
        """
        validate_messages(messages)
        validate_tools(tools)
        variables = check_template_kwargs(template_kwargs)
        if not self.tokenizer.chat_template:
            raise TemplateError(
                f"tokenizer {self._name} has no chat template (no chat_template in tokenizer_config.json, no "
                "chat_template.jinja); give one: HFTokenizer(path, chat_template=...) or --chat-template FILE"
            )
        from jinja2 import TemplateError as JinjaError

        template = self.tokenizer.chat_template
        shown, shown_tools = for_template(
            messages,
            tools,
            key=(self._name, template if isinstance(template, str) else repr(template)),
            render=functools.partial(_render_text, self.tokenizer),
        )
        try:
            rendered = self.tokenizer.apply_chat_template(
                [_template_message(m) for m in shown],
                tools=[dict(t) for t in shown_tools] if shown_tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=self._splitter is None,
                return_dict=False,
                **variables,
            )
        except (JinjaError, ValueError, TypeError) as error:
            _require_unicode(messages, tools)  # the likely cause of a TypeError, named (checked on failure only)
            raise TemplateError(f"chat template of {self._name} failed: {error}") from None
        if self._splitter is None:
            return [int(t) for t in rendered]
        try:
            return self._encode_pieces(rendered)
        except TypeError:
            _require_unicode(messages, tools)
            raise

    def _encode_pieces(self, text: str) -> list[int]:
        """Ids of ``text`` as the tokenizer gives them (``add_special_tokens=False``), from memoised pieces."""
        assert self._splitter is not None
        pieces = self._splitter.split(text)  # odd indices are added tokens
        memo = self._memo
        missing = list({p for p in pieces[::2] if p and p not in memo})
        if missing:
            if len(memo) + len(missing) > _MEMO_PIECES:
                memo.clear()
            encoded = self.tokenizer(missing, add_special_tokens=False)["input_ids"]
            memo.update(zip(missing, ([int(t) for t in ids] for ids in encoded), strict=True))
        ids: list[int] = []
        for index, piece in enumerate(pieces):
            if index % 2:
                ids.append(self._added[piece])
            elif piece:
                ids.extend(memo[piece])
        return ids

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def _decoder_types(tok: Any) -> frozenset[str]:
    """The ``type`` of the fast tokenizer's decoder and of each decoder in it (``{"ByteLevel"}``, ``{"Sequence",
    "Replace", "ByteFallback", "Fuse", "Strip"}``); empty for a tokenizer without one."""
    decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
    try:
        state = json.loads(decoder.__getstate__()) if decoder is not None else {}
    except (AttributeError, TypeError, ValueError):
        return frozenset()
    types, stack = set(), [state]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            types.add(node.get("type"))
            stack.extend(node.get("decoders") or ())
    return frozenset(t for t in types if isinstance(t, str))


def _render_text(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The template's text for a probe chat (:func:`~prefixcache.chat.generic_tools.probe_template`); may raise."""
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=False, tokenize=False)


def _require_unicode(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> None:
    """Refuse a lone surrogate (``"\\ud800"`` is valid JSON, not Unicode text): the Rust tokenizers cannot take it
    and fail with a TypeError naming no message, after which this names it.  O(characters), so it runs only then.
    The byte tokenizer encodes it (surrogatepass) instead.

    Raises :class:`TemplateError` naming the message (or the tools) and the character.
    """
    parts = [(f"message {index} ({m.get('role')})", m) for index, m in enumerate(messages)]
    for where, value in [*parts, ("tools", tools)]:
        try:
            json.dumps(value, ensure_ascii=False, default=str).encode("utf-8")
        except UnicodeEncodeError as error:
            raise TemplateError(
                f"{where} holds a lone surrogate {error.object[error.start]!r}, which is not Unicode text; "
                "a Hugging Face tokenizer cannot encode it"
            ) from None


def _check_tokenizer_files(folder: Path) -> None:
    """Refuse a folder transformers could only fail on with a long, misleading message: one without vocabulary
    files, or with ``vocab.json`` + ``merges.txt`` but nothing saying which tokenizer class reads them."""
    has = {name: (folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "config.json")}
    bpe = (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()
    sentencepiece = any(folder.glob("*.model"))
    if not (has["tokenizer.json"] or bpe or sentencepiece):
        raise InvalidArgumentError(
            f"{str(folder)!r} holds no tokenizer: expected tokenizer.json, or vocab.json + merges.txt, or a "
            "sentencepiece *.model; copy the tokenizer files of the model into it"
        )
    if not (has["tokenizer.json"] or has["tokenizer_config.json"] or has["config.json"]):
        raise InvalidArgumentError(
            f"{str(folder)!r} has vocab files but no tokenizer_config.json (nor tokenizer.json or config.json) saying "
            "which tokenizer reads them; copy the model's tokenizer_config.json into it (it also holds the chat "
            'template), or write one such as {"tokenizer_class": "Qwen2Tokenizer"}'
        )


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """``message`` as Hugging Face templates expect it: a tool call's ``arguments`` as an object, not OpenAI's JSON
    string (``tojson`` would otherwise write the string quoted), so the rendering matches what the model generates."""
    out = dict(message)
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                **{k: v for k, v in call.items() if k != "function"},
                "type": "function",
                "function": {"name": call_name(call), "arguments": call_arguments(call)},
            }
            for call in message["tool_calls"]
        ]
    return out


def _added_token_splitter(tok: Any) -> re.Pattern[str] | None:
    """A pattern that splits text at the tokenizer's added tokens (captured, longest first, as the tokenizer's own
    leftmost-longest match), or None where pieces cannot be encoded apart (a slow tokenizer, or an added token that
    strips neighbouring spaces, matches single words only, or is matched after normalisation)."""
    added = getattr(tok, "added_tokens_decoder", None)
    if not getattr(tok, "is_fast", False) or not added:
        return None
    for token in added.values():
        if token.lstrip or token.rstrip or token.single_word or token.normalized:
            return None
    contents = sorted({token.content for token in added.values()}, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(c) for c in contents) + ")")


def _generation_config_eos(folder: Path) -> set[int]:
    """EOS ids listed in ``folder/generation_config.json`` (an int or a list), or none."""
    config = folder / "generation_config.json"
    if not config.is_file():
        return set()
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return set()
    if isinstance(eos, int):
        return {eos}
    return {t for t in eos if isinstance(t, int)} if isinstance(eos, list) else set()
