"""Specification of recurrent-state modelling in replay (``--state-bytes``): a prefix resumes only where a state is
kept, so hits fall short of full attention exactly where no state sits, and the shortfall says by how much."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pytest

from prefixcache.cache.tokens import TOKEN_TYPECODE
from prefixcache.cli import main
from prefixcache.errors import InvalidArgumentError
from prefixcache.replay.replayer import Replayer, ReplayRequest
from prefixcache.replay.report import format_replay
from prefixcache.replay.results import ReplayReport

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "scenarios" / "multi_turn_chat.jsonl"
BS = 16
STATE = 1000


def tokens(start: int, n: int) -> array:
    return array(TOKEN_TYPECODE, range(start, start + n))


# Two users share a 40-token system prompt S; user a comes back for a second turn.
#   a1: S + U1 (50 tokens), answer A1 (10)     b1: S + U2 (50), answer 10     a2: S + U1 + A1 + U3 (70)
SYSTEM, U1, U2, U3, A1 = tokens(0, 40), tokens(100, 10), tokens(200, 10), tokens(300, 10), tokens(400, 10)
REQUESTS = [
    ReplayRequest("chat", "a", 1, SYSTEM + U1, A1),
    ReplayRequest("chat", "b", 1, SYSTEM + U2, tokens(500, 10)),
    ReplayRequest("chat", "a", 2, SYSTEM + U1 + A1 + U3, tokens(600, 10)),
]
PROMPT_TOKENS = 50 + 50 + 70


def replay(**kwargs):
    return Replayer(None, block_size=BS, **kwargs).replay("chat", REQUESTS)


def test_full_attention_hits_the_shared_system_prompt_and_the_previous_turn() -> None:
    report = replay()
    assert report.cached_tokens == 0 + 40 + 60
    assert report.resume_shortfall_tokens == 0 and report.num_states == 0


def test_states_at_prompt_and_answer_ends_resume_the_next_turn_but_not_the_shared_system_prompt_at_first() -> None:
    report = replay(state_bytes=STATE, state_every=0)
    # b1 matches S (40 tokens) but no state sits inside it; a2 resumes at the end of a1's answer (60).
    assert report.cached_tokens == 0 + 0 + 60
    assert report.resume_shortfall_tokens == 40
    assert report.hit_rate == pytest.approx(60 / PROMPT_TOKENS)
    # Kept: before each prompt's last token, the end of each prompt and answer (a1 49, 50, 60; b1 49, 50, 60;
    # a2 69, 70, 80), and at 40, where b1 left a1's prompt (a branch mark).  The default (a state every 16 blocks)
    # puts none inside prompts this short.
    assert (report.num_states, report.state_bytes, report.evicted_states) == (10, 10 * STATE, 0)
    assert replay(state_bytes=STATE).cached_tokens == report.cached_tokens


def test_the_third_user_behind_a_shared_system_prompt_resumes_at_its_end() -> None:
    third = ReplayRequest("chat", "c", 1, SYSTEM + tokens(700, 10), tokens(800, 10))
    report = Replayer(None, block_size=BS, state_bytes=STATE, state_every=0).replay("chat", [*REQUESTS, third])
    # b1 marked 40 and kept a state there as its prefill passed it: c1 resumes all of S, as full attention would.
    assert report.cached_tokens == 0 + 0 + 60 + 40
    assert report.resume_shortfall_tokens == 40
    full = Replayer(None, block_size=BS).replay("chat", [*REQUESTS, third])
    assert full.cached_tokens == 0 + 40 + 60 + 40


def test_states_every_block_inside_prompts_resume_at_the_last_boundary_inside_the_shared_part() -> None:
    report = replay(state_bytes=STATE, state_every=1)
    # a1 keeps states at 16, 32 and 48 as well: b1 resumes at 32 (8 of its 40 matched tokens short).
    assert report.cached_tokens == 0 + 32 + 60
    assert report.resume_shortfall_tokens == 8


def test_states_every_four_blocks_add_nothing_to_prompts_shorter_than_that() -> None:
    assert replay(state_bytes=STATE, state_every=4).cached_tokens == 60


def test_a_budget_of_one_state_keeps_only_the_latest_and_the_next_turn_resumes_from_zero() -> None:
    report = replay(state_bytes=STATE, state_every=0, max_state_bytes=STATE)
    # Each new state evicts the one before: b1's states take the place of a1's answer state.  a2, cut back to 0,
    # passes b1's mark at 40 (and marks nothing at 60, the end of a1's sequence that it extends): it puts 4 states
    # (40, 69, 70, 80), a1 3, b1 4 (40, 49, 50, 60).
    assert report.cached_tokens == 0
    assert report.resume_shortfall_tokens == 40 + 60
    assert (report.num_states, report.evicted_states) == (1, 10)


def test_the_table_and_json_give_the_shortfall_and_the_states() -> None:
    report = ReplayReport([replay(state_bytes=STATE)], state_bytes=STATE)
    table = format_replay(report)
    assert "shortfall" in table and "states kept" in table and "recurrent model" in table
    out = report.to_json()
    assert (out["resume_shortfall_tokens"], out["num_states"], out["recurrent_state_bytes"]) == (40, 10, STATE)


@pytest.mark.parametrize(
    "kwargs",
    [{"state_every": 2}, {"max_state_bytes": 10}, {"state_bytes": -1}, {"state_bytes": 10, "state_every": -1}],
)
def test_bad_state_options_are_refused(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        Replayer(None, **kwargs)


def test_state_bytes_with_a_host_tier_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="host tier"):
        Replayer(None, state_bytes=10, host_cache_tokens=1000)


def cli(*args: object) -> int:
    return main(["replay", *map(str, args), "--no-progress"])


def test_cli_state_bytes_needs_no_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(CHAT, "--state-bytes", "1MiB") == 2
    assert "--no-model" in capsys.readouterr().err


def test_cli_recurrent_replay_hits_at_most_full_attention(tmp_path: Path) -> None:
    full, recurrent = tmp_path / "full.json", tmp_path / "recurrent.json"
    assert cli(CHAT, "--no-model", "--json", full) == 0
    assert cli(CHAT, "--no-model", "--state-bytes", "37.7MiB", "--state-every", "4", "--json", recurrent) == 0
    full_report, recurrent_report = json.loads(full.read_text()), json.loads(recurrent.read_text())
    assert recurrent_report["recurrent_state_bytes"] == int(37.7 * 2**20)
    assert recurrent_report["cached_tokens"] <= full_report["cached_tokens"]
    assert (
        recurrent_report["cached_tokens"] + recurrent_report["resume_shortfall_tokens"] == full_report["cached_tokens"]
    )


def test_cli_recurrent_replay_predicts_no_speculation_and_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full, recurrent = tmp_path / "full.json", tmp_path / "recurrent.json"
    assert cli(CHAT, "--no-model", "--json", full) == 0
    assert cli(CHAT, "--no-model", "--state-bytes", "1MiB", "--json", recurrent) == 0
    assert json.loads(full.read_text()).get("speculation")  # full attention: predicted by default
    assert not json.loads(recurrent.read_text()).get("speculation")  # a recurrent model never speculates
    capsys.readouterr()
    assert cli(CHAT, "--no-model", "--state-bytes", "1MiB", "--speculate", "tree") == 2
    assert "a recurrent model never verifies" in capsys.readouterr().err
