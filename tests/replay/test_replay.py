"""Specification of replay: transcripts become teacher-forced requests that extend each other, interleave as
concurrent users, and run through a cache whose hits match an infinite cache's exactly when nothing is evicted."""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Sequence
from pathlib import Path

import pytest

from prefixcache import RadixCache
from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.errors import (
    CapacityError,
    InvalidArgumentError,
    ScenarioError,
    VerificationError,
)
from prefixcache.models import LlamaModel
from prefixcache.replay.replayer import (
    Replayer,
    ReplayReport,
    ReplayRequest,
    ScenarioReport,
    conversation_requests,
    interleave,
    load_requests,
    replay_paths,
)
from prefixcache.replay.scenarios import Conversation
from prefixcache.testing import ShiftedLogits

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((ROOT / "scenarios").glob("*.jsonl"))
SHARED_FILES = ["tau_bench_airline_gpt4o.jsonl", "mtbench_31models.jsonl", "oasst_en100_tree_paths.jsonl"]
SLOW = os.environ.get("PREFIXCACHE_SLOW_TESTS") == "1"


def message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def write_lines(path: Path, lines: Sequence[object]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def conversation_line(conversation_id: str, *turns: str, system: str = "Be brief.") -> dict:
    """A transcript line: a system message, then alternating user and assistant messages from ``turns``."""
    roles = ["user", "assistant"] * len(turns)
    return {"id": conversation_id, "messages": [message("system", system)] + list(map(message, roles, turns))}


TWO_TURNS = Conversation(
    id="c",
    messages=(
        message("system", "Be brief."),
        message("user", "Hi"),
        message("assistant", "Hello!"),
        message("user", "Bye"),
        message("assistant", "Ciao"),
    ),
    tools=None,
    source="hand-made",
    line_no=1,
)


def test_one_request_per_assistant_turn() -> None:
    requests = conversation_requests(TWO_TURNS, ByteTokenizer(), "s")

    assert [(r.scenario, r.conversation_id, r.turn) for r in requests] == [("s", "c", 2), ("s", "c", 4)]


def test_request_token_lengths_follow_the_chatml_template() -> None:
    # A message costs len(role) + len(content) + 4 tokens (<|im_start|>, "\n", <|im_end|>, "\n"); the generation
    # prompt 11 (<|im_start|> "assistant\n"); an answer len(content) + 2 (<|im_end|> "\n").
    requests = conversation_requests(TWO_TURNS, ByteTokenizer(), "s")

    assert [len(r.prompt) for r in requests] == [19 + 10 + 11, 40 + 8 + 11 + 11]
    assert [len(r.answer) for r in requests] == [8, 6]


def test_answer_is_the_assistant_message_and_its_end_of_turn() -> None:
    requests = conversation_requests(TWO_TURNS, ByteTokenizer(), "s")

    assert ByteTokenizer().decode(requests[0].answer) == "Hello!<|im_end|>\n"


def test_next_prompt_starts_with_prompt_and_answer_of_the_previous_turn() -> None:
    first, second = conversation_requests(TWO_TURNS, ByteTokenizer(), "s")

    assert second.prompt[: len(first.prompt) + len(first.answer)] == first.prompt + first.answer
    assert (first.drift_at, second.drift_at) == (None, None)


class TurnCountingTokenizer(ByteTokenizer):
    """Writes the number of rendered messages at token 3, as a template that stamps the turn would."""

    __slots__ = ()

    def render_chat(self, messages, tools=None, add_generation_prompt=True):  # type: ignore[override]
        ids = super().render_chat(messages, tools, add_generation_prompt)
        ids[3] = len(messages)
        return ids


def test_prompt_not_extending_the_previous_turn_is_marked_with_its_drift_point() -> None:
    first, second = conversation_requests(TWO_TURNS, TurnCountingTokenizer(), "s")

    assert (first.drift_at, second.drift_at) == (None, 3)


def fake_requests(conversation_id: str, turns: int) -> list[ReplayRequest]:
    empty = array(TOKEN_TYPECODE)
    return [ReplayRequest("s", conversation_id, turn, array(TOKEN_TYPECODE, [turn]), empty) for turn in range(turns)]


PER_CONVERSATION = [fake_requests("a", 3), fake_requests("b", 1), fake_requests("c", 2)]


def names(requests: Sequence[ReplayRequest]) -> list[str]:
    return [f"{r.conversation_id}{r.turn}" for r in requests]


def test_round_robin_takes_each_conversations_next_turn_in_turn() -> None:
    assert names(interleave(PER_CONVERSATION, "round-robin", 0)) == ["a0", "b0", "c0", "a1", "c1", "a2"]


def test_file_order_keeps_each_conversation_whole() -> None:
    assert names(interleave(PER_CONVERSATION, "file", 0)) == ["a0", "a1", "a2", "b0", "c0", "c1"]


def test_random_order_is_a_permutation_keeping_each_conversations_turn_order() -> None:
    for seed in range(20):
        order = names(interleave(PER_CONVERSATION, "random", seed))

        assert sorted(order) == ["a0", "a1", "a2", "b0", "c0", "c1"]
        for conversation in "abc":
            turns = [name for name in order if name[0] == conversation]
            assert turns == sorted(turns)


def test_random_order_is_fixed_by_the_seed() -> None:
    assert interleave(PER_CONVERSATION, "random", 7) == interleave(PER_CONVERSATION, "random", 7)


def test_random_order_varies_with_the_seed() -> None:
    orders = {tuple(names(interleave(PER_CONVERSATION, "random", seed))) for seed in range(20)}

    assert len(orders) > 3


def test_unknown_order_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="sideways"):
        interleave(PER_CONVERSATION, "sideways", 0)


