"""``n`` > 1 on /v1/chat/completions and /v1/completions, over a real socket with the ``openai`` client: n choices,
choice i exactly what a request of seed ``seed + i`` answers alone, the prompt prefilled once (the other samples find it
cached), the usage counting the prompt once; streamed, each chunk names its choice's ``index`` and each choice's text is
the non-streamed one's, the usage at the end summed; ``n`` out of range is a 400."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import openai
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.serve import start_background
from prefixcache.testing import ScriptedModel, assert_quiescent

SYSTEM = {"role": "system", "content": "You answer about the weather, briefly and kindly. " * 6}
MESSAGES = [SYSTEM, {"role": "user", "content": "Weather in Paris?"}]


def test_n_chat_choices_are_the_answers_of_their_own_seeds_and_share_one_prefill(
    served_tiny, make_app, tiny_model
) -> None:
    runner, _, client = served_tiny
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, n=4, seed=11, temperature=1.0, max_tokens=10)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    prompt_tokens = out.usage.prompt_tokens
    # The first sample prefilled the prompt; the three others found all of it but its last token cached.
    assert runner.cache.stats().hit_tokens == 3 * (prompt_tokens - 1)
    alone = PrefixCachingRunner(tiny_model, cache_tokens=8192)
    with start_background(make_app(alone, model_name="tiny"), "127.0.0.1", 0) as other:
        single = openai.OpenAI(base_url=other.url + "/v1", api_key="none", max_retries=0)
        answers = [
            single.chat.completions.create(model="tiny", messages=MESSAGES, seed=11 + i, temperature=1.0, max_tokens=10)
            for i in range(4)
        ]
    for choice, answer in zip(out.choices, answers, strict=True):
        assert choice.message.content == answer.choices[0].message.content
        assert choice.finish_reason == answer.choices[0].finish_reason
    assert out.usage.completion_tokens == sum(a.usage.completion_tokens for a in answers)
    assert out.usage.total_tokens == prompt_tokens + out.usage.completion_tokens
    assert len({c.message.content for c in out.choices}) > 1  # different seeds, different samples
    assert_quiescent(runner.cache)


def test_n_completions_choices_with_echo_and_logprobs(served_tiny) -> None:
    runner, _, client = served_tiny
    out = client.completions.create(
        model="tiny", prompt="The weather in Rome is", n=3, seed=5, temperature=0.8, max_tokens=6, echo=True, logprobs=1
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice in out.choices:
        assert choice.text.startswith("The weather in Rome is")
        assert choice.logprobs.token_logprobs[0] is None
    greedy = client.completions.create(model="tiny", prompt="The weather in Rome is", n=2, max_tokens=6)
    assert greedy.choices[0].text == greedy.choices[1].text  # greedy samples agree
    assert_quiescent(runner.cache)


@pytest.mark.parametrize(
    "fields",
    [{"n": 0}, {"n": 17}, {"n": 2.0}, {"n": True}, {"n": 2.5, "stream": True}],
)
def test_bad_n_is_a_400_naming_it(served_tiny, fields) -> None:
    runner, url, _ = served_tiny
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, **fields}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    assert_quiescent(runner.cache)


def test_samples_past_the_largest_seed_wrap_around_to_seed_zero(served_tiny) -> None:
    runner, _, client = served_tiny
    top = 2**63 - 1
    out = client.completions.create(model="tiny", prompt="Rome", n=2, seed=top, temperature=1.0, max_tokens=8)
    last = client.completions.create(model="tiny", prompt="Rome", seed=top, temperature=1.0, max_tokens=8)
    zero = client.completions.create(model="tiny", prompt="Rome", seed=0, temperature=1.0, max_tokens=8)
    assert [c.text for c in out.choices] == [last.choices[0].text, zero.choices[0].text]
    assert_quiescent(runner.cache)


def _streamed_choices(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    """Each choice's concatenated text and finish reason, by ``index``, and the last chunk's usage."""
    texts: dict[int, str] = defaultdict(str)
    reasons: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] += piece or ""
            if choice.finish_reason is not None:
                assert choice.index not in reasons  # one finishing chunk per choice
                reasons[choice.index] = choice.finish_reason
    return dict(texts), reasons, chunks[-1].usage


def test_n_streamed_chat_choices_are_the_non_streamed_ones(served_tiny) -> None:
    runner, _, client = served_tiny
    options = {"model": "tiny", "messages": MESSAGES, "n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 12}
    plain = client.chat.completions.create(**options)
    chunks = list(client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    texts, reasons, usage = _streamed_choices(chunks)
    assert texts == {c.index: c.message.content for c in plain.choices}
    assert reasons == {c.index: c.finish_reason for c in plain.choices}
    assert len(set(texts.values())) > 1
    # One usage-only chunk, the last: the prompt once, the three samples' completion tokens.
    assert [c for c in chunks if not c.choices] == [chunks[-1]]
    assert (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, plain.usage.completion_tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]  # each choice opens with its role, as OpenAI streams them
    assert_quiescent(runner.cache)


def test_n_streamed_completions_carry_the_summed_usage_on_the_last_finishing_chunk(served_tiny) -> None:
    runner, _, client = served_tiny
    options = {"model": "tiny", "prompt": "The weather in Rome is", "n": 3, "seed": 3, "temperature": 0.9}
    plain = client.completions.create(**options, max_tokens=8, echo=True)
    chunks = list(client.completions.create(**options, max_tokens=8, echo=True, stream=True))
    texts, reasons, usage = _streamed_choices(chunks)
    assert texts == {c.index: c.text for c in plain.choices}
    assert all(text.startswith("The weather in Rome is") for text in texts.values())
    assert reasons == {c.index: c.finish_reason for c in plain.choices}
    # Without include_usage the usage rides on a finishing chunk: only the last, with the samples' sum.
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices[0].finish_reason is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, plain.usage.completion_tokens)
    assert_quiescent(runner.cache)


def test_n_streamed_with_continuous_usage_counts_each_choice_and_sums_at_the_end(served_tiny) -> None:
    runner, url, _ = served_tiny
    body = {
        "model": "tiny",
        "prompt": "Rome",
        "n": 2,
        "seed": 1,
        "temperature": 1.0,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    chunks = [json.loads(line) for line in lines[:-1]]
    so_far: dict[int, list[int]] = defaultdict(list)
    for chunk in chunks[:-1]:
        assert len(chunk["choices"]) == 1
        if chunk["choices"][0]["finish_reason"] is None:
            so_far[chunk["choices"][0]["index"]].append(chunk["usage"]["completion_tokens"])
    # Every chunk counts its own choice's tokens so far (a delta may hold several byte tokens of one character).
    assert sorted(so_far) == [0, 1] and all(counts == sorted(counts) for counts in so_far.values())
    plain = httpx.post(url + "/v1/completions", json={**body, "stream": False, "stream_options": None}, timeout=30)
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == plain.json()["usage"]["completion_tokens"]
    assert final["usage"]["completion_tokens"] == sum(counts[-1] for counts in so_far.values())
    assert_quiescent(runner.cache)


def test_a_client_leaving_an_n_stream_cancels_every_sample(make_app) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["word " * 3000]), cache_tokens=1 << 15)
    app = make_app(runner)
    with start_background(app, "127.0.0.1", 0) as server:
        body = {"model": "scripted", "messages": MESSAGES, "n": 3, "stream": True, "max_tokens": 15000}
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = (line for line in response.iter_lines() if line)
                received = [json.loads(next(lines).removeprefix("data: ")) for _ in range(12)]
        assert {chunk["choices"][0]["index"] for chunk in received} == {0, 1, 2}
        assert app.state.engine.wait_idle(timeout=30)
        assert app.state.engine.cancelled_requests == 3
        assert_quiescent(runner.cache)


def test_an_n_stream_refused_at_submit_is_one_error_response(served_tiny) -> None:
    runner, url, _ = served_tiny
    body = {"model": "tiny", "messages": MESSAGES, "n": 3, "stream": True, "max_tokens": 20000}  # past the pool
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert "token" in response.json()["error"]["message"]
    assert runner.cache.stats().hit_tokens == 0  # nothing ran
    assert_quiescent(runner.cache)


def test_n_streamed_tool_calls_come_once_per_choice(make_app) -> None:
    call = '<tool_call>\n{"name": "lookup", "arguments": {"q": "kv"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    runner = PrefixCachingRunner(ScriptedModel.from_texts([call]), cache_tokens=8192)
    with start_background(make_app(runner), "127.0.0.1", 0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(model="scripted", messages=MESSAGES, tools=tools, n=2, stream=True)
        chunks = list(stream)
    calls = {c.choices[0].index: c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls}
    assert sorted(calls) == [0, 1]
    assert all(json.loads(delta[0].function.arguments) == {"q": "kv"} for delta in calls.values())
    _, reasons, _ = _streamed_choices(chunks)
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    assert_quiescent(runner.cache)
