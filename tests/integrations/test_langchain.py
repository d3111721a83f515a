"""LangChain: a tool-calling loop on the scripted model, every step after the first served mostly from the cache."""

from __future__ import annotations

import json

from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from prefixcache import PrefixCachingRunner
from prefixcache.integrations.langchain import ChatPrefixCache
from prefixcache.testing import ScriptedModel, assert_quiescent, require_extra

SYSTEM = "You are a travel assistant. Look up the weather of every city the user names, then summarize. " * 6
VISITS: list[str] = []


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    VISITS.append(city)
    return json.dumps({"city": city, "temp_c": 10 + len(city)})


def test_tool_calling_loop_reuses_the_cache_at_every_step(weather_calls: list[str]) -> None:
    final = "Paris 15, Oslo 14, Lima 14, Pune 14, Kyiv 14."
    runner = PrefixCachingRunner(ScriptedModel.from_texts([*weather_calls, final]), cache_tokens=1 << 15)
    llm = ChatPrefixCache(runner=runner).bind_tools([get_weather])
    messages = [SystemMessage(SYSTEM), HumanMessage("Weather in Paris, Oslo, Lima, Pune and Kyiv?")]
    VISITS.clear()
    usages = []
    while True:
        answer = llm.invoke(messages)
        assert isinstance(answer, AIMessage)
        usages.append(answer.usage_metadata)
        messages.append(answer)
        if not answer.tool_calls:
            break
        for call in answer.tool_calls:
            messages.append(get_weather.invoke(call))
    assert VISITS == ["Paris", "Oslo", "Lima", "Pune", "Kyiv"]
    assert answer.content == final and answer.response_metadata["finish_reason"] == "stop"
    assert len(usages) == 6
    assert usages[0]["input_token_details"]["cache_read"] == 0
    for usage in usages[1:]:
        assert usage["input_token_details"]["cache_read"] >= 0.9 * usage["input_tokens"]
    assert isinstance(messages[3], ToolMessage)
    assert_quiescent(runner.cache)


def test_streaming_yields_the_text_then_the_tool_calls(weather_calls: list[str]) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["Let me look.\n" + weather_calls[0]]), cache_tokens=4096)
    llm = ChatPrefixCache(runner=runner).bind_tools([get_weather], tool_choice="auto")
    chunks = list(llm.stream([HumanMessage("Paris?")]))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert whole.content == "Let me look."
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert whole.usage_metadata["input_tokens"] == len(
        runner.tokenizer.render_chat([{"role": "user", "content": "Paris?"}], [get_weather_schema()])
    )


def test_stop_strings_and_forced_tool_choice(weather_calls: list[str]) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["Thought: go\nObservation: x"]), cache_tokens=4096)
    answer = ChatPrefixCache(runner=runner, stop=["Observation:"]).invoke("hi")
    assert answer.content == "Thought: go\n"
    require_extra("llguidance", "structured")  # a forced call is constrained by a grammar, or refused
    forced = PrefixCachingRunner(ScriptedModel.from_texts([weather_calls[1]]), cache_tokens=4096)
    call = ChatPrefixCache(runner=forced).bind_tools([get_weather], tool_choice="get_weather").invoke("Oslo?")
    assert call.tool_calls[0]["args"] == {"city": "Oslo"}


def get_weather_schema() -> dict:
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return convert_to_openai_tool(get_weather)


def test_an_unknown_call_option_is_an_invalid_argument_and_touches_nothing() -> None:
    from prefixcache.errors import InvalidArgumentError

    runner = PrefixCachingRunner(ScriptedModel.from_texts(["hi"]), cache_tokens=4096)
    llm = ChatPrefixCache(runner=runner)
    for call in (lambda: llm.invoke("x", logprobs=True), lambda: list(llm.stream("x", n=2))):
        try:
            call()
        except InvalidArgumentError as error:  # was a TypeError from SamplingParams
            assert "logprobs" in str(error) or "n" in str(error)
        else:
            raise AssertionError("no error")
    assert runner.cache.stats().cached_tokens == 0
    assert_quiescent(runner.cache)


def test_two_tools_of_one_name_are_an_invalid_argument_and_touch_nothing() -> None:
    import pytest

    from prefixcache.errors import InvalidArgumentError

    @tool("get_weather")
    def other_weather(city: str) -> str:
        """Another weather service under the same name."""
        return city

    runner = PrefixCachingRunner(ScriptedModel.from_texts(["hi"]), cache_tokens=4096)
    llm = ChatPrefixCache(runner=runner).bind_tools([get_weather, other_weather])
    with pytest.raises(InvalidArgumentError, match=r"tools\[1\] is named 'get_weather', as tools\[0\] is"):
        llm.invoke("x")
    with pytest.raises(InvalidArgumentError, match="each tool needs its own name"):
        list(llm.stream("x"))
    assert runner.cache.stats().cached_tokens == 0
    assert_quiescent(runner.cache)