def test_load_requests_interleaves_conversations_round_robin(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "s.jsonl", [conversation_line("x", "1", "a", "2", "b"), conversation_line("y", "3", "c")]
    )

    requests, skipped = load_requests(path, ByteTokenizer())

    assert [(r.conversation_id, r.turn) for r in requests] == [("x", 2), ("y", 2), ("x", 4)]
    assert skipped == 0


def test_load_requests_limit_keeps_the_first_conversations(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "s.jsonl", [conversation_line(c, "q", "a") for c in "xyz"])

    requests, _ = load_requests(path, ByteTokenizer(), limit=2)

    assert [r.conversation_id for r in requests] == ["x", "y"]


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_unlimited_cache_hits_what_an_infinite_cache_would(path: Path) -> None:
    report = replay_paths([path], Replayer(None)).scenarios[0]

    assert report.requests > 0
    assert report.evictions == 0
    assert report.cached_tokens == report.ideal_cached_tokens


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.name for p in SCENARIOS])
def test_report_counts_every_prompt_token_once(path: Path) -> None:
    requests, _ = load_requests(path, ByteTokenizer())

    report = replay_paths([path], Replayer(None)).scenarios[0]

    assert report.requests == len(requests)
    assert report.prompt_tokens == sum(len(r.prompt) for r in requests)
    assert report.cached_tokens + report.prefilled_tokens == report.prompt_tokens


def longest_request(path: Path) -> int:
    requests, _ = load_requests(path, ByteTokenizer())
    return max(len(r.prompt) + len(r.answer) for r in requests)


def test_small_cache_evicts_and_hits_at_most_the_ideal() -> None:
    # The longest request plus one block, for the private copy of a block matched part-way.
    path = ROOT / "scenarios" / "multi_turn_chat.jsonl"
    cache_tokens = longest_request(path) + 16

    report = replay_paths([path], Replayer(None, cache_tokens=cache_tokens)).scenarios[0]

    assert (report.requests, report.num_blocks) == (28, -(-cache_tokens // 16))
    assert report.evictions > 0
    assert report.cached_tokens <= report.ideal_cached_tokens


def test_request_log_has_openai_usage_per_request() -> None:
    path = ROOT / "scenarios" / "few_shot.jsonl"

    report = replay_paths([path], Replayer(None), log_requests=True)

    log = report.requests_log
    assert len(log) == report.scenarios[0].requests
    assert sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in log) == report.scenarios[0].cached_tokens
    for record in log:
        usage = record["usage"]
        assert usage["prefilled_tokens"] + usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]


