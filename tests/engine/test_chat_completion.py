"""Chat completions on the runner: stop strings, tool calls, tool choice, streaming equals the whole answer."""

from __future__ import annotations

import json

import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.engine.chat import chat_stream, complete_chat
from prefixcache.errors import InvalidArgumentError, TemplateError
from prefixcache.testing import ScriptedModel, assert_quiescent, require_extra, snapshot

CALL = '<tool_call>\n{"name": "search", "arguments": {"q": "kv cache"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "system", "content": "Be useful. " * 10}, {"role": "user", "content": "Find it."}]


def runner_for(*texts: str) -> PrefixCachingRunner:
    return PrefixCachingRunner(ScriptedModel.from_texts(texts), cache_tokens=4096, block_size=4)


def streamed(runner: PrefixCachingRunner, messages, tools=None, **options):
    steps = chat_stream(runner, messages, tools, **options)
    pieces = []
    try:
        while True:
            pieces.append(next(steps))
    except StopIteration as done:
        return pieces, done.value


def test_runner_chat_trims_at_a_stop_string_and_caches_the_turn() -> None:
    runner = runner_for("Thought: search it\nAction: search\nObservation: found")
    result = runner.chat(ASK, stop=["Observation:"], max_new_tokens=100)
    assert result.text == "Thought: search it\nAction: search\n"
    assert result.finish_reason == "stop"
    # Generation ended on the stop string, not at max_new_tokens or the script's end of turn.
    assert len(result.token_ids) == len(result.text) + len("Observation:")
    again = runner.chat(ASK, stop=["Observation:"], max_new_tokens=100)
    assert again.usage.cached_tokens == again.usage.prompt_tokens - 1
    assert_quiescent(runner.cache)


def test_runner_chat_parses_tool_calls() -> None:
    result = runner_for("Searching.\n" + CALL).chat(ASK, TOOLS, max_new_tokens=200)
    assert result.finish_reason == "tool_calls"
    assert result.text == "Searching."
    assert result.tool_calls[0]["function"] == {"name": "search", "arguments": '{"q": "kv cache"}'}


def test_without_tools_a_call_is_plain_text() -> None:
    result = runner_for(CALL).chat(ASK, max_new_tokens=200)
    assert (result.text, result.tool_calls, result.finish_reason) == (CALL, (), "stop")


@pytest.mark.parametrize(
    "answer", ["plain answer, no call", "Searching.\n" + CALL, CALL, "<tool_call>{broken</tool_call>", "a <tool_ca b"]
)
def test_streamed_content_is_exactly_the_final_content(answer: str) -> None:
    pieces, done = streamed(runner_for(answer), ASK, TOOLS, max_new_tokens=200)
    assert "".join(pieces) == (done.content or "")
    assert "<tool_call>" not in "".join(pieces) or not done.tool_calls


def test_a_call_whose_arguments_hold_the_end_tag_is_a_call_streamed_too() -> None:
    call = '<tool_call>\n{"name": "search", "arguments": {"q": "</tool_call> in the docs"}}\n</tool_call>'
    pieces, done = streamed(runner_for("Looking.\n" + call), ASK, TOOLS, max_new_tokens=300)
    assert "".join(pieces) == done.content == "Looking."
    assert done.finish_reason == "tool_calls"
    assert json.loads(done.tool_calls[0]["function"]["arguments"]) == {"q": "</tool_call> in the docs"}


def test_stop_string_and_length_finish_reasons() -> None:
    pieces, done = streamed(runner_for("abcdefgh"), ASK, stop=["ef"], max_new_tokens=100)
    assert ("".join(pieces), done.finish_reason) == ("abcd", "stop")
    pieces, done = streamed(runner_for("abcdefgh"), ASK, max_new_tokens=3)
    assert ("".join(pieces), done.finish_reason, done.usage.generated_tokens) == ("abc", "length", 3)


def test_named_tool_choice_forces_the_call() -> None:
    require_extra("llguidance", "structured")  # a forced call is constrained by a grammar, or refused
    runner = runner_for(CALL)
    done = complete_chat(
        runner, ASK, TOOLS, tool_choice={"type": "function", "function": {"name": "search"}}, max_new_tokens=200
    )
    assert done.finish_reason == "tool_calls"
    assert done.tool_calls[0]["function"]["name"] == "search"


