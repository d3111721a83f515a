"""Tool calls over a real server on 127.0.0.1 (a free port) with the real ``openai`` client: arguments holding the
text ``</tool_call>`` stay in their call, plain and streamed, and a forced call's next turn (the Qwen2.5 tokenizer)
is cached like a free call's."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.serve import start_background
from prefixcache.testing import ScriptedModel, assert_quiescent, require_extra

DOCS = "Each call goes in <tool_call>...</tool_call> tags.\n"
EDIT = {"name": "write_file", "arguments": {"path": "docs/tools.md", "text": DOCS}}
CALL = f"<tool_call>\n{json.dumps(EDIT)}\n</tool_call>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {key: {"type": "string"} for key in keys}},
        },
    }
    for name, keys in (("write_file", ("path", "text")), ("get_weather", ("city",)))
]
MESSAGES = [{"role": "system", "content": "You edit files. " * 10}, {"role": "user", "content": "Document calls."}]


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_arguments_holding_the_end_tag_are_a_call_plain_and_streamed(make_app) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["Editing.\n" + CALL]), cache_tokens=8192)
    with start_background(make_app(runner), "127.0.0.1", 0) as server:
        client = client_for(server)
        plain = client.chat.completions.create(model="scripted", messages=MESSAGES, tools=TOOLS, max_tokens=300)
        chunks = list(
            client.chat.completions.create(
                model="scripted", messages=MESSAGES, tools=TOOLS, max_tokens=300, stream=True
            )
        )
    message = plain.choices[0].message
    assert (message.content, plain.choices[0].finish_reason) == ("Editing.", "tool_calls")
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("write_file", EDIT["arguments"])
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(delta.content or "" for delta in deltas) == "Editing."
    [streamed] = [call for delta in deltas for call in delta.tool_calls or ()]
    assert streamed.function.model_dump() == call.function.model_dump()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert_quiescent(runner.cache)


def test_a_forced_calls_next_turn_is_cached_like_a_free_calls(make_app, qwen_dir: Path) -> None:
    pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")
    require_extra("llguidance", "structured")  # a forced call is constrained by a grammar, or refused
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    qwen = HFTokenizer(qwen_dir)
    finished = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{"function": EDIT}]}]
    prompt = qwen.render_chat(MESSAGES, TOOLS, add_generation_prompt=True)
    whole = qwen.render_chat(finished, TOOLS, add_generation_prompt=False)
    end = qwen.special_token_id("<|im_end|>")
    answer = whole[len(prompt) : whole.index(end, len(prompt))]  # the call, as the template renders it
    forcings = {"auto": "auto", "named": {"type": "function", "function": {"name": "write_file"}}}
    cached = {}
    for way, tool_choice in forcings.items():
        marker = [qwen.special_token_id("<|im_start|>"), *qwen.encode("assistant\n")]
        model = ScriptedModel([answer], turn_marker=marker, end_token_id=end, vocab_size=qwen.vocab_size)
        runner = PrefixCachingRunner(model, qwen, cache_tokens=8192)
        with start_background(make_app(runner), "127.0.0.1", 0) as server:
            client = client_for(server)
            first = client.chat.completions.create(
                model="scripted", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=300
            )
            [call] = first.choices[0].message.tool_calls
            assert json.loads(call.function.arguments) == EDIT["arguments"]
            result = {"role": "tool", "tool_call_id": call.id, "content": "written"}
            follow_up = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True), result]
            second = client.chat.completions.create(model="scripted", messages=follow_up, tools=TOOLS, max_tokens=1)
            cached[way] = second.usage.prompt_tokens_details.cached_tokens
        assert_quiescent(runner.cache)
    # Every token of the first turn's prompt and call: the forced prefix used to end on a lone space token.
    assert cached == {"auto": len(prompt) + len(answer), "named": len(prompt) + len(answer)}
