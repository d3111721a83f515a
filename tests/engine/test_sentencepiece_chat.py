"""Chat text through a SentencePiece-style tokenizer (Llama 2 / Mistral: its decoder strips the leading space of a
decode): the text of ChatDecoder, runner.chat and a streamed completion is the tokenizer's decode of the answer,
spaces included, and a stop string with a space in it ends the answer before it."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner
from prefixcache.chat.hf_tokenizer import HFTokenizer
from prefixcache.engine.chat import chat_stream, completion_stream
from prefixcache.engine.chat_decoder import ChatDecoder
from prefixcache.engine.results import GenerationResult, Usage
from prefixcache.engine.sampling import SamplingParams
from prefixcache.testing import ScriptedModel, assert_quiescent

HELLO = "Hello world, how are you?"
ASK = [{"role": "user", "content": "Say hello."}]
USAGE = Usage(
    prompt_tokens=1, cached_tokens=0, prefilled_tokens=1, copied_tokens=0, generated_tokens=0, ttft_s=0.0, decode_s=0.0
)
WORDS = ["Hello", "world,", "how", "are", "you?", "🙂", "日本", "naïve", "\n", "Observation:", "fox"]


@pytest.fixture(scope="module")
def sentencepiece(sentencepiece_dir: Path) -> HFTokenizer:
    return HFTokenizer(sentencepiece_dir)


def decoded(tokenizer: HFTokenizer, ids: list[int], stops: tuple[str, ...] = ()) -> tuple[list[str], str]:
    params = SamplingParams(stop_token_ids=tokenizer.eos_token_ids, vocab_limit=tokenizer.vocab_size)
    decoder = ChatDecoder(tokenizer, stops, params)
    pieces = []
    for token in ids:
        pieces.append(decoder.feed(token))
        if decoder.stopped:
            break
    rest, done = decoder.finish(GenerationResult(tuple(ids), "length", USAGE))
    assert done.content == "".join(pieces) + rest
    return [*pieces, rest], done.content or ""


@settings(max_examples=40, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), max_size=12))
def test_chat_decoder_text_is_the_decode_of_the_answer(sentencepiece: HFTokenizer, words: list[str]) -> None:
    ids = sentencepiece.encode(" ".join(words))
    assert decoded(sentencepiece, ids)[1] == sentencepiece.decode(ids)


def test_a_stop_string_with_spaces_ends_the_text_before_it(sentencepiece: HFTokenizer) -> None:
    pieces, content = decoded(sentencepiece, sentencepiece.encode(HELLO), stops=("how are",))
    assert content == "".join(pieces) == "Hello world, "


def test_runner_chat_returns_the_answer_with_its_spaces(sentencepiece: HFTokenizer) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts([HELLO], sentencepiece), sentencepiece, cache_tokens=1024)
    result = runner.chat(ASK, max_new_tokens=64)
    assert (result.text, result.finish_reason) == (HELLO, "stop")
    steps = chat_stream(runner, ASK, max_new_tokens=64)
    pieces = []
    try:
        while True:
            pieces.append(next(steps))
    except StopIteration as done:
        assert done.value.content == HELLO
    assert len(pieces) > 3 and "".join(pieces) == HELLO
    assert_quiescent(runner.cache)


def test_a_streamed_completion_keeps_its_spaces_and_stops_at_a_spaced_stop_string(sentencepiece: HFTokenizer) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts([HELLO], sentencepiece), sentencepiece, cache_tokens=1024)
    prompt = sentencepiece.render_chat(ASK)
    for stop, expected in [(None, HELLO), ("how are", "Hello world, ")]:
        steps = completion_stream(runner, prompt, stop=stop, max_new_tokens=64)
        pieces = []
        try:
            while True:
                pieces.append(next(steps))
        except StopIteration as done:
            assert (done.value.content, done.value.finish_reason) == (expected, "stop")
        assert "".join(pieces) == expected
    assert_quiescent(runner.cache)
