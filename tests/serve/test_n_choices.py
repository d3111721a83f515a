"""``n`` > 1 on /v1/chat/completions and /v1/completions, over a real socket with the ``openai`` client: n choices,
choice i exactly what a request of seed ``seed + i`` answers alone, the prompt prefilled once (the other samples find it
cached), the usage counting the prompt once; ``n`` with streaming, or out of range, is a 400."""

from __future__ import annotations

import httpx
import openai
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.serve import start_background
from prefixcache.testing import assert_quiescent

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
    [{"n": 0}, {"n": 17}, {"n": 2.0}, {"n": True}, {"n": 2, "stream": True}],
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