def test_each_scenario_file_gets_a_fresh_cache(tmp_path: Path) -> None:
    line = conversation_line("x", "same question", "same answer")
    first, second = write_lines(tmp_path / "a.jsonl", [line]), write_lines(tmp_path / "b.jsonl", [line])

    report = replay_paths([first, second], Replayer(None))

    assert [s.cached_tokens for s in report.scenarios] == [0, 0]


def test_total_row_sums_the_scenarios() -> None:
    paths = SCENARIOS[:3]

    report = replay_paths(paths, Replayer(None))

    total = report.total
    for name in ("requests", "prompt_tokens", "cached_tokens", "prefilled_tokens", "ideal_cached_tokens"):
        assert getattr(total, name) == sum(getattr(s, name) for s in report.scenarios)


def test_report_json_has_the_documented_keys() -> None:
    path = ROOT / "scenarios" / "few_shot.jsonl"

    out = replay_paths([path], Replayer(None)).to_json()

    keys = set(REPORT_KEYS)
    assert keys <= out.keys()
    assert keys <= out["scenarios"][str(path)].keys()
    assert out["hit_rate"] == out["cached_tokens"] / out["prompt_tokens"]


def test_report_totals_without_uncached_timing() -> None:
    report = ReplayReport([ScenarioReport("a", prefill_s_cached=0.5)])

    assert report.total.prefill_s_uncached is None


REPORT_KEYS = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "prefilled_tokens",
    "copied_tokens",
    "ideal_cached_tokens",
    "evictions",
    "hit_rate",
    "verified",
)


def test_a_replay_that_verified_no_request_gives_no_verdict(tiny: LlamaModel) -> None:
    # An interrupted --verify run can end before its first request: "verified: yes" would claim what was not done.
    path = ROOT / "scenarios" / "edit_earlier_message.jsonl"

    report = replay_paths([path], Replayer(tiny, block_size=16, verify=True), limit=0)

    assert report.total.requests == 0
    assert report.scenarios[0].verified is None and report.total.verified is None
    assert report.to_json()["verified"] is None


def test_replay_with_the_model_verifies_and_hits_the_ideal(tiny: LlamaModel) -> None:
    path = ROOT / "scenarios" / "edit_earlier_message.jsonl"

    report = replay_paths([path], Replayer(tiny, block_size=16, verify=True), limit=1).scenarios[0]

    assert report.requests == 5
    assert report.verified is True
    assert report.max_abs_logit_diff < 1e-4
    assert report.cached_tokens == report.ideal_cached_tokens > 0
    assert report.prefill_s_cached > 0 and report.prefill_s_uncached > 0


def test_edited_conversations_reuse_up_to_the_edit(tiny: LlamaModel, tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "edit.jsonl",
        [
            conversation_line("original", "Plan a day in Lisbon.", "Start at Belem.", "Add lunch.", "Try bacalhau."),
            conversation_line("edited", "Plan a day in Lisbon.", "Start at Belem.", "Add dinner.", "Try sardines."),
        ],
    )

    report = replay_paths([path], Replayer(tiny, block_size=4, verify=True), order="file").scenarios[0]

    assert report.verified is True
    assert report.cached_tokens == report.ideal_cached_tokens
    assert report.copied_tokens > 0


def test_verify_raises_when_cached_logits_differ_from_the_reference(tiny: LlamaModel, tmp_path: Path) -> None:
    path = write_lines(tmp_path / "s.jsonl", [conversation_line("x", "Hi", "Hello")])

    with pytest.raises(VerificationError, match="conversation x turn 2"):
        replay_paths([path], Replayer(ShiftedLogits(tiny), verify=True))


def test_verify_needs_a_model() -> None:
    with pytest.raises(InvalidArgumentError):
        Replayer(None, verify=True)


