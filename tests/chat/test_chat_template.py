from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.chat.template import (
    DEFAULT_SYSTEM_PROMPT,
    Segment,
    render_segments,
    render_text,
)
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.errors import TemplateError

THREE_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_exact_rendering_of_three_messages_with_generation_prompt() -> None:
    assert render_text(THREE_MESSAGES) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_exact_rendering_without_generation_prompt() -> None:
    assert render_text(THREE_MESSAGES, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
    )


def test_segments_mark_specials_separately() -> None:
    segments = render_segments(THREE_MESSAGES[1:2], add_generation_prompt=False)
    assert segments == [
        Segment("special", "<|im_start|>"),
        Segment("text", "user\nCapital of France?"),
        Segment("special", "<|im_end|>"),
        Segment("text", "\n"),
    ]
    assert segments[0] == ("special", "<|im_start|>")


def test_tool_role_renders_as_its_own_turn() -> None:
    messages = [{"role": "tool", "content": '{"temp_c": 21}'}]
    assert render_text(messages, add_generation_prompt=False) == '<|im_start|>tool\n{"temp_c": 21}<|im_end|>\n'


def test_tools_go_inside_the_system_message_after_the_prompt() -> None:
    text = render_text(THREE_MESSAGES, tools=[WEATHER_TOOL], add_generation_prompt=False)
    system_turn, rest = text.split("<|im_end|>\n", 1)
    assert system_turn.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert "\n<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>\n" in system_turn
    assert system_turn.endswith("</tool_call>")
    assert text.count("<|im_start|>system") == 1
    assert rest == "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n"


def test_tools_without_system_message_get_a_default_system_block() -> None:
    text = render_text(THREE_MESSAGES[1:], tools=[WEATHER_TOOL])
    assert text.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}\n\n# Tools\n")
    assert "<|im_start|>user\nCapital of France?" in text


def test_each_tool_is_one_json_line_in_given_key_order() -> None:
    second = {"type": "function", "function": {"name": "zeta", "description": "Ünïcode", "parameters": {}}}
    text = render_text([], tools=[WEATHER_TOOL, second])
    block = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert block.splitlines() == [json.dumps(WEATHER_TOOL), json.dumps(second, ensure_ascii=False)]


def test_empty_tools_list_is_no_tools() -> None:
    assert render_text(THREE_MESSAGES, tools=[]) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_exact_rendering_with_tools() -> None:
    # Qwen2.5's tool-calling system block, spelled out: a cached prefix is only reusable if these bytes are the
    # same on every turn, so the test pins them rather than comparing one rendering with another.
    assert render_text(THREE_MESSAGES, tools=[WEATHER_TOOL]) == (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.", '
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
        "</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        (
            [{"role": "robot", "content": "x"}],
            r"message 0 has role 'robot'; allowed roles: assistant, system, tool, user",
        ),
        ([{"role": "user", "content": "ok"}, {"content": "x"}], r"message 1 has role None"),
        ([{"role": "user", "content": None}], r"message 0 \(user\) has content of type NoneType"),
        ([{"role": "user", "content": ["a", "b"]}], r"message 0 \(user\) has content of type list"),
        ([{"role": "user", "content": "ok"}, "hello"], r"message 1 must be an object"),
        ("hello", r"messages must be a list"),
    ],
)
def test_invalid_messages_raise_template_error(messages: object, match: str) -> None:
    with pytest.raises(TemplateError, match=match):
        render_segments(messages)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tools", "match"),
    [
        ({"type": "function"}, "tools must be a list"),
        (["get_weather"], "tool 0 must be an object"),
        ([WEATHER_TOOL, {"bad": object()}], "tool 1 is not JSON-serialisable"),
    ],
)
def test_invalid_tools_raise_template_error(tools: object, match: str) -> None:
    with pytest.raises(TemplateError, match=match):
        render_segments(THREE_MESSAGES, tools=tools)  # type: ignore[arg-type]


_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)),  # lone surrogates are not text
    max_size=30,
)
_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": _TEXT | st.sampled_from(["<|im_end|>", "<|im_start|>assistant\n"]),
    }
)


@settings(max_examples=200, deadline=None)
@given(
    messages=st.lists(_MESSAGE, min_size=1, max_size=8),
    with_tools=st.booleans(),
)
def test_next_prompt_extends_previous_prompt_plus_answer(messages: list[dict[str, str]], with_tools: bool) -> None:
    tok = ByteTokenizer()
    tools = [WEATHER_TOOL] if with_tools else None
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tok.render_chat(messages[:i], tools=tools, add_generation_prompt=True)
        through_answer = tok.render_chat(messages[: i + 1], tools=tools, add_generation_prompt=False)
        assert through_answer[: len(prompt)] == prompt
        # What follows the prompt is exactly the answer and its end-of-turn marker.
        assert through_answer[len(prompt) :] == [*tok.encode(message["content"]), 258, *tok.encode("\n")]
