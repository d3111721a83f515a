"""TextStream over real tokenizer families: a SentencePiece-style one (Llama 2 / Mistral: Metaspace, byte fallback,
a decoder that strips the leading space of a decode), a byte-level BPE one (GPT-2 / Qwen) and the byte tokenizer.
Whatever the text, the streamed deltas add up to the tokenizer's decode of all the ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.chat.hf_tokenizer import HFTokenizer
from prefixcache.chat.stop import StopMatcher, TextStream
from prefixcache.chat.tokenizer import ByteTokenizer, Tokenizer

HELLO = "Hello world, how are you?"
WORDS = ["Hello", "world", ",", " ", "  ", "how", "are", "you", "?", "\n", "🙂", "日本", "naïve", "€", "fox", "x", "!"]


@pytest.fixture(scope="module", params=["sentencepiece", "byte_bpe", "bytes"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    if request.param == "bytes":
        return ByteTokenizer()
    folder: Path = request.getfixturevalue(f"{request.param}_dir")
    return HFTokenizer(folder)


@pytest.fixture(scope="module")
def sentencepiece(sentencepiece_dir: Path) -> HFTokenizer:
    return HFTokenizer(sentencepiece_dir)


def streamed(tokenizer: Tokenizer, ids: list[int], skip: frozenset[int] = frozenset()) -> list[str]:
    stream = TextStream(tokenizer, skip=skip)
    return [stream.push(token) for token in ids] + [stream.flush()]


def test_sentencepiece_stream_keeps_the_space_before_every_word(sentencepiece: HFTokenizer) -> None:
    # The decoder strips the leading space of a decode, so decoding each word's id alone used to give
    # "Helloworld,howareyou?".
    ids = sentencepiece.encode(HELLO)
    assert len(ids) > 3
    assert "".join(streamed(sentencepiece, ids)) == sentencepiece.decode(ids) == HELLO


def test_sentencepiece_byte_fallback_characters_are_never_emitted_in_halves(sentencepiece: HFTokenizer) -> None:
    text = "Hello 🙂 日本 naïve world"
    ids = sentencepiece.encode(text)
    assert len(ids) > len(text.split()) + 8  # the emoji, the CJK and the "ï" are byte tokens
    pieces = streamed(sentencepiece, ids)
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == text


def test_the_end_of_turn_id_makes_no_text(sentencepiece: HFTokenizer) -> None:
    end = sentencepiece.special_token_id("<|im_end|>")
    pieces = streamed(sentencepiece, [*sentencepiece.encode(HELLO), end], skip=frozenset({end}))
    assert pieces[-2:] == ["", ""]
    assert "".join(pieces) == HELLO


@settings(max_examples=40, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), max_size=14), spaced=st.booleans())
def test_the_deltas_add_up_to_decoding_all_the_ids(tokenizer: Tokenizer, words: list[str], spaced: bool) -> None:
    ids = tokenizer.encode((" " if spaced else "").join(words))
    assert "".join(streamed(tokenizer, ids)) == tokenizer.decode(ids)


@pytest.mark.parametrize("tokenizer", ["byte_bpe", "bytes"], indirect=True)
@settings(max_examples=40, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), max_size=14), cut=st.integers(0, 3))
def test_an_answer_cut_inside_a_character_still_adds_up_where_decoding_is_local(
    tokenizer: Tokenizer, words: list[str], cut: int
) -> None:
    # max_tokens may end an answer inside a multi-byte character.  Byte-level decoders render the cut character
    # alone as U+FFFD.  Not so Hugging Face's ByteFallback, which turns the whole run of byte tokens into U+FFFD
    # (the test below).
    ids = tokenizer.encode(" ".join(words))
    ids = ids[: max(0, len(ids) - cut)]
    assert "".join(streamed(tokenizer, ids)) == tokenizer.decode(ids)


def test_a_stop_string_with_spaces_matches_across_sentencepiece_tokens(sentencepiece: HFTokenizer) -> None:
    stream, matcher = TextStream(sentencepiece), StopMatcher(("how are",))
    emitted = []
    for token in sentencepiece.encode(HELLO):
        emitted.append(matcher.feed(stream.push(token)))
        if matcher.stopped:
            break
    assert matcher.stopped
    assert "".join(emitted) == "Hello world, "


def test_the_cost_per_token_stays_bounded_on_a_long_answer(sentencepiece: HFTokenizer) -> None:
    # Each push decodes a short window of ids, not the whole answer so far.
    calls: list[int] = []
    decode = sentencepiece.decode

    class Counting:
        def decode(self, ids: list[int]) -> str:
            ids = list(ids)
            calls.append(len(ids))
            return decode(ids)

    ids = sentencepiece.encode(" ".join([HELLO, "日本 🙂"] * 60))
    pieces = streamed(Counting(), ids)  # type: ignore[arg-type]
    assert "".join(pieces) == sentencepiece.decode(ids)
    assert max(calls) <= 16


def test_a_sentencepiece_answer_cut_inside_a_character_keeps_the_complete_ones(sentencepiece: HFTokenizer) -> None:
    # ByteFallback renders a run of byte tokens with an invalid byte in it as one U+FFFD per byte, so decoding
    # "日本" cut after 4 of its 6 byte tokens gives 4 x U+FFFD: "日" was complete, and was streamed, when its third
    # byte came; the stream then gives what a UTF-8 decoder gives for the rest.
    ids = sentencepiece.encode("Hello 日本")[:-2]
    assert sentencepiece.decode(ids) == "Hello " + "\ufffd" * 4
    assert "".join(streamed(sentencepiece, ids)) == "Hello 日\ufffd"