class KeepsCache(Replayer):
    """A Replayer that remembers the cache of its last replay, so a test can inspect it."""

    def _make_cache(self, requests, ideal_hits):  # type: ignore[override]
        runner, self.cache = super()._make_cache(requests, ideal_hits)
        return runner, self.cache


def request(conversation_id: str, prompt: list[int], answer: list[int]) -> ReplayRequest:
    return ReplayRequest("s", conversation_id, 1, array(TOKEN_TYPECODE, prompt), array(TOKEN_TYPECODE, answer))


@pytest.mark.parametrize("with_model", [False, True], ids=["no_model", "tiny_model"])
def test_request_longer_than_the_pool_is_a_capacity_error_and_the_cache_stays_consistent(
    tiny: LlamaModel, with_model: bool
) -> None:
    replayer = KeepsCache(tiny if with_model else None, block_size=4, cache_tokens=32, measure_uncached=False)
    fits = request("a", list(range(10, 20)), [1, 2, 3])

    with pytest.raises(CapacityError):
        replayer.replay("s", [fits, request("b", list(range(40)), [])])

    cache: RadixCache = replayer.cache
    cache.check_invariants()
    assert cache.stats().locked_tokens == 0
    assert cache.stats().cached_tokens == 13


BAD_LINES = {
    "not_json": "{not json",
    "not_an_object": "[1, 2]",
    "no_messages": json.dumps({"id": "n"}),
    "unknown_role": json.dumps({"messages": [message("wizard", "hi")]}),
    "content_not_a_string": json.dumps({"messages": [{"role": "user", "content": 7}]}),
}


@pytest.mark.parametrize("bad", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_bad_line_is_a_scenario_error_naming_file_and_line(tmp_path: Path, bad: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [conversation_line("ok", "q", "a"), bad])

    with pytest.raises(ScenarioError) as error:
        replay_paths([path], Replayer(None))

    assert (error.value.path, error.value.line_no) == (str(path), 2)
    assert str(error.value).startswith(f"{path}:2: ")


def test_skip_invalid_replays_the_good_lines_and_counts_the_bad(tmp_path: Path) -> None:
    lines = [conversation_line("a", "q", "a"), BAD_LINES["not_json"], conversation_line("b", "q", "a", "r", "b")]
    path = write_lines(tmp_path / "bad.jsonl", lines + [BAD_LINES["unknown_role"]])

    report = replay_paths([path], Replayer(None), skip_invalid=True).scenarios[0]

    assert (report.requests, report.skipped_lines) == (3, 2)


def test_missing_scenario_file_is_a_scenario_error(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="absent.jsonl: not found: no such file or folder"):
        replay_paths([tmp_path / "absent.jsonl"], Replayer(None))


@pytest.mark.parametrize("name", SHARED_FILES)
def test_shared_transcripts_hit_what_an_infinite_cache_would(shared_data, name: str) -> None:
    report = replay_paths([shared_data(name)], Replayer(None)).scenarios[0]

    assert report.requests > 0
    assert report.evictions == 0
    assert report.cached_tokens == report.ideal_cached_tokens > 0


@pytest.mark.skipif(
    not SLOW,
    reason="the 20-conversation tau-bench replay on the 4-layer Qwen2 (285 requests, 1.65M prompt tokens), each "
    "request verified by a full uncached forward: hours on 2 CPU cores; set PREFIXCACHE_SLOW_TESTS=1 to run",
)
def test_shared_agent_trajectories_verify_with_the_model(shared_data, qwen_dir: Path) -> None:
    pytest.importorskip("transformers")
    from prefixcache.chat.hf_tokenizer import HFTokenizer
    from prefixcache.models.hf import random_model_from_config

    path = shared_data("tau_bench_airline_gpt4o.jsonl")
    model = random_model_from_config(qwen_dir / "config.json", layers=4)
    replayer = Replayer(model, HFTokenizer(qwen_dir), verify=True)

    report = replay_paths([path], replayer, limit=20).scenarios[0]

    assert report.verified is True
    assert report.requests == 285
    assert report.cached_tokens == report.ideal_cached_tokens > 0
