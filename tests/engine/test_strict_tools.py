"""``strict: true`` tools under ``tool_choice`` ``"auto"``: nothing is constrained before the model opens a call; once
it writes ``<tool_call>`` the call follows its function's ``parameters`` schema.  With the random-weight tiny model
(nudged to open a call) every call it makes validates, where without ``strict`` it writes no call at all."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from prefixcache.testing import require_extra  # noqa: E402

require_extra("llguidance", "structured")
if os.environ.get("CI") != "true":
    pytest.importorskip("jsonschema", reason="needs: pip install 'prefixcache[test]'")
import jsonschema  # noqa: E402

from prefixcache import PrefixCachingRunner  # noqa: E402
from prefixcache.chat.tokenizer import ByteTokenizer  # noqa: E402
from prefixcache.engine.chat import complete_chat, prepare_chat  # noqa: E402
from prefixcache.engine.grammar import Grammar  # noqa: E402
from prefixcache.models.llama import LlamaModel  # noqa: E402
from prefixcache.testing import ScriptedModel, assert_quiescent  # noqa: E402

TOKENIZER = ByteTokenizer()
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
UNITS = {
    "type": "object",
    "properties": {"unit": {"enum": ["C", "F"]}},
    "required": ["unit"],
    "additionalProperties": False,
}


def tools(strict: bool) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": "get_weather", "strict": strict, "parameters": WEATHER}},
        {"type": "function", "function": {"name": "set_units", "strict": strict, "parameters": UNITS}},
    ]


SCHEMAS = {"get_weather": WEATHER, "set_units": UNITS}
ASK = [{"role": "system", "content": "You check the weather."}, {"role": "user", "content": "Paris, 3 days?"}]
OPENING = TOKENIZER.encode("Let me look. <tool_call>")


class Opens:
    """The random-weight model, nudged to open a tool call: while the answer so far is a prefix of ``OPENING``, the
    next byte of it gets +1000 (past it, the model's own logits).  Serves one sequence at a time (a serial runner):
    it keeps the tokens it has seen by position."""

    def __init__(self, model: LlamaModel, prompt_length: int) -> None:
        self.model, self.prompt_length = model, prompt_length
        self.seen: dict[int, int] = {}
        for name in ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_position", "dtype", "device"):
            setattr(self, name, getattr(model, name))

    def fingerprint(self) -> str:
        return self.model.fingerprint()

    def weights_version(self) -> int | None:
        return self.model.weights_version()

    def forward_cached(self, token_ids: torch.Tensor, start_pos: int, *args: Any, **options: Any) -> torch.Tensor:
        logits = self.model.forward_cached(token_ids, start_pos, *args, **options).clone()
        self.seen.update(zip(range(start_pos, start_pos + token_ids.numel()), token_ids.tolist(), strict=True))
        end = start_pos + token_ids.numel()
        answer = [self.seen[p] for p in range(self.prompt_length, end)]
        if len(answer) < len(OPENING) and answer == OPENING[: len(answer)]:
            logits[-1, OPENING[len(answer)]] += 1000.0
        return logits

    def forward_reference(self, token_ids: torch.Tensor, **options: Any) -> torch.Tensor:
        return self.model.forward_reference(token_ids, **options)


def test_a_strict_auto_call_follows_its_schema_and_text_is_free(tiny: LlamaModel) -> None:
    made = {True: 0, False: 0}
    for strict in (True, False):
        prompt_length = len(TOKENIZER.render_chat(ASK, tools(strict), add_generation_prompt=True))
        runner = PrefixCachingRunner(Opens(tiny, prompt_length), cache_tokens=8192)
        for seed in range(8):
            done = complete_chat(
                runner, ASK, tools(strict), tool_choice="auto", temperature=1.0, seed=seed, max_new_tokens=160
            )
            assert TOKENIZER.decode(list(done.token_ids)).startswith("Let me look. <tool_call>")
            for call in done.tool_calls:
                name = call["function"]["name"]
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
                made[strict] += 1
            if strict and done.finish_reason == "tool_calls":
                assert done.content == "Let me look."
        assert_quiescent(runner.cache)
    assert made[True] >= 4  # most strict answers end in a valid call
    assert made[False] == 0  # the random model alone never writes one


def test_strict_tools_under_auto_get_the_lazy_grammar_and_others_none() -> None:
    strict = prepare_chat(TOKENIZER, ASK, tools(True), tool_choice="auto").sampling.grammar
    assert strict == Grammar.tool_calls(tools(True), TOKENIZER) and strict.kind == "tool_calls"
    assert prepare_chat(TOKENIZER, ASK, tools(False), tool_choice="auto").sampling.grammar is None
    assert prepare_chat(TOKENIZER, ASK, tools(True), tool_choice="none").sampling.grammar is None
    forced = prepare_chat(TOKENIZER, ASK, tools(True), tool_choice="required").sampling.grammar
    assert forced.kind == "tool_call"
    formatted = prepare_chat(TOKENIZER, ASK, tools(True), response_format={"type": "json_object"})
    assert formatted.sampling.grammar.kind == "json_object"  # the answer's format takes precedence


def test_a_scripted_call_off_its_schema_is_steered_onto_it() -> None:
    # The script writes a call whose days is a string: strict, the grammar refuses the quote and the model (all other
    # logits equal) picks the smallest id allowed instead; the call parses and validates.
    arguments = '{"city": "Paris", "days": "3", "metric": true}'
    bad = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    for strict, valid in ((True, True), (False, False)):
        runner = PrefixCachingRunner(ScriptedModel.from_texts([bad]), cache_tokens=8192)
        done = complete_chat(runner, ASK, tools(strict), tool_choice="auto", max_new_tokens=200)
        [call] = done.tool_calls
        arguments = json.loads(call["function"]["arguments"])
        assert jsonschema.Draft202012Validator(WEATHER).is_valid(arguments) is valid
        assert arguments["city"] == "Paris"
        assert_quiescent(runner.cache)
