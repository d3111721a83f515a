"""``Tokenizer.token_bytes``: the bytes a token adds to decoded text, whole or part of a character, so that the bytes
of a text's ids, joined, are its UTF-8."""

from __future__ import annotations

import pytest

from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.errors import InvalidTokensError

SPLIT = "Zürich ✓ 😊 naïve ok, 東京"


def test_a_byte_tokenizer_id_is_its_byte_and_a_special_its_name() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.token_bytes(0xF0) == b"\xf0" and tokenizer.token_bytes(65) == b"A"
    assert tokenizer.token_bytes(258) == b"<|im_end|>"
    assert b"".join(map(tokenizer.token_bytes, tokenizer.encode(SPLIT))) == SPLIT.encode("utf-8")
    for bad in (259, -1, "1"):
        with pytest.raises(InvalidTokensError):
            tokenizer.token_bytes(bad)


def test_qwen_tokens_that_split_an_emoji_hold_its_own_bytes(qwen_dir) -> None:
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    qwen = HFTokenizer(qwen_dir)
    assert qwen.token_bytes(26525) == b" \xf0\x9f\x98" and qwen.token_bytes(232) == b"\x8a"
    assert qwen.token_bytes(qwen.special_token_id("<|im_end|>")) == b"<|im_end|>"
    assert qwen.token_bytes(qwen.special_token_id("<tool_call>")) == b"<tool_call>"
    assert b"".join(map(qwen.token_bytes, qwen.encode(SPLIT))) == SPLIT.encode("utf-8")
    # every 50th id of the vocabulary: its bytes decode (U+FFFD for a part of a character) as the id decodes alone
    for token_id in range(0, qwen.vocab_size, 50):
        assert qwen.token_bytes(token_id).decode("utf-8", "replace") == qwen.decode([token_id]), token_id
    with pytest.raises(InvalidTokensError):
        qwen.token_bytes(qwen.vocab_size)


def test_a_trained_byte_level_bpe_joins_back_to_the_text(byte_bpe_dir) -> None:
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    tokenizer = HFTokenizer(byte_bpe_dir)
    ids = tokenizer.encode(SPLIT)
    assert any(tokenizer.decode([token_id]) == "\ufffd" for token_id in ids)  # characters split across tokens
    assert b"".join(map(tokenizer.token_bytes, ids)) == SPLIT.encode("utf-8")


def test_sentencepiece_byte_fallback_pieces_are_their_bytes_and_the_word_marker_a_space(sentencepiece_dir) -> None:
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    tokenizer = HFTokenizer(sentencepiece_dir)
    ids = tokenizer.encode(SPLIT)
    emoji = [token_id for token_id in ids if tokenizer.tokenizer.convert_ids_to_tokens(token_id) == "<0xF0>"]
    assert emoji and tokenizer.token_bytes(emoji[0]) == b"\xf0"
    # the normalizer writes a word marker before the text, which the decoder drops again: the bytes keep it
    assert b"".join(map(tokenizer.token_bytes, ids)) == b" " + SPLIT.encode("utf-8")
    assert tokenizer.decode(ids) == SPLIT
