"""pydantic-ai's ``Agent`` with a structured ``output_type`` against the server on 127.0.0.1: its default tool output
(a ``final_result`` tool the request requires, whose arguments the grammar constrains to the type's schema) and its
``NativeOutput`` (a strict ``json_schema`` response format) both return a validated object from the random-weight
``tiny`` model, and each turn of a conversation finds the whole previous turn, prompt and answer, cached."""

from __future__ import annotations

import os

import pydantic
import pytest

from prefixcache.testing import assert_quiescent

if os.environ.get("CI") != "true":  # CI installs every extra: there a missing one fails
    pytest.importorskip("pydantic_ai", reason="needs: pip install 'prefixcache[pydantic-ai]'")
    pytest.importorskip("llguidance", reason="needs: pip install 'prefixcache[structured]'")

from pydantic_ai import Agent, NativeOutput  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402


class Forecast(pydantic.BaseModel):
    """Tomorrow's weather in one city."""

    city: str = pydantic.Field(max_length=8)
    sunny: bool


@pytest.mark.parametrize("native", [False, True], ids=["tool-output", "native-output"])
def test_an_agent_returns_the_validated_object_and_each_turn_hits_the_last(served_tiny, native) -> None:
    runner, url, _ = served_tiny
    model = OpenAIChatModel("tiny", provider=OpenAIProvider(base_url=url + "/v1", api_key="none"))
    agent = Agent(
        model,
        output_type=NativeOutput(Forecast) if native else Forecast,
        instructions="Give the forecast.",
        model_settings={"max_tokens": 200, "temperature": 0.0},
    )
    history, usages = None, []
    for question in ("Paris tomorrow?", "And Rome?", "And Oslo?"):
        result = agent.run_sync(question, message_history=history)
        assert isinstance(result.output, Forecast) and len(result.output.city) <= 8
        history = result.all_messages()
        usages.append(result.usage)
    for before, after in zip(usages, usages[1:], strict=False):
        # All of the previous turn is cached but its last answer token, whose K/V no forward has computed.
        assert after.cache_read_tokens == before.input_tokens + before.output_tokens - 1
        assert after.cache_read_tokens > before.cache_read_tokens
    assert_quiescent(runner.cache)
