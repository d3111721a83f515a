"""The penalty, filter and stop parameters on /v1/chat/completions and /v1/completions: OpenAI's fields at the top
level, vLLM's through the ``openai`` client's ``extra_body``; each answer equals the in-process call with the same
SamplingParams, and a bad value is a 400 in OpenAI's error shape naming it, leaving the cache as it was."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.engine.chat import complete_text
from prefixcache.models.llama import build_model
from prefixcache.serve import start_background
from prefixcache.testing import ScriptedModel, assert_quiescent, snapshot

QUESTION = [
    {"role": "system", "content": "You answer about the weather, briefly. " * 4},
    {"role": "user", "content": "Weather in Paris?"},
]
VLLM_FIELDS = {"top_k": 8, "min_p": 0.05, "repetition_penalty": 1.3, "min_tokens": 4, "ignore_eos": False}
OPENAI_FIELDS = {"presence_penalty": 0.5, "frequency_penalty": 0.7, "logit_bias": {"101": 4.0, "32": -100}}
IN_PROCESS = {**VLLM_FIELDS, **OPENAI_FIELDS, "logit_bias": {101: 4.0, 32: -100}}


@pytest.fixture(scope="module")
def tiny_model():
    return build_model("tiny", device="cpu")


def test_the_openai_client_passes_every_parameter_over_a_real_socket(make_app, tiny_model) -> None:
    reference = PrefixCachingRunner(tiny_model, cache_tokens=4096)
    greedy = reference.chat(QUESTION, max_new_tokens=12, **IN_PROCESS)
    plain = reference.chat(QUESTION, max_new_tokens=12)
    sampled = reference.chat(QUESTION, max_new_tokens=12, temperature=0.9, seed=3, **IN_PROCESS)
    prompt = reference.tokenizer.encode("The weather in Paris is")
    completed = complete_text(reference, prompt, max_new_tokens=10, **IN_PROCESS)
    assert greedy.text != plain.text and " " not in greedy.text  # the bias of -100 on " " (id 32) took hold

    runner = PrefixCachingRunner(tiny_model, cache_tokens=4096)
    with start_background(make_app(runner, model_name="tiny"), "127.0.0.1", 0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        ask = dict(model="tiny", messages=QUESTION, max_tokens=12, extra_body=VLLM_FIELDS, **OPENAI_FIELDS)
        answer = client.chat.completions.create(**ask)
        drawn = client.chat.completions.create(**ask, temperature=0.9, seed=3)
        stream = client.chat.completions.create(**ask, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        text = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, extra_body=VLLM_FIELDS, **OPENAI_FIELDS
        )
    assert answer.choices[0].message.content == streamed == greedy.text
    assert answer.usage.completion_tokens == greedy.usage.generated_tokens
    assert drawn.choices[0].message.content == sampled.text
    assert text.choices[0].text == completed.content
    assert_quiescent(runner.cache)


def scripted(text: str) -> PrefixCachingRunner:
    return PrefixCachingRunner(ScriptedModel.from_texts([text]), cache_tokens=4096)


def run(coroutine):
    return asyncio.run(coroutine)


TURN = [ByteTokenizer().special_token_id("<|im_start|>"), *ByteTokenizer().encode("assistant\n")]
"""Token ids of a generation prompt: the scripted model answers after them."""


def test_ignore_eos_generates_max_tokens_as_benchmarks_ask(make_app) -> None:
    app = make_app(scripted("hi"))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
            body = {"model": "scripted", "prompt": TURN, "max_tokens": 9}
            stopped = await http.post("/v1/completions", json=body)
            ignoring = await http.post("/v1/completions", json={**body, "ignore_eos": True})
            return stopped.json(), ignoring.json()

    stopped, ignoring = run(main())
    assert (stopped["choices"][0]["finish_reason"], stopped["usage"]["completion_tokens"]) == ("stop", 3)
    assert (ignoring["choices"][0]["finish_reason"], ignoring["usage"]["completion_tokens"]) == ("length", 9)
    assert ignoring["choices"][0]["text"] == stopped["choices"][0]["text"] == "hi"  # stop tokens never shown
    assert_quiescent(app.state.runner.cache)


def test_min_tokens_holds_the_end_of_turn_back(make_app, asgi_client) -> None:
    app = make_app(scripted("hi"))

    async def main():
        client = asgi_client(app)
        return await client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "?"}], extra_body={"min_tokens": 5}
        )

    answer = run(main())
    # "h", "i", then the end-of-turn token masked three times (the script's next-best, id 0), then it ends the turn.
    assert answer.usage.completion_tokens == 6 and answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == "hi" + "\x00" * 3


BAD = [
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", 1.5),
    ("presence_penalty", 2.5),
    ("frequency_penalty", "high"),
    ("repetition_penalty", 0),
    ("logit_bias", {"abc": 1}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"12": 150}),
    ("logit_bias", {"100000": 1}),
    ("logit_bias", [1, 2]),
    ("min_tokens", 500),
    ("min_tokens", -1),
    ("ignore_eos", "yes"),
]


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(("name", "value"), BAD)
def test_bad_values_are_400_in_openai_shape_naming_the_parameter(make_app, endpoint: str, name: str, value) -> None:
    runner = scripted("x")
    app = make_app(runner)
    before = snapshot(runner.cache, [runner.namespace_key(None)])
    body = {"model": "scripted", "max_tokens": 16, name: value}
    body |= {"messages": QUESTION} if endpoint == "/v1/chat/completions" else {"prompt": "hello"}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
            return await http.post(endpoint, json=body)

    response = run(main())
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (name, "invalid_request_error")
    assert snapshot(runner.cache, [runner.namespace_key(None)]) == before


def test_null_values_mean_the_defaults(make_app, asgi_client) -> None:
    app = make_app(scripted("fine"))

    async def main():
        return await asgi_client(app).chat.completions.create(
            model="scripted",
            messages=QUESTION,
            presence_penalty=None,
            frequency_penalty=None,
            logit_bias=None,
            extra_body={"top_k": None, "min_p": None, "min_tokens": None, "ignore_eos": None},
        )

    assert run(main()).choices[0].message.content == "fine"
