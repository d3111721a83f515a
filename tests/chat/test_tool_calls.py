"""Parsing generated ``<tool_call>`` blocks into OpenAI tool calls, and writing calls back as the templates do."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.chat.tool_calls import ParsedOutput, parse_tool_calls, render_tool_call

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def test_a_call_becomes_an_openai_tool_call_with_json_string_arguments() -> None:
    parsed = parse_tool_calls(CALL)
    assert parsed.content is None
    assert parsed.finish_reason == "tool_calls"
    [call] = parsed.tool_calls
    assert call["type"] == "function"
    assert call["id"].startswith("call_") and len(call["id"]) == 21
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}


def test_text_before_the_calls_is_the_content_and_every_block_is_a_call() -> None:
    text = "Let me check both.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo")
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me check both."
    assert [json.loads(c["function"]["arguments"])["city"] for c in parsed.tool_calls] == ["Paris", "Oslo"]
    assert parsed.tool_calls[0]["id"] != parsed.tool_calls[1]["id"]


def test_missing_arguments_count_as_an_empty_object() -> None:
    [call] = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>').tool_calls
    assert call["function"]["arguments"] == "{}"


def test_text_without_a_call_is_content() -> None:
    parsed = parse_tool_calls("The weather is fine.")
    assert parsed == parse_tool_calls("The weather is fine.")
    assert (parsed.content, parsed.tool_calls, parsed.finish_reason) == ("The weather is fine.", (), None)


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n',  # never closed
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "city=Paris"}\n</tool_call>',  # arguments not an object
        '<tool_call>\n["f"]\n</tool_call>',
        CALL + " and then some words",  # text after the calls
        CALL + "\nbetween\n" + CALL,
        "<tool_call>" + "[" * 10000 + "</tool_call>",  # nesting too deep for json
    ],
)
def test_a_malformed_call_comes_back_as_the_text_the_model_wrote(text: str) -> None:
    parsed = parse_tool_calls(text)
    assert parsed.content == text
    assert parsed.tool_calls == ()
    assert parsed.finish_reason is None


def test_arguments_holding_the_end_tag_stay_in_their_call() -> None:
    # A file-editing tool writing docs about tool calls: the parser used to cut at the first </tool_call>.
    arguments = {"path": "docs/tools.md", "text": "Wrap each call in <tool_call>...</tool_call> tags."}
    text = "Editing.\n" + render_tool_call({"name": "write_file", "arguments": arguments}) + "\n" + CALL
    parsed = parse_tool_calls(text)
    assert parsed.content == "Editing."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["write_file", "get_weather"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == arguments


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {}} trailing\n</tool_call>',  # text between object and end tag
        '<tool_call>\n{"name": "f", "arguments": {"t": "</tool_call>"}}\n',  # the end tag only inside a string
        '<tool_call>\n{"name": "f", "arguments": {"t": "</tool_call>"}\n</tool_call>',  # the object never closes
    ],
)
def test_the_end_tag_must_follow_the_object(text: str) -> None:
    assert parse_tool_calls(text) == ParsedOutput(text, ())


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["text", "old", "new"]),
        st.lists(st.sampled_from(["</tool_call>", "<tool_call>", "x", '"', "\\", "\n", "}"]), max_size=6).map("".join),
        max_size=3,
    )
)
def test_any_string_in_the_arguments_parses_back(arguments: dict) -> None:
    parsed = parse_tool_calls(render_tool_call({"name": "edit", "arguments": arguments}))
    [call] = parsed.tool_calls
    assert json.loads(call["function"]["arguments"]) == arguments


def test_call_ids_are_deterministic_per_salt() -> None:
    assert parse_tool_calls(CALL, id_salt="a") == parse_tool_calls(CALL, id_salt="a")
    assert (
        parse_tool_calls(CALL, id_salt="a").tool_calls[0]["id"]
        != parse_tool_calls(CALL, id_salt="b").tool_calls[0]["id"]
    )


def test_render_writes_what_the_model_generates() -> None:
    call = {
        "id": "x",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":2}'},
    }
    assert render_tool_call(call) == CALL
    assert render_tool_call({"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}) == CALL


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(
    name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True),
    arguments=st.dictionaries(st.text(max_size=6), _JSON, max_size=4),
    content=st.text(max_size=20).filter(lambda s: "<tool_call>" not in s),
)
def test_a_rendered_call_parses_back_to_the_same_call(name: str, arguments: dict, content: str) -> None:
    text = content + "\n" + render_tool_call({"name": name, "arguments": arguments})
    parsed = parse_tool_calls(text)
    [call] = parsed.tool_calls
    assert call["function"]["name"] == name
    assert json.loads(call["function"]["arguments"]) == arguments
    assert parsed.content == (content.rstrip() or None)
    assert render_tool_call(call) == render_tool_call({"name": name, "arguments": arguments})


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/tool_call{}":, name arguments[]x1\n')), max_size=80))
def test_parsing_never_raises_and_keeps_all_text_when_it_finds_no_call(text: str) -> None:
    parsed = parse_tool_calls(text)
    if not parsed.tool_calls:
        assert parsed.content == text


@pytest.mark.parametrize(
    "arguments",
    [
        '{"text": "\\ud800"}',  # a lone surrogate escape: used to raise UnicodeEncodeError (a 500 on the server)
        '{"x": NaN}',  # NaN, Infinity and numbers past float range are not JSON: used to pass as "arguments"
        '{"x": -Infinity}',
        '{"x": 1e999}',
    ],
)
def test_a_call_that_is_not_strict_utf8_json_stays_text_and_never_raises(arguments: str) -> None:
    text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    assert parse_tool_calls(text) == parse_tool_calls(text, id_salt="x") == ParsedOutput(text, ())


def test_a_surrogate_in_the_name_stays_text() -> None:
    text = '<tool_call>\n{"name": "f\\udc00", "arguments": {}}\n</tool_call>'
    assert parse_tool_calls(text).tool_calls == ()
