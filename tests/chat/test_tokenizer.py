from __future__ import annotations

from array import array

import pytest
import torch

from prefixcache.chat.tokenizer import BYTE_SPECIAL_TOKENS, ByteTokenizer, Tokenizer
from prefixcache.errors import InvalidArgumentError, InvalidTokensError, PrefixCacheError, TemplateError

TEXTS = [
    "",
    "hello world",
    "naïve café, Größe, ĳ, Ωμέγα",
    "日本語のテキストと中文",
    "emoji 🙂👍🏽 and family 👨‍👩‍👧 and flag 🇫🇷",
    "tabs\tand\nnewlines\r\n",
    "\x00 nul and \u200b zero-width",
]


@pytest.fixture
def tok() -> ByteTokenizer:
    return ByteTokenizer()


def test_byte_tokenizer_satisfies_the_protocol(tok: ByteTokenizer) -> None:
    assert isinstance(tok, Tokenizer)
    assert tok.name and isinstance(tok.name, str)
    assert tok.vocab_size == 259


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trips(tok: ByteTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_encode_is_prefix_stable(tok: ByteTokenizer) -> None:
    a, b = "prefix 🙂", "suffix ü"
    assert tok.encode(a + b) == tok.encode(a) + tok.encode(b)


def test_emoji_takes_four_byte_ids(tok: ByteTokenizer) -> None:
    assert tok.encode("🙂") == [0xF0, 0x9F, 0x99, 0x82]


def test_special_token_ids(tok: ByteTokenizer) -> None:
    assert tok.special_token_id("<|endoftext|>") == 256
    assert tok.special_token_id("<|im_start|>") == 257
    assert tok.special_token_id("<|im_end|>") == 258
    assert dict(BYTE_SPECIAL_TOKENS) == {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
    assert tok.eos_token_ids == frozenset({256, 258})


def test_unknown_special_token_raises(tok: ByteTokenizer) -> None:
    with pytest.raises(InvalidArgumentError, match="<\\|im_start\\|>"):
        tok.special_token_id("<|bos|>")


def test_special_strings_in_text_are_encoded_as_plain_text(tok: ByteTokenizer) -> None:
    ids = tok.encode("a<|im_end|>b")
    assert 258 not in ids
    assert len(ids) == len("a<|im_end|>b")


def test_specials_decode_to_their_names(tok: ByteTokenizer) -> None:
    ids = [257, *tok.encode("user\nhé"), 258]
    assert tok.decode(ids) == "<|im_start|>user\nhé<|im_end|>"


def test_partial_utf8_decodes_with_replacement(tok: ByteTokenizer) -> None:
    ids = tok.encode("🙂")
    assert tok.decode(ids[:2]) == "\ufffd"
    # A special in the middle of a character must not glue the halves together.
    assert tok.decode([*ids[:2], 258, *ids[2:]]) == "\ufffd<|im_end|>\ufffd\ufffd"


def test_decode_accepts_arrays_and_tensors(tok: ByteTokenizer) -> None:
    ids = tok.encode("héllo") + [258]
    assert tok.decode(array("i", ids)) == "héllo<|im_end|>"
    assert tok.decode(torch.tensor(ids)) == "héllo<|im_end|>"


@pytest.mark.parametrize("bad", [[259], [104, 1000], [-1], [1.5], ["a"]])
def test_decode_rejects_bad_ids(tok: ByteTokenizer, bad: list[object]) -> None:
    with pytest.raises(InvalidTokensError):
        tok.decode(bad)  # type: ignore[arg-type]


def test_errors_share_the_package_base(tok: ByteTokenizer) -> None:
    with pytest.raises(PrefixCacheError):
        tok.decode([259])
    with pytest.raises(InvalidArgumentError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_render_chat_uses_special_ids_and_byte_text(tok: ByteTokenizer) -> None:
    ids = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert ids == [257, *b"user\nHi", 258, *b"\n", 257, *b"assistant\n"]


def test_render_chat_keeps_user_typed_specials_as_text(tok: ByteTokenizer) -> None:
    ids = tok.render_chat([{"role": "user", "content": "<|im_end|>"}], add_generation_prompt=False)
    assert ids.count(258) == 1


def test_render_chat_validates(tok: ByteTokenizer) -> None:
    with pytest.raises(TemplateError):
        tok.render_chat([{"role": "robot", "content": "x"}])


def test_instances_are_interchangeable() -> None:
    assert ByteTokenizer() == ByteTokenizer()
    assert hash(ByteTokenizer()) == hash(ByteTokenizer())


def test_a_long_text_is_encoded_in_pieces_to_the_same_ids(tok: ByteTokenizer) -> None:
    text = "é🙂a" * 200_000  # 1.4 MB: pieces of 256 KiB split characters, which bytes do not mind
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text
