"""Tools through a chat template that ignores them, over the OpenAI API (the real ``openai`` client, in-process): a
forced call from the random-weight tiny model comes back as ``tool_calls`` that validate, the next turn is served from
the cache up to the call's end, and a forced call without the grammar engine is a 400 naming the extra."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import openai
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.errors import install_command
from prefixcache.testing import assert_quiescent, require_extra

pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")
if os.environ.get("CI") != "true":
    pytest.importorskip("jsonschema", reason="needs: pip install 'prefixcache[test]'")
import jsonschema  # noqa: E402

from prefixcache.chat.hf_tokenizer import HFTokenizer  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "A forecast", "parameters": WEATHER}}]
ASK = [{"role": "system", "content": "You check the weather."}, {"role": "user", "content": "Paris, 3 days?"}]


@pytest.fixture
def served(make_app, asgi_client, tiny_model, single_byte_dir: Path):
    """``(runner, client)``: the tiny model behind a tokenizer whose template ignores tools, served in-process."""
    runner = PrefixCachingRunner(tiny_model, HFTokenizer(single_byte_dir), cache_tokens=8192)
    return runner, asgi_client(make_app(runner, model_name="tiny"))


def test_a_required_call_validates_and_its_next_turn_is_cached_to_the_calls_end(served) -> None:
    require_extra("llguidance", "structured")
    runner, client = served

    async def main():
        first = await client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=1.0, seed=3
        )
        [call] = first.choices[0].message.tool_calls
        result = {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}
        history = [*ASK, first.choices[0].message.model_dump(exclude_none=True), result]
        second = await client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=1)
        return first, history, second

    first, history, second = asyncio.run(main())
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # Every token up to the end of the call, the first prompt's and the generated ones, comes from the cache.
    tokenizer = runner.tokenizer
    again = tokenizer.render_chat(history, TOOLS)
    call_end = again.index(tokenizer.special_token_id("<|im_end|>"), len(tokenizer.render_chat(ASK, TOOLS)))
    assert second.usage.prompt_tokens == len(again)
    assert second.usage.prompt_tokens_details.cached_tokens == call_end
    assert call_end == first.usage.prompt_tokens + first.usage.completion_tokens - 1  # all but the end of turn
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_without_the_grammar_engine_is_a_400_naming_the_extra(served, monkeypatch, tool_choice) -> None:
    runner, client = served
    monkeypatch.setitem(sys.modules, "llguidance", None)  # as where the structured extra is not installed
    call = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice)
    with pytest.raises(openai.BadRequestError) as refused:
        asyncio.run(call)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["message"].startswith("tool_choice ") and install_command("structured") in error["message"]
    assert_quiescent(runner.cache)
