"""Logprobs over a real socket with the ``openai`` client: ``logprobs`` + ``top_logprobs`` on /v1/chat/completions and
``logprobs: k`` on /v1/completions, whole and streamed, carry the in-process engine's records (one entry per
generated token that is not a stop token, each token's string its id decoded alone, ``bytes`` the token's own, the
legacy ``top_logprobs`` keyed distinctly, ``text_offset`` in characters of the text); the chunks of a stream add up to
the whole answer's entries; a bad value is a 400 naming it, the cache untouched."""

from __future__ import annotations

import codecs

import httpx
import openai
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.engine.chat import complete_text
from prefixcache.models.llama import build_model
from prefixcache.serve import start_background
from prefixcache.testing import ScriptedModel, assert_quiescent, snapshot

QUESTION = [
    {"role": "system", "content": "You answer about the weather, briefly. " * 4},
    {"role": "user", "content": "Weather in Paris?"},
]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny_model():
    return build_model("tiny", device="cpu")


def assert_entry(entry, token_id: int, logprob: float, tokenizer) -> None:
    assert entry.token == tokenizer.decode([token_id])
    assert entry.bytes == list(tokenizer.token_bytes(token_id))  # a byte id's own byte, not U+FFFD's three
    assert abs(entry.logprob - logprob) <= TOLERANCE


def assert_chat_logprobs(content, records, tokenizer, k: int) -> None:
    assert len(content) == len(records)
    for entry, record in zip(content, records, strict=True):
        assert_entry(entry, record.token_id, record.logprob, tokenizer)
        assert len(entry.top_logprobs) == k
        for alternative, (token_id, logprob) in zip(entry.top_logprobs, record.top[:k], strict=True):
            assert_entry(alternative, token_id, logprob, tokenizer)


def test_chat_logprobs_whole_and_streamed_are_the_engines(make_app, tiny_model) -> None:
    reference = PrefixCachingRunner(tiny_model, cache_tokens=4096)
    expected = reference.chat(QUESTION, max_new_tokens=12, logprobs=3)
    tokenizer = reference.tokenizer
    runner = PrefixCachingRunner(tiny_model, cache_tokens=4096)
    with start_background(make_app(runner, model_name="tiny"), "127.0.0.1", 0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        ask = dict(model="tiny", messages=QUESTION, max_tokens=12, logprobs=True)
        answer = client.chat.completions.create(**ask, top_logprobs=3)
        chunks = list(client.chat.completions.create(**ask, top_logprobs=3, stream=True))
        plain = client.chat.completions.create(**ask)
        without = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=12)
    assert answer.choices[0].message.content == expected.text
    assert_chat_logprobs(answer.choices[0].logprobs.content, expected.logprobs, tokenizer, 3)
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert sum(1 for c in chunks if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content) > 1
    assert_chat_logprobs(streamed, expected.logprobs, tokenizer, 3)
    assert_chat_logprobs(plain.choices[0].logprobs.content, expected.logprobs, tokenizer, 0)
    assert without.choices[0].logprobs is None
    assert_quiescent(runner.cache)


