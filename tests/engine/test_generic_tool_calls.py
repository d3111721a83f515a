"""Tool calls through a chat template that ignores tools, end to end on the in-process runner: the random-weight tiny
model, forced to call, writes a call that parses and validates; the next turn, with the call and its result in the
history, is served from the cache for every token before the result.  A forced call without the grammar engine is
refused, naming the extra."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from prefixcache.testing import require_extra

pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")
if os.environ.get("CI") != "true":
    pytest.importorskip("jsonschema", reason="needs: pip install 'prefixcache[test]'")
import jsonschema  # noqa: E402

from prefixcache import PrefixCachingRunner  # noqa: E402
from prefixcache.chat.generic_tools import tools_block  # noqa: E402
from prefixcache.chat.hf_tokenizer import HFTokenizer  # noqa: E402
from prefixcache.engine.chat import complete_chat, prepare_chat  # noqa: E402
from prefixcache.errors import InvalidArgumentError, install_command  # noqa: E402
from prefixcache.models.llama import LlamaModel  # noqa: E402
from prefixcache.testing import assert_quiescent  # noqa: E402

# Enums and bounded integers: what the model may write re-renders byte for byte (a free string may be written with
# escapes that json.dumps writes otherwise).
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
UNITS = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}
UNITS["additionalProperties"] = False
SCHEMAS = {"get_weather": WEATHER, "set_units": UNITS}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ASK = [{"role": "system", "content": "You check the weather."}, {"role": "user", "content": "Paris, 3 days?"}]
NAMED = {"type": "function", "function": {"name": "set_units"}}


@pytest.fixture(scope="module")
def tokenizer(single_byte_dir: Path) -> HFTokenizer:
    return HFTokenizer(single_byte_dir)


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_a_forced_call_validates_and_the_next_turn_is_served_from_the_cache(
    tiny: LlamaModel, tokenizer: HFTokenizer, tool_choice
) -> None:
    require_extra("llguidance", "structured")
    prompt = tokenizer.render_chat(ASK, TOOLS)
    assert tools_block(TOOLS) in tokenizer.decode(prompt)  # the template alone would have dropped the tools
    for seed in range(3):
        runner = PrefixCachingRunner(tiny, tokenizer, cache_tokens=8192)  # fresh: a repeated call would be cached too
        first = complete_chat(
            runner, ASK, TOOLS, tool_choice=tool_choice, temperature=1.0, seed=seed, max_new_tokens=120
        )
        assert first.finish_reason == "tool_calls"
        [call] = first.tool_calls
        name = call["function"]["name"]
        assert name == "set_units" or tool_choice == "required"
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
        said = {"role": "assistant", "content": first.content, "tool_calls": [call]}
        result = {"role": "tool", "tool_call_id": call["id"], "content": "done"}
        second = complete_chat(runner, [*ASK, said, result], TOOLS, max_new_tokens=1)
        # The turn's prompt extends the first prompt and every generated id, the end of turn included; all of them
        # but that last id (whose K/V generation never computes) come from the cache.
        earlier = prompt + list(first.token_ids)
        assert earlier[-1] == tokenizer.special_token_id("<|im_end|>")
        again = tokenizer.render_chat([*ASK, said, result], TOOLS)
        assert again[: len(earlier)] == earlier
        assert second.usage.cached_tokens == len(earlier) - 1
        assert_quiescent(runner.cache)


@pytest.mark.parametrize(("tool_choice", "named"), [("required", "'required'"), (NAMED, "naming function 'set_units'")])
def test_a_forced_call_without_the_grammar_engine_is_refused(monkeypatch, tokenizer, tool_choice, named) -> None:
    # As where the structured extra is not installed: llguidance cannot be imported.
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(InvalidArgumentError) as refused:
        prepare_chat(tokenizer, ASK, TOOLS, tool_choice=tool_choice)
    assert str(refused.value) == (
        f"tool_choice {named} forces a call that follows the function's parameters: structured outputs need the "
        f"llguidance package: {install_command('structured')}"
    )
    assert prepare_chat(tokenizer, ASK, TOOLS, tool_choice="auto").sampling.grammar is None  # auto still runs
