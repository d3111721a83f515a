"""Specification of the agent benchmark on a tiny Qwen2 with the real Qwen tokenizer and tau-bench conversations:
the four ways produce the uncached greedy tokens, the accounting adds up, and prefixcache prefills the least."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from prefixcache.bench import agent  # noqa: E402

needs_data = pytest.mark.skipif(
    not (agent.QWEN_DIR.is_dir() and (agent.DATA_DIR / "tau_bench_airline_tools.json").is_file())
    and os.environ.get("CI") != "true",
    reason=f"shared data not found under {agent.DATA_DIR} (CI=true makes this an error)",
)

SETUP = agent.AgentSetup(layers=None, conversations=2, steps=6, max_new_tokens=4, system_tokens=900)


@pytest.fixture(scope="module")
def result():
    return agent.run(setup=SETUP)


@needs_data
def test_every_step_of_every_conversation_is_measured_four_ways(result) -> None:
    steps = result.data["steps"]
    assert len(steps) == SETUP.conversations * SETUP.steps
    assert {(s["conversation"], s["step"]) for s in steps} == {(c, n) for c in range(2) for n in range(1, 7)}
    for s in steps:
        for clock in ("cpu_s", "wall_s", "prefill_s"):
            assert set(s[clock]) == {"a", "b", "c", "d"} and all(v > 0 for v in s[clock].values())
        assert all(s["prefill_s"][way] <= s["cpu_s"][way] for way in "abcd")
        assert len(s["output"]) == SETUP.max_new_tokens or s["output"][-1] in _eos()


@needs_data
def test_prompt_tokens_are_either_cached_or_prefilled(result) -> None:
    system_tokens = result.data["description"]["system_tokens"]
    assert 600 <= system_tokens <= SETUP.system_tokens + 64  # policy cut to the budget, plus the first user header
    for s in result.data["steps"]:
        for way in "abcd":
            assert s["cached_tokens"][way] + s["prefilled_tokens"][way] == s["prompt_tokens"]
        assert s["cached_tokens"]["a"] == 0
        assert s["cached_tokens"]["b"] == system_tokens
        for way in "cd":
            assert s["cached_tokens"][way] >= system_tokens or (s["step"] == 1 and s["conversation"] == 0)
    description = result.data["description"]
    assert 0 <= description["d_accepted_tokens"] <= description["d_drafted_tokens"]


@needs_data
def test_later_steps_reuse_the_whole_previous_prompt(result) -> None:
    by_key = {(s["conversation"], s["step"]): s for s in result.data["steps"]}
    for (conv, step), s in by_key.items():
        if step > 1:
            previous = by_key[(conv, step - 1)]["prompt_tokens"]
            assert s["cached_tokens"]["c"] >= previous - 1
    totals = result.data["summary"]["all"]["totals"]
    assert totals["c"]["prefilled_tokens"] < totals["b"]["prefilled_tokens"] < totals["a"]["prefilled_tokens"]


@needs_data
def test_outputs_equal_uncached_greedy_decoding(result) -> None:
    tokenizer, model = _tokenizer_and_model()
    _, prompts = agent.load_workload(tokenizer, SETUP)
    for s in result.data["steps"][:4]:
        sequence = list(prompts[s["conversation"]][s["step"] - 1])
        assert len(sequence) == s["prompt_tokens"]
        for token in s["output"]:
            expected = int(model.forward_reference(torch.tensor(sequence))[-1].argmax())
            assert token == expected
            sequence.append(token)


def test_common_prefix_stops_at_the_first_difference() -> None:
    assert agent._common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == [1, 2]
    assert agent._common_prefix([[7, 8], [7, 8, 9]]) == [7, 8]


def _tokenizer_and_model():
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    tokenizer = HFTokenizer(agent.QWEN_DIR)
    return tokenizer, agent.build_agent_model(SETUP, tokenizer.vocab_size)


def _eos() -> set[int]:
    from prefixcache.chat.hf_tokenizer import HFTokenizer

    return set(HFTokenizer(agent.QWEN_DIR).eos_token_ids)
