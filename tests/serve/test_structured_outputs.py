"""``response_format`` and schema-constrained forced tool calls through the real ``openai`` client (in-process ASGI),
with the random-weight tiny model: the answer parses and validates, the SDK's ``parse`` returns the typed object,
a bad schema is a 400 naming ``response_format``."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Literal

import pydantic
import pytest

if os.environ.get("CI") != "true":  # CI installs every extra: there a missing one fails
    pytest.importorskip("llguidance", reason="needs: pip install 'prefixcache[structured]'")
    pytest.importorskip("jsonschema", reason="needs: pip install 'prefixcache[test]'")
import jsonschema  # noqa: E402
import openai  # noqa: E402

from prefixcache import PrefixCachingRunner  # noqa: E402
from prefixcache.models.llama import build_model  # noqa: E402
from prefixcache.testing import ScriptedModel, assert_quiescent  # noqa: E402

ASK = [{"role": "user", "content": "Describe a city as JSON."}]
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"enum": ["small", "big"]},
        "coastal": {"type": "boolean"},
    },
    "required": ["name", "size", "coastal"],
    "additionalProperties": False,
}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    size: Literal["small", "big"]
    coastal: bool


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", device="cpu")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_answer_validates_against_it(make_app, asgi_client, tiny, temperature: float) -> None:
    app = make_app(PrefixCachingRunner(tiny, cache_tokens=4096), model_name="tiny")
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}

    async def main():
        return await asgi_client(app).chat.completions.create(
            model="tiny", messages=ASK, response_format=response_format, max_tokens=100, temperature=temperature, seed=1
        )

    choice = run(main()).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), CITY)
    assert_quiescent(app.state.runner.cache)


def test_the_sdks_parse_returns_the_validated_model(make_app, asgi_client, tiny) -> None:
    app = make_app(PrefixCachingRunner(tiny, cache_tokens=4096), model_name="tiny")

    async def main():
        client = asgi_client(app)
        return await client.chat.completions.parse(model="tiny", messages=ASK, response_format=City, max_tokens=100)

    parsed = run(main()).choices[0].message.parsed
    assert isinstance(parsed, City)


def test_json_object_on_chat_and_a_schema_on_completions(make_app, asgi_client, tiny) -> None:
    app = make_app(PrefixCachingRunner(tiny, cache_tokens=4096), model_name="tiny")

    async def main():
        client = asgi_client(app)
        chat = await client.chat.completions.create(
            model="tiny", messages=ASK, response_format={"type": "json_object"}, max_tokens=200
        )
        completion = await client.completions.create(
            model="tiny",
            prompt="City: ",
            max_tokens=100,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}},
        )
        return chat.choices[0], completion.choices[0]

    chat, completion = run(main())
    if chat.finish_reason == "stop":
        assert isinstance(json.loads(chat.message.content), dict)
    else:
        assert chat.message.content.startswith("{")
    jsonschema.validate(json.loads(completion.text), CITY)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "frob"}}},
        {"type": "json_schema", "json_schema": {"schema": CITY}},
        {"type": "json_schema"},
        {"type": "grammar"},
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(make_app, asgi_client, tiny, response_format) -> None:
    app = make_app(PrefixCachingRunner(tiny, cache_tokens=4096), model_name="tiny")

    async def main():
        return await asgi_client(app).chat.completions.create(
            model="tiny", messages=ASK, response_format=response_format
        )

    with pytest.raises(openai.BadRequestError) as caught:
        run(main())
    assert caught.value.body["param"] == "response_format"
    assert app.state.runner.cache.stats().cached_tokens == 0


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string", "maxLength": 6} for key in keys},
                "required": list(keys),
                "additionalProperties": False,
            },
        },
    }
    for name, keys in (("get_weather", ("city",)), ("write_file", ("path", "text")))
]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "write_file"}}])
def test_a_forced_tool_calls_arguments_follow_its_parameters(make_app, asgi_client, tiny, tool_choice) -> None:
    app = make_app(PrefixCachingRunner(tiny, cache_tokens=8192), model_name="tiny")

    async def main():
        return await asgi_client(app).chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=0.8, seed=2
        )

    choice = run(main()).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    [tool] = [t for t in TOOLS if t["function"]["name"] == call.function.name]
    if isinstance(tool_choice, dict):
        assert call.function.name == "write_file"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert_quiescent(app.state.runner.cache)


def test_a_responses_text_format_schema_is_constrained_and_the_sdk_parses_it(make_app, asgi_client, tiny) -> None:
    app = make_app(PrefixCachingRunner(tiny, cache_tokens=4096), model_name="tiny")

    async def main():
        client = asgi_client(app)
        parsed = await client.responses.parse(
            model="tiny", input="Describe a city.", text_format=City, max_output_tokens=100
        )
        plain = await client.responses.create(
            model="tiny",
            input="Any city.",
            text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
            max_output_tokens=100,
            temperature=1.0,
        )
        return parsed, plain

    parsed, plain = run(main())
    assert isinstance(parsed.output_parsed, City)
    assert parsed.text.format.type == "json_schema"
    jsonschema.validate(json.loads(plain.output_text), CITY)
    assert plain.text.format.name == "city"
    assert_quiescent(app.state.runner.cache)


def test_a_strict_tools_call_under_auto_follows_its_parameters_on_chat_and_responses(make_app, asgi_client) -> None:
    # The script's city is longer than the schema's 6 characters: a strict tool's call is cut to fit, a free one's not.
    script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Marseille"}}\n</tool_call>'
    schema = TOOLS[0]["function"]["parameters"]
    cities = {}
    for strict in (True, False):
        app = make_app(PrefixCachingRunner(ScriptedModel.from_texts([script] * 2), cache_tokens=8192))
        chat_tools = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": strict}}]
        responses_tools = [{"type": "function", **TOOLS[0]["function"], "strict": strict}]

        async def main(chat_tools=chat_tools, responses_tools=responses_tools, app=app):
            client = asgi_client(app)
            chat = await client.chat.completions.create(model="scripted", messages=ASK, tools=chat_tools)
            response = await client.responses.create(model="scripted", input="Weather?", tools=responses_tools)
            return chat, response

        chat, response = run(main())
        [call] = chat.choices[0].message.tool_calls
        [item] = [item for item in response.output if item.type == "function_call"]
        arguments = [json.loads(call.function.arguments), json.loads(item.arguments)]
        cities[strict] = [a["city"] for a in arguments]
        if strict:
            for value in arguments:
                jsonschema.validate(value, schema)
        assert_quiescent(app.state.runner.cache)
    assert cities == {True: ["Marsei", "Marsei"], False: ["Marseille", "Marseille"]}
