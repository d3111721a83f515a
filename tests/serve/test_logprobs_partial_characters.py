"""Logprobs of tokens that hold part of a character, through the real server and the ``openai`` client, on the
Qwen2.5 tokenizer (byte-level BPE): each token's ``bytes`` are its own, so joined they are the answer's UTF-8; the
legacy ``top_logprobs`` keep ``k`` entries when alternatives decode alike; ``text_offset`` counts the characters of
the returned text.  The model is scripted to write "Zürich ✓ 😊 naïve ok" with its accented letters and its check mark
one byte per token and its emoji as Qwen's tokens 26525 (a space and three bytes) and 232 (the fourth byte)."""

from __future__ import annotations

import openai
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.serve import start_background
from prefixcache.testing import ScriptedModel, assert_quiescent

TEXT = "Zürich ✓ 😊 naïve ok"
# Z, ü as 2 bytes, rich, space, ✓ as 3 bytes, " " + 3 bytes of 😊, its last byte, " na", ï as 2 bytes, ve, " ok"
ANSWER = [57, 127, 120, 13851, 220, 158, 250, 241, 26525, 232, 4317, 127, 107, 586, 5394]
OFFSETS = [0, 1, 1, 2, 6, 7, 7, 7, 8, 9, 10, 13, 13, 14, 16]
RUNNER_UPS = [222, 223, 224, 225, 226]  # the bytes 0x80..0x84: each decodes alone to U+FFFD
MARKER = [151644, 77091, 198]  # <|im_start|>assistant\n
QUESTION = [{"role": "user", "content": "Where?"}]


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    return HFTokenizer(qwen_dir)


@pytest.fixture
def served(qwen, make_app):
    model = ScriptedModel(
        [ANSWER] * 8, turn_marker=MARKER, end_token_id=151645, vocab_size=qwen.vocab_size, runner_up_ids=RUNNER_UPS
    )
    runner = PrefixCachingRunner(model, qwen, cache_tokens=4096)
    with start_background(make_app(runner), "127.0.0.1", 0) as server:
        yield runner, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    assert_quiescent(runner.cache)


def test_the_script_is_the_text_and_its_tokens_split_characters(qwen) -> None:
    assert qwen.decode(ANSWER) == TEXT and len(TEXT) == 19
    assert qwen.decode([26525]) == " \ufffd" and qwen.token_bytes(26525) == b" \xf0\x9f\x98"
    assert {qwen.decode([token_id]) for token_id in RUNNER_UPS} == {"\ufffd"}


def test_chat_logprobs_bytes_are_each_tokens_own_and_join_to_the_answer(served) -> None:
    _, client = served
    answer = client.chat.completions.create(
        model="scripted", messages=QUESTION, max_tokens=40, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    assert answer.choices[0].message.content == TEXT
    assert b"".join(bytes(entry.bytes) for entry in content) == TEXT.encode("utf-8")
    emoji = content[ANSWER.index(26525)]
    assert emoji.token == " \ufffd" and emoji.bytes == [32, 240, 159, 152]  # not the replacement's [32, 239, 191, 189]
    assert content[1].token == "\ufffd" and content[1].bytes == [0xC3]
    for entry in content:
        assert [alternative.bytes for alternative in entry.top_logprobs[1:]] == [[0x80], [0x81]]


def test_legacy_top_logprobs_keep_k_entries_when_alternatives_decode_alike(served) -> None:
    _, client = served
    whole = client.completions.create(model="scripted", prompt=MARKER, max_tokens=40, logprobs=5)
    tops = whole.choices[0].logprobs.top_logprobs
    assert whole.choices[0].text == TEXT
    assert [len(top) for top in tops] == [5] * len(ANSWER)
    assert list(tops[0]) == ["Z", "\ufffd", "token_id:223", "token_id:224", "token_id:225"]
    # the sampled byte of ü decodes to U+FFFD too: it keeps the plain string, every alternative its id
    assert list(tops[1]) == ["\ufffd", "token_id:222", "token_id:223", "token_id:224", "token_id:225"]
    assert tops[0]["Z"] > tops[0]["\ufffd"] > tops[0]["token_id:223"]


def test_text_offsets_count_characters_of_the_returned_text_whole_and_streamed(served, qwen) -> None:
    _, client = served
    whole = client.completions.create(model="scripted", prompt=MARKER, max_tokens=40, logprobs=1)
    chunks = list(client.completions.create(model="scripted", prompt=MARKER, max_tokens=40, logprobs=1, stream=True))
    offsets = whole.choices[0].logprobs.text_offset
    assert offsets == OFFSETS and max(offsets) < len(whole.choices[0].text) == len(TEXT)
    for i, offset in enumerate(offsets):  # the characters the tokens before i complete, and no more
        before = b"".join(qwen.token_bytes(token_id) for token_id in ANSWER[:i])
        done = TEXT[:offset].encode("utf-8")
        assert before.startswith(done) and len(before) - len(done) < len(TEXT[offset].encode("utf-8"))
    pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [offset for piece in pieces for offset in piece.text_offset] == OFFSETS
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT


def test_echoed_prompt_offsets_count_its_characters_and_the_answer_goes_on_from_them(served) -> None:
    _, client = served
    prompt = [127, 120, *MARKER]  # ü split in two bytes, then the generation prompt
    echoed = client.completions.create(model="scripted", prompt=prompt, max_tokens=40, logprobs=1, echo=True)
    text = echoed.choices[0].text
    head = "ü<|im_start|>assistant\n"
    assert text == head + TEXT
    assert echoed.choices[0].logprobs.text_offset == [0, 0, 1, 13, 22] + [len(head) + o for o in OFFSETS]
