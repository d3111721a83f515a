"""A runner restarted from a snapshot: the next agent turn hits everything before it, and its output is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixcache import PrefixCachingRunner, SamplingParams
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.errors import SnapshotCorruptError, SnapshotError, SnapshotMismatchError
from prefixcache.models.llama import LlamaModel, build_model

pytest.importorskip("safetensors", reason="needs: pip install 'prefixcache[snapshot]'")

GREEDY = SamplingParams(max_new_tokens=6)


def user_turn(text: str) -> list[int]:
    return ByteTokenizer().encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


SYSTEM = ByteTokenizer().encode("<|im_start|>system\nYou are a terse agent; call tools when needed.<|im_end|>\n")
TURNS = ["Find order 1234.", "Now check its shipping status.", "Refund it if it is late.", "Thanks. Anything else?"]


def agent_turns(runner: PrefixCachingRunner, num_turns: int) -> tuple[list[int], list]:
    """``num_turns`` turns of one conversation (each prompt = everything before + the new user turn); returns the
    conversation so far and the results."""
    conversation = list(SYSTEM)
    results = []
    for text in TURNS[:num_turns]:
        conversation += user_turn(text)
        result = runner.generate(conversation, GREEDY)
        results.append(result)
        conversation += list(result.token_ids)
    return conversation, results


def test_a_restarted_runner_hits_everything_before_the_fourth_turn(tiny: LlamaModel, tmp_path: Path) -> None:
    first = PrefixCachingRunner(tiny, cache_tokens=4096)
    conversation, results = agent_turns(first, 3)
    summary = first.save_snapshot(tmp_path / "snap")
    assert summary.num_tokens == first.cache.stats().cached_tokens > 0

    restarted = PrefixCachingRunner(build_model("tiny", device="cpu"), cache_tokens=4096)  # a new process's model
    loaded = restarted.load_snapshot(tmp_path / "snap")
    prompt = conversation + user_turn(TURNS[3])
    fourth = restarted.generate(prompt, GREEDY, return_logits=True)

    assert (loaded.num_tokens, loaded.skipped_nodes) == (summary.num_tokens, 0)
    # What the third turn inserted: its prompt and the tokens whose K/V were computed (all but the last generated).
    third = results[2]
    inserted = third.insert.num_new_tokens + third.insert.num_cached_tokens
    assert inserted == third.usage.prompt_tokens + len(third.token_ids) - 1
    assert fourth.usage.cached_tokens == inserted
    uncached = PrefixCachingRunner(tiny, cache_tokens=4096).generate(prompt, GREEDY, return_logits=True)
    assert uncached.usage.cached_tokens == 0
    assert fourth.token_ids == uncached.token_ids
    reference = tiny.forward_reference(torch.tensor(prompt), return_logits=True).float()
    assert float((fourth.prompt_logits - reference[inserted:]).abs().max()) < 1e-4
    restarted.cache.check_invariants()


def test_a_restarted_runner_continues_the_same_in_every_namespace(tiny: LlamaModel, tmp_path: Path) -> None:
    first = PrefixCachingRunner(tiny, cache_tokens=4096)
    first.generate(SYSTEM + user_turn("hi"), GREEDY, namespace="team-a")
    first.save_snapshot(tmp_path / "snap")
    restarted = PrefixCachingRunner(tiny, cache_tokens=4096)
    restarted.load_snapshot(tmp_path / "snap")

    assert restarted.generate(SYSTEM + user_turn("hi"), GREEDY, namespace="team-b").usage.cached_tokens == 0
    assert restarted.generate(SYSTEM + user_turn("hi"), GREEDY, namespace="team-a").usage.cached_tokens > len(SYSTEM)


def test_a_snapshot_of_other_weights_is_refused_and_the_cache_is_kept(tiny: LlamaModel, tmp_path: Path) -> None:
    first = PrefixCachingRunner(tiny, cache_tokens=4096)
    agent_turns(first, 1)
    first.save_snapshot(tmp_path / "snap")
    other = build_model("tiny", device="cpu")
    with torch.no_grad():
        other.lm_head.mul_(1.5)
    runner = PrefixCachingRunner(other, cache_tokens=4096)
    runner.prefill(SYSTEM)

    with pytest.raises(SnapshotMismatchError, match="model_fingerprint"):
        runner.load_snapshot(tmp_path / "snap")

    assert runner.generate(SYSTEM + [10], GREEDY).usage.cached_tokens == len(SYSTEM)


def test_a_snapshot_of_another_block_size_is_refused(tiny: LlamaModel, tmp_path: Path) -> None:
    first = PrefixCachingRunner(tiny, cache_tokens=4096)
    agent_turns(first, 1)
    first.save_snapshot(tmp_path / "snap")

    with pytest.raises(SnapshotMismatchError, match="block_size"):
        PrefixCachingRunner(tiny, cache_tokens=4096, block_size=8).load_snapshot(tmp_path / "snap")


def test_a_snapshot_saved_after_invalidate_is_refused(tiny: LlamaModel, tmp_path: Path) -> None:
    first = PrefixCachingRunner(tiny, cache_tokens=4096)
    first.invalidate()
    agent_turns(first, 1)
    first.save_snapshot(tmp_path / "snap")

    with pytest.raises(SnapshotMismatchError, match="cache_fingerprint"):
        PrefixCachingRunner(tiny, cache_tokens=4096).load_snapshot(tmp_path / "snap")


def test_a_damaged_snapshot_leaves_the_runner_cold_and_working(tiny: LlamaModel, tmp_path: Path) -> None:
    first = PrefixCachingRunner(tiny, cache_tokens=4096)
    conversation, _ = agent_turns(first, 2)
    first.save_snapshot(tmp_path / "snap")
    folder = tmp_path / "snap"
    kv = folder / (folder / "CURRENT").read_text().strip() / "kv.safetensors"
    kv.write_bytes(kv.read_bytes()[:-1])
    runner = PrefixCachingRunner(tiny, cache_tokens=4096)

    with pytest.raises(SnapshotCorruptError, match="truncated"):
        runner.load_snapshot(folder)

    assert runner.cache.stats().cached_tokens == 0
    assert runner.generate(conversation, GREEDY).usage.cached_tokens == 0


def test_a_smaller_runner_loads_the_most_recent_conversation(tiny: LlamaModel, tmp_path: Path) -> None:
    first = PrefixCachingRunner(tiny, cache_tokens=4096)
    old = first.generate(list(range(60, 160)), GREEDY)
    recent = first.generate(list(range(300, 400)) + [1], GREEDY)
    first.save_snapshot(tmp_path / "snap")
    small = PrefixCachingRunner(tiny, cache_tokens=112)  # 7 blocks: one conversation

    summary = small.load_snapshot(tmp_path / "snap")

    assert summary.skipped_tokens == old.usage.prompt_tokens + len(old.token_ids) - 1
    assert small.generate(list(range(300, 400)) + [1, 2], GREEDY).usage.cached_tokens == 101
    assert recent.usage.cached_tokens == 0


def test_loading_while_a_request_runs_is_refused(tiny: LlamaModel, tmp_path: Path) -> None:
    first = PrefixCachingRunner(tiny, cache_tokens=4096)
    agent_turns(first, 1)
    first.save_snapshot(tmp_path / "snap")
    steps = first.stream(SYSTEM + user_turn("more"), GREEDY)
    next(steps)

    with pytest.raises(SnapshotError, match="requests hold"):
        first.load_snapshot(tmp_path / "snap")

    steps.close()
    first.cache.check_invariants()
