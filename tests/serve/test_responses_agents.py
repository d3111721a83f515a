"""The OpenAI Agents SDK's default model (its Responses model) against the server: a tool call, then the answer."""

from __future__ import annotations

import asyncio
import os

import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.testing import ScriptedModel, assert_quiescent

if os.environ.get("CI") != "true":  # CI installs every extra: there a missing one fails
    pytest.importorskip("agents", reason="needs: pip install 'prefixcache[agents]'")

from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled  # noqa: E402

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 18 degrees in Paris."


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agent_calls_its_tool_then_answers_with_the_first_turn_cached(make_app, asgi_client, streamed) -> None:
    set_tracing_disabled(True)  # the SDK's traces would go to OpenAI's servers
    app = make_app(PrefixCachingRunner(ScriptedModel.from_texts([CALL, ANSWER]), cache_tokens=16384))
    visits: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        visits.append(city)
        return "18 degrees"

    model = OpenAIResponsesModel("scripted", asgi_client(app))
    agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model)

    async def main():
        if not streamed:
            return await Runner.run(agent, "Weather in Paris?")
        result = Runner.run_streamed(agent, "Weather in Paris?")
        async for _ in result.stream_events():
            pass
        return result

    result = asyncio.run(main())
    assert result.final_output == ANSWER and visits == ["Paris"]
    first, second = (response.usage for response in result.raw_responses)
    assert second.input_tokens_details.cached_tokens >= first.input_tokens + first.output_tokens - 1
    assert_quiescent(app.state.runner.cache)


def test_an_agent_with_an_output_type_returns_the_validated_object(make_app, asgi_client) -> None:
    """The Agents SDK sends an ``output_type`` as ``text.format`` json_schema (strict): the answer is constrained to
    it by the grammar, so even a random-weight model returns a valid object; a second run hits the first's prompt."""
    pytest.importorskip("llguidance", reason="needs: pip install 'prefixcache[structured]'")
    import pydantic

    from prefixcache.models.llama import build_model

    set_tracing_disabled(True)

    class Forecast(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=8)
        sunny: bool

    app = make_app(PrefixCachingRunner(build_model("tiny", device="cpu"), cache_tokens=8192), model_name="tiny")
    model = OpenAIResponsesModel("tiny", asgi_client(app))
    agent = Agent(name="forecaster", instructions="Give the forecast.", model=model, output_type=Forecast)

    async def main():
        return [await Runner.run(agent, "Paris tomorrow?") for _ in range(2)]

    first, second = asyncio.run(main())
    assert isinstance(first.final_output, Forecast) and isinstance(second.final_output, Forecast)
    usage = second.raw_responses[0].usage
    assert usage.input_tokens_details.cached_tokens == usage.input_tokens - 1
    assert_quiescent(app.state.runner.cache)
