"""The scripted model of prefixcache.testing: follows its script, reads its context from the pool, stays exact."""

from __future__ import annotations

import pytest
import torch

from prefixcache import PrefixCachingRunner
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.models.base import CausalLM
from prefixcache.testing import ScriptedModel, assert_quiescent, greedy_reference

SCRIPT = ['<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', "done"]


def test_it_is_a_causal_lm_whose_answers_follow_the_script_turn_by_turn() -> None:
    model = ScriptedModel.from_texts(SCRIPT)
    assert isinstance(model, CausalLM)
    runner = PrefixCachingRunner(model, cache_tokens=4096)
    messages = [{"role": "system", "content": "s" * 50}, {"role": "user", "content": "go"}]
    first = runner.chat(messages, max_new_tokens=200)
    assert first.text == SCRIPT[0] and first.finish_reason == "stop"
    messages += [{"role": "assistant", "content": first.text}, {"role": "tool", "content": "ok"}]
    second = runner.chat(messages, max_new_tokens=200)
    assert second.text == "done"
    assert (
        second.usage.cached_tokens == len(runner.tokenizer.render_chat(messages[:3], add_generation_prompt=False)) - 2
    )
    messages += [{"role": "assistant", "content": second.text}, {"role": "user", "content": "more?"}]
    assert runner.chat(messages, max_new_tokens=200).text == ""  # past the script: end of turn at once
    assert_quiescent(runner.cache)


def test_cached_logits_equal_the_reference() -> None:
    model = ScriptedModel.from_texts(SCRIPT)
    runner = PrefixCachingRunner(model, cache_tokens=4096, block_size=4)
    tok = ByteTokenizer()
    prompt = tok.render_chat([{"role": "user", "content": "hello there"}])
    result = runner.generate(prompt, return_logits=True)
    again = runner.generate(prompt + list(result.token_ids[:5]), return_logits=True)
    reference_tokens, reference_logits = greedy_reference(model, prompt, len(result.token_ids))
    assert list(result.token_ids) == reference_tokens
    assert torch.equal(result.prompt_logits, reference_logits)
    assert again.usage.cached_tokens > len(prompt) - 4
    full = model.forward_reference(torch.tensor(prompt + list(result.token_ids[:5])))
    assert torch.equal(again.prompt_logits, full[-again.usage.prefilled_tokens :])


def test_a_block_holding_another_sequence_is_detected() -> None:
    model = ScriptedModel.from_texts(SCRIPT)
    kv = torch.zeros(1, 2, 4, 4, 1, 2)
    model.forward_cached(torch.arange(1, 10), 0, kv, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(RuntimeError, match="another sequence"):
        model.forward_cached(torch.tensor([10]), 9, kv, torch.tensor([1, 0, 2, 3]))
