"""The replay's prediction of speculative decoding: exact tokens per step on hand-built transcripts, the command line's
line and JSON, and ``--sweep`` untouched."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.cli import main
from prefixcache.cli.replay import SPECULATE_CHOICES
from prefixcache.engine import draft
from prefixcache.engine.draft import ContextIndex, Drafter, DraftLength
from prefixcache.errors import InvalidArgumentError
from prefixcache.replay import replayer
from prefixcache.replay.replayer import Replayer, ReplayRequest
from prefixcache.replay.speculate import DEFAULT_VERIFY_COST, SPECULATE_MODES, SpeculationTally, parse_verify_cost

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "scenarios" / "multi_turn_chat.jsonl"


def _request(conversation: str, prompt: list[int], answer: list[int]) -> ReplayRequest:
    return ReplayRequest("s", conversation, 1, array("I", prompt), array("I", answer))


def test_an_answer_copied_from_its_prompt_takes_two_forwards() -> None:
    # Step 1: nothing before 9 to match, one token (5).  Step 2: the 5 matches at prompt position 4, the draft
    # 6 7 8 9 5 agrees on four tokens, then the model's own 10: five tokens.
    request = _request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 10])
    tally = Replayer(None, block_size=4, speculate="context", verify_cost=(1.0,)).replay("s", [request]).speculation
    assert (tally.answer_tokens, tally.steps, tally.tokens_per_step) == (6, 2, 3.0)
    assert (tally.context_steps, tally.context_tokens, tally.proposed_tokens, tally.accepted_tokens) == (1, 5, 5, 4)
    assert tally.speedup == 3.0 and tally.adaptive_tokens_per_step == 3.0


def test_a_draft_from_an_earlier_requests_cached_blocks() -> None:
    first = _request("a", [1, 2, 3, 4, 5, 6, 7, 8], [20, 21, 22, 23, 24, 25, 26, 27])  # 8 steps: nothing to copy
    second = _request("b", [9, 9, 9, 20], [21, 22, 23, 30])  # 20 was followed by 21.. in the cache: one step
    report = Replayer(None, block_size=4, speculate="tree", verify_cost=(1.0,)).replay("s", [first, second])
    tally = report.speculation
    assert (tally.answer_tokens, tally.steps, tally.tree_steps, tally.tree_tokens) == (12, 9, 1, 4)
    assert tally.tokens_per_step == pytest.approx(12 / 9)
    context_only = Replayer(None, block_size=4, speculate="context", verify_cost=(1.0,))
    assert context_only.replay("s", [first, second]).speculation.steps == 12


def test_a_costly_verify_is_charged_per_draft_length() -> None:
    request = _request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 10])
    tally = Replayer(None, block_size=4, speculate="context", verify_cost=(1.0, 2.0)).replay("s", [request]).speculation
    assert tally.cost == 1.0 + 2.0  # one step without a draft, one verifying 5 draft tokens
    assert tally.speedup == 2.0


def test_speculation_is_off_by_default_in_the_library_and_the_modes_match_the_cli() -> None:
    request = _request("a", [1, 2, 3], [1, 2])
    assert Replayer(None).replay("s", [request]).speculation is None
    assert SPECULATE_CHOICES == SPECULATE_MODES
    assert parse_verify_cost("1.5,2") == (1.0, 1.5, 2.0)
    with pytest.raises(InvalidArgumentError):
        parse_verify_cost("1,x")
    with pytest.raises(InvalidArgumentError):
        parse_verify_cost("0")


def test_the_replay_prints_and_writes_the_prediction(tmp_path: Path, capsys) -> None:
    out = tmp_path / "report.json"
    assert main(["replay", str(CHAT), "--no-model", "--no-progress", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tok/step" in printed and "answer tokens per verify step" in printed
    assert "projected decode speed-up" in printed
    report = json.loads(out.read_text())
    assert report["speculate"] == "tree" and report["speculation"]["tokens_per_step"] > 1
    assert report["scenarios"][str(CHAT)]["speculation"]["answer_tokens"] == report["speculation"]["answer_tokens"]
    assert main(["replay", str(CHAT), "--no-model", "--no-progress", "--speculate", "off"]) == 0
    assert "verify step" not in capsys.readouterr().out
    assert main(["replay", str(CHAT), "--no-model", "--no-progress", "--verify-cost", "1,1,x"]) == 2
    assert main(["replay", str(CHAT), "--no-model", "--no-progress", "--speculate", "off", "--verify-cost", "1"]) == 2


def test_the_sweep_prints_no_prediction(capsys) -> None:
    assert main(["replay", str(CHAT), "--sweep", "--no-progress", "--no-token-cache", "--no-belady"]) == 0
    printed = capsys.readouterr().out
    assert "verify step" not in printed and "tok/step" not in printed


class _StepByStep:
    """The reference: each request's context indexed afresh, then per answer token a lookup and a push, the
    verification played with next_budget and update."""

    def __init__(self, requests, mode="tree", verify_cost=DEFAULT_VERIFY_COST, max_draft_tokens=8) -> None:
        self.verify_cost = DraftLength(max_draft_tokens, verify_cost).costs
        self.drafter = Drafter(max_draft_tokens, use_tree=mode == "tree")
        self.tally = SpeculationTally()

    def run(self, request, namespace=None) -> None:
        answer, tally, costs = request.answer.tolist(), self.tally, self.verify_cost
        if not answer:
            return
        index = ContextIndex(self.drafter.ngram_sizes, request.prompt)
        drafts = []
        for i, token in enumerate(answer):
            proposal = self.drafter.lookup(index, namespace, self.drafter.max_draft_tokens)
            run = 0
            for expected, drafted in zip(answer[i:], proposal.tokens, strict=False):
                if expected != drafted:
                    break
                run += 1
            drafts.append((len(proposal), run, proposal.source == "context"))
            index.push(token)
        end, i = len(answer), 0
        tally.requests += 1
        tally.answer_tokens += end
        while i < end:
            drafted, run, from_context = drafts[i]
            produced = min(run + 1, end - i) if drafted else 1
            tally.steps += 1
            tally.cost += costs[drafted]
            if drafted:
                tally.proposed_tokens += drafted
                tally.accepted_tokens += run
                tally.context_steps += from_context
                tally.context_tokens += produced if from_context else 0
                tally.tree_steps += not from_context
                tally.tree_tokens += 0 if from_context else produced
            i += produced
        length, i = DraftLength(self.drafter.max_draft_tokens, costs), 0
        while i < end:
            drafted, run, _ = drafts[i]
            k = min(drafted, length.next_budget())
            accepted = min(run, k)
            tally.adaptive_steps += 1
            tally.adaptive_cost += costs[k]
            tally.adaptive_proposed_tokens += k
            length.update(k, accepted)
            i += min(accepted + 1, end - i)


small = st.lists(st.integers(0, 5), max_size=12)


@settings(max_examples=40, deadline=None)
@given(small, st.lists(st.lists(st.tuples(small, small), min_size=1, max_size=4), min_size=1, max_size=4),
       st.sampled_from([None, 128, 256]), st.sampled_from(["tree", "context"]))  # fmt: skip
def test_the_speculator_tallies_as_a_lookup_per_answer_token(
    system: list[int], conversations: list, cache_tokens: int | None, mode: str
) -> None:
    requests = []
    for c, turns in enumerate(conversations):
        context = [*system, 100 + c]
        for turn, (user, answer) in enumerate(turns):
            request = ReplayRequest("s", f"c{c}", turn, array("I", context + user), array("I", answer))
            requests.append(request)
            context = context + user + answer
    requests.sort(key=lambda r: r.turn)  # round robin, as the replay orders them
    options = {"block_size": 4, "cache_tokens": cache_tokens, "speculate": mode, "verify_cost": DEFAULT_VERIFY_COST}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(draft, "SHARED_PREFIX_MIN_TOKENS", 4)  # the conversations share the system prefix
        fast = Replayer(None, **options).replay("s", requests).speculation
        patch.setattr(replayer, "Speculator", _StepByStep)
        assert fast == Replayer(None, **options).replay("s", requests).speculation


@pytest.mark.parametrize("text", ["0.5", "1e-300", "0", "-1", "inf", "abc", ""])
def test_a_verify_cost_below_one_decode_step_or_not_a_number_is_refused(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="--verify-cost"):
        parse_verify_cost(text)


@pytest.mark.parametrize(("text", "charged"), [("1", (1.0,) * 9), ("1,2", (1.0, 1.0, *[2.0] * 7))])
def test_the_report_names_the_costs_the_simulation_charges(text: str, charged: tuple, tmp_path: Path, capsys) -> None:
    out = tmp_path / "report.json"
    scenario = str(Path(__file__).resolve().parents[2] / "scenarios" / "few_shot.jsonl")
    args = ["replay", "--no-model", "--no-progress", scenario, "--verify-cost", text]
    assert main([*args, "--json", str(out)]) == 0
    assert tuple(json.loads(out.read_text())["verify_cost"]) == charged
    printed = capsys.readouterr().out
    assert "drafts of up to 8 tokens" in printed
    assert f"a verify of 1..8 draft tokens costing {charged[1]:.2f}..{max(charged[1:]):.2f} decode steps" in printed
