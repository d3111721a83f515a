"""The OpenAI-compatible API through the real ``openai`` client, in-process (httpx ASGI transport)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.models.llama import build_model
from prefixcache.serve import ApiKeys
from prefixcache.testing import ScriptedModel, assert_quiescent, require_extra, snapshot

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SYSTEM = "You are a weather assistant. Answer briefly and use the tools when asked about weather. " * 8
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
QUESTION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris?"}]


def scripted(*texts: str, cache_tokens: int = 16384) -> PrefixCachingRunner:
    return PrefixCachingRunner(ScriptedModel.from_texts(texts), cache_tokens=cache_tokens)


def run(coroutine):
    return asyncio.run(coroutine)


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_plain_completion_equals_the_in_process_answer_and_reports_cached_tokens(make_app, asgi_client) -> None:
    model = build_model("tiny", device="cpu")
    app = make_app(PrefixCachingRunner(model, cache_tokens=4096), model_name="tiny")
    reference = PrefixCachingRunner(model, cache_tokens=4096).chat(QUESTION, max_new_tokens=12)

    async def main():
        client = asgi_client(app)
        first = await client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=12)
        second = await client.chat.completions.create(model="tiny", messages=QUESTION, max_completion_tokens=12)
        return first, second

    first, second = run(main())
    assert first.choices[0].message.content == reference.text
    assert first.choices[0].finish_reason == reference.finish_reason
    assert first.usage.prompt_tokens == reference.usage.prompt_tokens
    assert first.usage.completion_tokens == reference.usage.generated_tokens
    assert cached(first.usage) == 0
    assert cached(second.usage) == second.usage.prompt_tokens - 1  # the last prompt token is always computed
    assert second.choices[0].message.content == reference.text
    assert_quiescent(app.state.runner.cache)


def test_streamed_chunks_add_up_to_the_plain_answer(make_app, asgi_client) -> None:
    app = make_app(scripted("Sunny, 18 degrees, light wind."))

    async def main():
        client = asgi_client(app)
        plain = await client.chat.completions.create(model="scripted", messages=QUESTION)
        stream = await client.chat.completions.create(
            model="scripted", messages=QUESTION, stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
        bare = await client.chat.completions.create(model="scripted", messages=QUESTION, stream=True)
        bare_chunks = [chunk async for chunk in bare]
        return plain, chunks, bare_chunks

    plain, chunks, bare_chunks = run(main())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content == "Sunny, 18 degrees, light wind."
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert cached(chunks[-1].usage) == plain.usage.prompt_tokens - 1
    # Without include_usage the usage rides on the finishing chunk: every response reports cached tokens.
    assert bare_chunks[-1].choices[0].finish_reason == "stop"
    assert cached(bare_chunks[-1].usage) == plain.usage.prompt_tokens - 1


def test_tools_round_trip_plain_and_streamed(make_app, asgi_client) -> None:
    app = make_app(scripted(CALL, "It is 18 degrees in Paris."))

    async def main():
        client = asgi_client(app)
        first = await client.chat.completions.create(model="scripted", messages=QUESTION, tools=TOOLS)
        message = first.choices[0].message
        follow_up = [
            *QUESTION,
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"temp_c": 18}'},
        ]
        stream = await client.chat.completions.create(
            model="scripted", messages=QUESTION, tools=TOOLS, stream=True, stream_options={"include_usage": True}
        )
        streamed = [chunk async for chunk in stream]
        second = await client.chat.completions.create(model="scripted", messages=follow_up, tools=TOOLS)
        return first, streamed, second

    first, streamed, second = run(main())
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    deltas = [d for c in streamed if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert not any(c.choices[0].delta.content for c in streamed if c.choices)
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"
    assert second.choices[0].message.content == "It is 18 degrees in Paris."
    assert second.choices[0].finish_reason == "stop"
    # The re-rendered call is byte for byte what the model generated: everything up to the tool result is cached.
    assert cached(second.usage) >= 0.9 * second.usage.prompt_tokens


def test_tool_choice_none_named_and_required(make_app, asgi_client) -> None:
    require_extra("llguidance", "structured")  # a forced call is constrained by a grammar, or refused
    app = make_app(scripted(CALL))
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def main():
        client = asgi_client(app)
        none = await client.chat.completions.create(
            model="scripted", messages=QUESTION, tools=TOOLS, tool_choice="none"
        )
        forced = await client.chat.completions.create(
            model="scripted", messages=QUESTION, tools=TOOLS, tool_choice=named
        )
        required = await client.chat.completions.create(
            model="scripted", messages=QUESTION, tools=TOOLS, tool_choice="required"
        )
        return none, forced, required

    none, forced, required = run(main())
    assert none.choices[0].message.content == CALL and none.choices[0].message.tool_calls is None
    for response in (forced, required):
        assert response.choices[0].finish_reason == "tool_calls"
        assert json.loads(response.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_stop_strings_trim_the_answer_and_the_request_is_still_cached(make_app, asgi_client) -> None:
    app = make_app(scripted("Thought: check the weather\nObservation: sunny\nFinal"))

    async def main():
        client = asgi_client(app)
        first = await client.chat.completions.create(model="scripted", messages=QUESTION, stop=["Observation:"])
        again = await client.chat.completions.create(model="scripted", messages=QUESTION, stop="Observation:")
        return first, again

    first, again = run(main())
    assert first.choices[0].message.content == "Thought: check the weather\n"
    assert first.choices[0].finish_reason == "stop"
    assert cached(again.usage) == again.usage.prompt_tokens - 1


def test_more_than_four_stop_strings_are_taken(make_app, asgi_client) -> None:
    # OpenAI allows 4; vLLM has no limit and lm-eval sends more (this used to be a 400).
    app = make_app(scripted("Thought: check the weather\nObservation: sunny\nFinal"))
    stops = ["Question:", "</s>", "\n\n", "Final", "Observation:", "Answer:"]

    async def main():
        return await asgi_client(app).chat.completions.create(model="scripted", messages=QUESTION, stop=stops)

    response = run(main())
    assert response.choices[0].message.content == "Thought: check the weather\n"
    assert response.choices[0].finish_reason == "stop"


def test_a_malformed_call_comes_back_as_text(make_app, asgi_client) -> None:
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    app = make_app(scripted(broken))

    async def main():
        return await asgi_client(app).chat.completions.create(model="scripted", messages=QUESTION, tools=TOOLS)

    response = run(main())
    assert response.choices[0].message.content == broken
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_with_a_lone_surrogate_escape_comes_back_as_text_not_a_500(make_app, asgi_client, stream: bool) -> None:
    # json.loads turns "\ud800" into a lone surrogate, which cannot be encoded as UTF-8: this used to be a 500.
    odd = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud800"}}\n</tool_call>'
    app = make_app(scripted(odd))

    async def main():
        client = asgi_client(app)
        if not stream:
            response = await client.chat.completions.create(model="scripted", messages=QUESTION, tools=TOOLS)
            return response.choices[0].message.content, response.choices[0].message.tool_calls
        chunks = await client.chat.completions.create(model="scripted", messages=QUESTION, tools=TOOLS, stream=True)
        pieces = [c.choices[0].delta async for c in chunks if c.choices]
        return "".join(d.content or "" for d in pieces), [d.tool_calls for d in pieces if d.tool_calls] or None

    assert run(main()) == (odd, None)
    assert_quiescent(app.state.runner.cache)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 0, "stream": True}, "n"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 1}}}, "response_format"),
        ({"stop": ["a", ""]}, "stop"),
        ({"temperature": 3}, "temperature"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ],
)
def test_unsupported_parameters_are_400_in_openai_shape(make_app, asgi_client, extra: dict, param: str) -> None:
    runner = scripted("x")
    app = make_app(runner)
    before = snapshot(runner.cache, [runner.namespace_key(None)])

    async def main():
        return await asgi_client(app).chat.completions.create(model="scripted", messages=QUESTION, **extra)

    with pytest.raises(openai.BadRequestError) as caught:
        run(main())
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param and caught.value.body["type"] == "invalid_request_error"
    assert snapshot(runner.cache, [runner.namespace_key(None)]) == before


def test_template_errors_unknown_models_and_bad_tool_choice(make_app, asgi_client) -> None:
    app = make_app(scripted("x"))

    async def main(**kwargs):
        return await asgi_client(app).chat.completions.create(**{"model": "scripted", "messages": QUESTION, **kwargs})

    with pytest.raises(openai.BadRequestError, match="role 'robot'"):
        run(main(messages=[{"role": "robot", "content": "hi"}]))
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        run(main(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}))
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        run(main(model="gpt-4o"))
    with pytest.raises(openai.BadRequestError, match="exceed"):
        run(main(max_tokens=10**6))
    assert_quiescent(app.state.runner.cache)


def test_missing_or_wrong_key_is_401_and_touches_nothing(make_app, asgi_client, tmp_path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# tenants\nkey-a team-a\nkey-b\n")
    runner = scripted("Hello.")
    app = make_app(runner, api_keys=ApiKeys.from_file(keys))
    spaces = [runner.namespace_key(ns) for ns in (None, "team-a")]
    before = snapshot(runner.cache, spaces)

    async def main(key: str):
        return await asgi_client(app, api_key=key).chat.completions.create(model="scripted", messages=QUESTION)

    with pytest.raises(openai.AuthenticationError) as caught:
        run(main("wrong"))
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"

    async def without_key():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
            body = {"model": "scripted", "messages": QUESTION}
            return [await http.post("/v1/chat/completions", json=body), await http.get("/v1/models")]

    for response in run(without_key()):
        assert response.status_code == 401
        assert response.json()["error"]["message"].startswith("missing API key")
    assert snapshot(runner.cache, spaces) == before
    assert app.state.engine.num_pending == 0
    assert run(main("key-a")).choices[0].message.content == "Hello."


def test_two_api_keys_never_share_cache(make_app, asgi_client, tmp_path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("key-a\nkey-b\n")
    runner = scripted("Hello.")
    app = make_app(runner, api_keys=ApiKeys.from_file(keys))

    async def ask(key: str, **body):
        client = asgi_client(app, api_key=key)
        return await client.chat.completions.create(model="scripted", messages=QUESTION, **body)

    a1 = run(ask("key-a"))
    # A namespace in the body is not an option: it is rejected, never used.
    with pytest.raises(openai.BadRequestError):
        run(ask("key-b", extra_body={"namespace": "key-a"}))
    b1 = run(ask("key-b"))
    a2 = run(ask("key-a"))
    assert (cached(a1.usage), cached(b1.usage)) == (0, 0)
    assert cached(a2.usage) == a2.usage.prompt_tokens - 1


def test_sixteen_concurrent_streams_get_the_sequential_answers(make_app, asgi_client) -> None:
    model = build_model("tiny", device="cpu")
    app = make_app(PrefixCachingRunner(model, cache_tokens=1 << 15), model_name="tiny")
    questions = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Q{i}"}] for i in range(16)]
    reference = PrefixCachingRunner(model, cache_tokens=1 << 15)
    expected = [reference.chat(q, max_new_tokens=6).text for q in questions]

    async def one(client, messages):
        stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main():
        client = asgi_client(app)
        return await asyncio.gather(*(one(client, q) for q in questions))

    assert run(main()) == expected
    assert_quiescent(app.state.runner.cache)


def test_completions_models_health_metrics_and_prefill(make_app, asgi_client) -> None:
    runner = scripted("Hello.")
    app = make_app(runner)
    tok = runner.tokenizer

    async def main():
        client = asgi_client(app)
        models = await client.models.list()
        warm = await client.post("/cache/prefill", body={"messages": QUESTION[:1]}, cast_to=object)
        chat = await client.chat.completions.create(model="scripted", messages=QUESTION)
        text = await client.completions.create(model="scripted", prompt="Say hi", max_tokens=4)
        ids = await client.completions.create(model="scripted", prompt=tok.encode("Say hi"), max_tokens=4)
        http = client._client
        health = (await http.get("/health")).json()
        metrics = (await http.get("/metrics")).text
        return models, warm, chat, text, ids, health, metrics

    models, warm, chat, text, ids, health, metrics = run(main())
    assert [m.id for m in models.data] == ["scripted"]
    system_tokens = warm["usage"]["prompt_tokens"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached(chat.usage) == system_tokens
    assert text.choices[0].text == ids.choices[0].text
    assert cached(ids.usage) == ids.usage.prompt_tokens - 1
    assert health["status"] == "ok"
    assert "prefixcache_hit_rate" in metrics and "prefixcache_ttft_seconds_bucket" in metrics
    assert f"prefixcache_prompt_cached_tokens_total {float(system_tokens + ids.usage.prompt_tokens - 1)}" in metrics