def test_completion_logprobs_whole_and_streamed_are_the_engines(make_app, tiny_model) -> None:
    reference = PrefixCachingRunner(tiny_model, cache_tokens=4096)
    prompt = reference.tokenizer.encode("The weather in Paris is")
    expected = complete_text(reference, prompt, max_new_tokens=10, logprobs=2)
    decode = reference.tokenizer.decode
    runner = PrefixCachingRunner(tiny_model, cache_tokens=4096)
    with start_background(make_app(runner, model_name="tiny"), "127.0.0.1", 0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, logprobs=2)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=10, logprobs=2, stream=True))
    logprobs = whole.choices[0].logprobs
    strings = [decode([r.token_id]) for r in expected.logprobs]
    assert whole.choices[0].text == expected.content
    assert logprobs.tokens == strings
    assert all(abs(a - r.logprob) <= TOLERANCE for a, r in zip(logprobs.token_logprobs, expected.logprobs, strict=True))
    for top, record in zip(logprobs.top_logprobs, expected.logprobs, strict=True):
        wanted = {decode([record.token_id]): record.logprob}  # the sampled token keeps its string
        for token_id, logprob in record.top:
            if token_id != record.token_id:
                key = decode([token_id])
                wanted[f"token_id:{token_id}" if key in wanted else key] = logprob
        assert len(top) == len({record.token_id, *(token_id for token_id, _ in record.top)})
        assert top.keys() == wanted.keys()
        assert all(abs(top[key] - wanted[key]) <= TOLERANCE for key in wanted)
    # the characters the bytes of the tokens before each one complete (a byte id holding part of one adds 0)
    own = [reference.tokenizer.token_bytes(r.token_id) for r in expected.logprobs]
    completed = [
        len(codecs.getincrementaldecoder("utf-8")("replace").decode(b"".join(own[:i]))) for i in range(len(own))
    ]
    assert logprobs.text_offset == completed and max(completed) < len(expected.content)
    pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == logprobs.tokens
    assert [t for p in pieces for t in p.text_offset] == logprobs.text_offset
    streamed = [t for p in pieces for t in p.token_logprobs]
    assert all(abs(a - b) <= TOLERANCE for a, b in zip(streamed, logprobs.token_logprobs, strict=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.content
    assert_quiescent(runner.cache)


BAD = [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"logprobs": 1.5}, "logprobs"),
    ("completions", {"echo": "yes", "logprobs": 1}, "echo"),
    ("chat", {"echo": True}, "echo"),
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options"),
]


def test_bad_logprobs_values_are_400_naming_them_and_touch_nothing(make_app, tiny_model) -> None:
    runner = PrefixCachingRunner(tiny_model, cache_tokens=4096)
    runner.chat(QUESTION, max_new_tokens=2)
    before = snapshot(runner.cache, [runner.namespace_key(None)])
    with start_background(make_app(runner, model_name="tiny"), "127.0.0.1", 0) as server:
        for endpoint, fields, param in BAD:
            body = {"model": "tiny", "max_tokens": 4, **fields}
            body.update({"messages": QUESTION} if endpoint == "chat" else {"prompt": "The weather"})
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            response = httpx.post(server.url + path, json=body, timeout=30)
            assert response.status_code == 400, (fields, response.text)
            assert response.json()["error"]["param"] == param, fields
    assert snapshot(runner.cache, [runner.namespace_key(None)]) == before
    assert_quiescent(runner.cache)


def test_logprobs_false_with_top_logprobs_0_asks_for_none_as_vllm_accepts_it(make_app, tiny_model) -> None:
    runner = PrefixCachingRunner(tiny_model, cache_tokens=4096)
    with start_background(make_app(runner, model_name="tiny"), "127.0.0.1", 0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        ask = dict(model="tiny", messages=QUESTION, max_tokens=3)
        off = client.chat.completions.create(**ask, logprobs=False, top_logprobs=0)
        zero = client.chat.completions.create(**ask, top_logprobs=0)
        on = client.chat.completions.create(**ask, logprobs=True, top_logprobs=0)
    assert off.choices[0].logprobs is None and zero.choices[0].logprobs is None
    assert off.choices[0].message.content == on.choices[0].message.content
    assert [entry.top_logprobs for entry in on.choices[0].logprobs.content] == [[]] * 3
    assert_quiescent(runner.cache)


def test_the_entries_of_text_a_stop_string_held_back_come_on_the_finishing_chunk(make_app) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["hello there"]), cache_tokens=4096)
    with start_background(make_app(runner), "127.0.0.1", 0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        ask = dict(model="scripted", messages=QUESTION, max_tokens=20, logprobs=True, stop=["llo"])
        whole = client.chat.completions.create(**ask)
        chunks = [c for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    assert whole.choices[0].message.content == "he"
    assert [e.token for e in whole.choices[0].logprobs.content] == list("hello")
    assert [(c.choices[0].delta.content, c.choices[0].finish_reason) for c in chunks] == [
        ("", None),
        ("h", None),
        ("e", None),
        (None, "stop"),
    ]
    assert [[e.token for e in c.choices[0].logprobs.content] for c in chunks[1:]] == [["h"], ["e"], ["l", "l", "o"]]
    assert chunks[0].choices[0].logprobs is None
    assert_quiescent(runner.cache)
