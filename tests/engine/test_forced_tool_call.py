"""A forced tool call (``tool_choice`` required or named) with the Qwen2.5 tokenizer: the forced ids end on a token
boundary of the template's own rendering of the finished call, so the next turn is cached like a free call's; a strict
tool's call under ``"auto"`` is constrained and still the template's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from prefixcache import PrefixCachingRunner  # noqa: E402
from prefixcache.chat.hf_tokenizer import HFTokenizer  # noqa: E402
from prefixcache.engine.chat import complete_chat, prepare_chat  # noqa: E402
from prefixcache.testing import ScriptedModel, assert_quiescent, require_extra  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ASK = [{"role": "system", "content": "You are a weather assistant."}, {"role": "user", "content": "Weather in Paris?"}]
CALL = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
FORCING = {
    "auto": "auto",
    "required": "required",
    "named": {"type": "function", "function": {"name": "get_weather"}},
}


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> HFTokenizer:
    return HFTokenizer(qwen_dir)


def answer_ids(qwen: HFTokenizer) -> list[int]:
    """The ids the template renders for the assistant's call, between the generation prompt and ``<|im_end|>``."""
    prompt = qwen.render_chat(ASK, TOOLS, add_generation_prompt=True)
    finished = qwen.render_chat([*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]}], TOOLS, False)
    assert finished[: len(prompt)] == prompt
    answer = finished[len(prompt) :]
    return answer[: answer.index(qwen.special_token_id("<|im_end|>"))]


def scripted_runner(qwen: HFTokenizer) -> PrefixCachingRunner:
    """A runner whose model writes the call exactly as the template renders it, after whatever was forced."""
    marker = [qwen.special_token_id("<|im_start|>"), *qwen.encode("assistant\n")]
    model = ScriptedModel(
        [answer_ids(qwen)],
        turn_marker=marker,
        end_token_id=qwen.special_token_id("<|im_end|>"),
        vocab_size=qwen.vocab_size,
    )
    return PrefixCachingRunner(model, qwen, cache_tokens=4096)


@pytest.mark.parametrize("forcing", ["required", "named"])
def test_the_forced_ids_are_a_prefix_of_the_templates_rendering_of_the_call(qwen: HFTokenizer, forcing: str) -> None:
    # The named prefix used to end in '"arguments": ' with a lone space token, where the template writes ' {"'.
    require_extra("llguidance", "structured")  # a forced call is constrained by a grammar, or refused
    forced = prepare_chat(qwen, ASK, TOOLS, tool_choice=FORCING[forcing]).prompt_ids
    prompt = qwen.render_chat(ASK, TOOLS, add_generation_prompt=True)
    assert len(forced) > len(prompt)
    assert forced == (prompt + answer_ids(qwen))[: len(forced)]


@pytest.mark.parametrize("forcing", ["required", "named"])
def test_a_forced_calls_next_turn_is_cached_like_a_free_calls(qwen: HFTokenizer, forcing: str) -> None:
    require_extra("llguidance", "structured")
    cached = {}
    for way in ("auto", forcing):
        runner = scripted_runner(qwen)
        first = complete_chat(runner, ASK, TOOLS, tool_choice=FORCING[way], max_new_tokens=64)
        assert first.finish_reason == "tool_calls"
        [call] = first.tool_calls
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assistant = {"role": "assistant", "content": first.content, "tool_calls": [call]}
        result = {"role": "tool", "tool_call_id": call["id"], "content": "18 C, sunny"}
        # The next turn's answer does not matter: one token is enough to read its prompt's cached tokens.
        cached[way] = complete_chat(runner, [*ASK, assistant, result], TOOLS, max_new_tokens=1).usage.cached_tokens
        assert_quiescent(runner.cache)
    expected = len(qwen.render_chat(ASK, TOOLS, add_generation_prompt=True)) + len(answer_ids(qwen))
    assert cached == {"auto": expected, forcing: expected}


def test_a_strict_tools_call_under_auto_is_the_templates_own_and_the_next_turn_hits_it(qwen: HFTokenizer) -> None:
    pytest.importorskip("llguidance")
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    prompt = qwen.render_chat(ASK, strict, add_generation_prompt=True)
    prepared = prepare_chat(qwen, ASK, strict, tool_choice="auto")
    assert prepared.sampling.grammar.kind == "tool_calls" and prepared.prompt_ids == prompt
    # Every id of the template's rendering of the call is allowed in turn, and the end of turn after it.
    state = prepared.sampling.grammar.start()
    stops = prepared.sampling.stop_token_ids
    for token in answer_ids(qwen):
        assert state.allowed(qwen.vocab_size, stops, torch.device("cpu"))[token], qwen.decode([token])
        state.accept(token, stops)
    assert state.allowed(qwen.vocab_size, stops, torch.device("cpu"))[qwen.special_token_id("<|im_end|>")]
    runner = scripted_runner(qwen)
    first = complete_chat(runner, ASK, strict, tool_choice="auto", max_new_tokens=64)
    assert first.finish_reason == "tool_calls" and first.token_ids[:-1] == tuple(answer_ids(qwen))
    [call] = first.tool_calls
    assistant = {"role": "assistant", "content": first.content, "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": call["id"], "content": "18 C, sunny"}
    cached = complete_chat(runner, [*ASK, assistant, result], strict, max_new_tokens=1).usage.cached_tokens
    assert cached == len(prompt) + len(answer_ids(qwen))
    assert_quiescent(runner.cache)
