"""Assistant messages with ``tool_calls`` and ``tool`` messages through the byte-level and Hugging Face templates."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from prefixcache.chat.template import render_text
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.errors import TemplateError

QWEN_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "tokenizers" / "qwen2.5-0.5b-instruct"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def call(name: str, arguments: str, call_id: str = "call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def transcript(tool: str = "get_weather", city: str = "Paris") -> list[dict]:
    return [
        {"role": "system", "content": "You help travellers."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call(tool, f'{{"city":"{city}"}}')]},
        {"role": "tool", "tool_call_id": "call_1", "name": tool, "content": '{"temp_c": 18}'},
        {"role": "assistant", "content": "18 °C and sunny."},
    ]


def qwen():
    if not QWEN_DIR.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"Qwen tokenizer folder missing at {QWEN_DIR}")
        pytest.skip(f"Qwen tokenizer folder not found at {QWEN_DIR}")
    pytest.importorskip("transformers")
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    return HFTokenizer(QWEN_DIR)


EXPECTED_CALL = (
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    "<|im_end|>\n"
)


def test_byte_template_renders_the_call_as_qwen_does() -> None:
    text = render_text(transcript(), TOOLS, add_generation_prompt=False)
    assert EXPECTED_CALL in text
    assert '<|im_start|>tool\n{"temp_c": 18}<|im_end|>\n' in text


def test_content_and_calls_together() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call("get_weather", "{}")]},
    ]
    assert render_text(messages, add_generation_prompt=False).endswith(
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
        "<|im_end|>\n"
    )


def test_qwen_template_renders_the_same_call_text() -> None:
    tok = qwen()
    text = tok.decode(tok.render_chat(transcript(), TOOLS, add_generation_prompt=False))
    assert EXPECTED_CALL in text
    assert '<tool_response>\n{"temp_c": 18}\n</tool_response>' in text


@pytest.mark.parametrize("which", ["byte", "qwen"])
def test_conversations_differing_only_in_the_tool_called_diverge_at_the_call(which: str) -> None:
    tok = ByteTokenizer() if which == "byte" else qwen()
    a = tok.render_chat(transcript("get_weather"), TOOLS, add_generation_prompt=False)
    b = tok.render_chat(transcript("get_forecast"), TOOLS, add_generation_prompt=False)
    c = tok.render_chat(transcript("get_weather", "Oslo"), TOOLS, add_generation_prompt=False)
    prefix = tok.render_chat(transcript()[:2], TOOLS, add_generation_prompt=True)
    for other in (b, c):
        common = next(i for i, (x, y) in enumerate(zip(a, other, strict=False)) if x != y)
        # They share the history before the call and nothing from the call on.
        assert (
            len(prefix) <= common <= len(prefix) + len('<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
        )
        assert a[common:] != other[common:]


@pytest.mark.parametrize("which", ["byte", "qwen"])
def test_prompt_plus_call_answer_is_a_prefix_of_the_next_prompt(which: str) -> None:
    tok = ByteTokenizer() if which == "byte" else qwen()
    messages = transcript()
    prompt = tok.render_chat(messages[:2], TOOLS, add_generation_prompt=True)
    generated = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    answer = tok.encode(generated) if which == "byte" else tok.tokenizer.encode(generated, add_special_tokens=False)
    next_prompt = tok.render_chat(messages[:4], TOOLS, add_generation_prompt=True)
    assert next_prompt[: len(prompt) + len(answer)] == prompt + answer


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ({"role": "assistant", "content": None}, r"content of type NoneType"),
        ({"role": "assistant", "content": None, "tool_calls": []}, r"content of type NoneType"),
        ({"role": "user", "content": "x", "tool_calls": [call("f", "{}")]}, r"only assistant messages"),
        ({"role": "assistant", "content": None, "tool_calls": {"name": "f"}}, r"must be a list"),
        ({"role": "assistant", "content": None, "tool_calls": [call("", "{}")]}, r"no function name"),
        ({"role": "assistant", "content": None, "tool_calls": [call("f", "{oops")]}, r"not JSON"),
        ({"role": "assistant", "content": None, "tool_calls": [call("f", "[1]")]}, r"must be a JSON object"),
    ],
)
def test_bad_tool_calls_are_template_errors(message: dict, match: str) -> None:
    with pytest.raises(TemplateError, match=match):
        render_text([{"role": "user", "content": "hi"}, message])
