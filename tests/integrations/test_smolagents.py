"""smolagents: a ToolCallingAgent on the scripted model with a real tool, every step after the first mostly cached."""

from __future__ import annotations

from smolagents import ToolCallingAgent, tool
from smolagents.memory import ActionStep

from prefixcache import PrefixCachingRunner
from prefixcache.integrations.smolagents import PrefixCacheModel
from prefixcache.testing import ScriptedModel, assert_quiescent, require_extra

# A ToolCallingAgent sends tool_choice "required": a forced call, constrained by a grammar.
require_extra("llguidance", "structured")

VISITS: list[str] = []


@tool
def get_weather(city: str) -> str:
    """Current weather in a city.

    Args:
        city: The city's name.
    """
    VISITS.append(city)
    return f"{city}: {10 + len(city)} C"


FINAL = '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "All five are mild."}}\n</tool_call>'


def run_agent(weather_calls: list[str], stream: bool) -> tuple[object, list[ActionStep], PrefixCachingRunner]:
    runner = PrefixCachingRunner(ScriptedModel.from_texts([*weather_calls, FINAL]), cache_tokens=1 << 16)
    agent = ToolCallingAgent(
        tools=[get_weather], model=PrefixCacheModel(runner), max_steps=8, verbosity_level=0, stream_outputs=stream
    )
    VISITS.clear()
    result = agent.run("What is the weather in Paris, Oslo, Lima, Pune and Kyiv?")
    steps = [step for step in agent.memory.steps if isinstance(step, ActionStep)]
    return result, steps, runner


def test_tool_calling_agent_runs_six_steps_on_the_cache(weather_calls: list[str]) -> None:
    result, steps, runner = run_agent(weather_calls, stream=False)
    assert result == "All five are mild."
    assert VISITS == ["Paris", "Oslo", "Lima", "Pune", "Kyiv"]
    assert len(steps) == 6
    usages = [step.model_output_message.raw["usage"] for step in steps]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    for step, usage in zip(steps[1:], usages[1:], strict=True):
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]
        assert step.token_usage.input_tokens == usage["prompt_tokens"]
    assert_quiescent(runner.cache)


def test_streaming_agent_gets_the_same_calls(weather_calls: list[str]) -> None:
    result, steps, runner = run_agent(weather_calls, stream=True)
    assert result == "All five are mild."
    assert VISITS == ["Paris", "Oslo", "Lima", "Pune", "Kyiv"]
    assert [s.tool_calls[0].name for s in steps] == ["get_weather"] * 5 + ["final_answer"]
    assert_quiescent(runner.cache)


def test_unsupported_options_are_invalid_arguments_and_a_per_call_seed_is_taken() -> None:
    import pytest

    from prefixcache.errors import InvalidArgumentError

    runner = PrefixCachingRunner(ScriptedModel.from_texts(["hi", "hi"]), cache_tokens=4096)
    model = PrefixCacheModel(runner)
    ask = [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidArgumentError, match="response_format"):  # was a plain ValueError
        model.generate(ask, response_format={"type": "json_object"})
    with pytest.raises(InvalidArgumentError, match="frobnicate"):  # was silently dropped
        model.generate(ask, frobnicate=1)
    assert runner.cache.stats().cached_tokens == 0
    assert model.generate(ask, seed=7, temperature=0.5, max_new_tokens=8).content == "hi"
    assert_quiescent(runner.cache)


def test_two_tools_of_one_name_are_an_invalid_argument() -> None:
    import pytest

    from prefixcache.errors import InvalidArgumentError

    runner = PrefixCachingRunner(ScriptedModel.from_texts(["hi"]), cache_tokens=4096)
    model = PrefixCacheModel(runner)
    with pytest.raises(InvalidArgumentError, match=r"tools\[1\] is named 'get_weather', as tools\[0\] is"):
        model.generate([{"role": "user", "content": "x"}], tools_to_call_from=[get_weather, get_weather])
    assert runner.cache.stats().cached_tokens == 0
    assert_quiescent(runner.cache)