def test_a_named_tool_choice_whose_name_needs_json_escaping_still_parses() -> None:
    # The forced prefix used to write the name raw: '{"name": "say "hi"", ...' is not JSON, so the call came back
    # as text.
    require_extra("llguidance", "structured")
    name = 'say "hi"\\now'
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
    done = complete_chat(
        runner_for(f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {{"to": "you"}}}}\n</tool_call>'),
        ASK,
        tools,
        tool_choice={"type": "function", "function": {"name": name}},
        max_new_tokens=200,
    )
    assert done.finish_reason == "tool_calls"
    assert done.tool_calls[0]["function"] == {"name": name, "arguments": '{"to": "you"}'}


def test_closing_the_stream_early_releases_everything_and_caches_nothing() -> None:
    runner = runner_for("a long answer " * 20)
    steps = chat_stream(runner, ASK, max_new_tokens=200)
    next(steps)
    steps.close()
    assert_quiescent(runner.cache)
    assert runner.cache.stats().cached_tokens == 0


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"stop": [""]}, InvalidArgumentError),
        ({"tool_choice": "required"}, InvalidArgumentError),
        ({"tool_choice": "sometimes"}, InvalidArgumentError),
        ({"temperature": -1}, InvalidArgumentError),
        # Unknown sampling fields (what LangChain's invoke(..., logprobs=True) passes on) used to be a TypeError.
        ({"logprobs": True}, InvalidArgumentError),
        ({"n": 2}, InvalidArgumentError),
        # Tools that are not a list of objects: a TemplateError, not an AttributeError from a later check.
        ({"tools": ["search"]}, TemplateError),
        ({"tools": ["search"], "tool_choice": "required"}, TemplateError),
        ({"tools": TOOLS[0]}, TemplateError),
        ({"tools": [{"type": "function", "function": ["search"]}]}, TemplateError),
        ({"tools": [{"type": "function", "function": None, "name": "search"}]}, TemplateError),
        # Two tools of one name: the model's call would name either (OpenAI and the server refuse it too).
        ({"tools": [*TOOLS, *TOOLS]}, InvalidArgumentError),
        (
            {"tools": [TOOLS[0], {"type": "function", "function": {"name": "search"}}], "tool_choice": "auto"},
            InvalidArgumentError,
        ),
    ],
)
def test_bad_options_raise_before_touching_the_cache(options: dict, error: type) -> None:
    runner = runner_for("x")
    runner.chat(ASK)
    before = snapshot(runner.cache, [runner.namespace_key(None)])
    with pytest.raises(error):
        chat_stream(runner, ASK, **options)
    with pytest.raises(TemplateError):
        chat_stream(runner, [{"role": "assistant", "content": None}])
    assert snapshot(runner.cache, [runner.namespace_key(None)]) == before


def test_no_new_tokens_finishes_with_length_on_the_runner_and_the_engine() -> None:
    # max_new_tokens=0 generates nothing because of the token budget: OpenAI's "length", not the runner's internal
    # "prefill", which no OpenAI client knows.
    from prefixcache.engine.batching import BatchEngine
    from prefixcache.engine.chat import prepare_chat, submit_chat

    runner = runner_for("Hello.")
    completion = complete_chat(runner, ASK, max_new_tokens=0)
    assert (completion.content, completion.finish_reason, completion.token_ids) == ("", "length", ())
    engine = BatchEngine(runner)
    _, future = submit_chat(engine, prepare_chat(runner.tokenizer, ASK, max_new_tokens=0))
    engine.run_until_idle()
    assert future.result().finish_reason == "length"
    assert_quiescent(runner.cache)


@pytest.mark.parametrize(
    ("tool", "message"),
    [
        ({"type": "function", "function": {"parameters": {}}}, "tools[1].function.name must be a non-empty string"),
        ({"type": "function", "function": {"name": ""}}, "tools[1].function.name must be a non-empty string, got ''"),
        ({"name": 7, "parameters": {}}, "tools[1].name must be a non-empty string, got 7"),
    ],
)
def test_a_function_tool_without_a_name_is_refused_before_the_cache_is_touched(tool: dict, message: str) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["hi"]), cache_tokens=4096)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with pytest.raises(InvalidArgumentError, match=message.replace("[", r"\[").replace("]", r"\]")):
        runner.chat([{"role": "user", "content": "x"}], tools=[weather, tool])
    assert runner.cache.stats().cached_tokens == 0
    assert_quiescent(runner.cache)


def test_tools_of_other_kinds_named_elsewhere_or_not_at_all_still_render() -> None:
    # A logged request may carry OpenAI's custom tools (named in "custom") or hosted ones (no name): not functions the
    # model calls by name, so no name is asked of them.
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["hi"]), cache_tokens=4096)
    tools = [{"type": "custom", "custom": {"name": "code_exec"}}, {"type": "web_search_preview"}]
    assert runner.chat([{"role": "user", "content": "x"}], tools=tools).text == "hi"
