"""Specification of template drift with a real chat template (Qwen2.5): which turns stop being token-level
extensions of the previous prompt + answer, where they diverge, and how replay and the CLI count them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from prefixcache.chat.hf_tokenizer import HFTokenizer  # noqa: E402
from prefixcache.chat.tokenizer import ByteTokenizer  # noqa: E402
from prefixcache.cli import main  # noqa: E402
from prefixcache.replay.replayer import Replayer, conversation_requests  # noqa: E402
from prefixcache.replay.scenarios import Conversation, load_scenario  # noqa: E402

pytestmark = pytest.mark.usefixtures("qwen_dir")  # every test here needs the Qwen tokenizer folder

TOOLS = [{"type": "function", "function": {"name": "cancel_reservation", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "cancel_reservation", "arguments": {"reservation_id": "ZFA04Y"}}\n</tool_call>'

# Turn 2's answer starts with a blank line: rendered after "<|im_start|>assistant\n", the template's newline and
# the answer's merge into one "\n\n\n" token, so turn 3's prompt (which re-renders that history) leaves turn 2's
# prompt one token before its end.  The other answers start with text, and the two tool results, rendered as one
# user turn, are re-rendered identically.
AGENT = {
    "id": "agent",
    "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "You are an airline agent."},
        {"role": "user", "content": "Cancel reservation ZFA04Y."},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": '{"status": "cancelled"}'},
        {"role": "tool", "content": '{"refund": 120}'},
        {"role": "assistant", "content": "\n\nDone: it is cancelled and 120 USD will be refunded."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ],
}
CHAT = {
    "id": "chat",
    "messages": [
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": " 11, with a leading space."},
        {"role": "user", "content": "And one more?"},
        {"role": "assistant", "content": "\n13"},
    ],
}


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> HFTokenizer:
    return HFTokenizer(qwen_dir)


@pytest.fixture
def scenario_path(tmp_path: Path) -> Path:
    path = tmp_path / "handmade.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in (AGENT, CHAT, CHAT | {"id": "chat-again"})))
    return path


def _conversations(path: Path) -> list[Conversation]:
    return list(load_scenario(path).conversations)


def test_qwen_renders_consecutive_tool_results_as_one_user_turn(qwen: HFTokenizer, scenario_path: Path) -> None:
    agent = _conversations(scenario_path)[0]
    text = qwen.decode(qwen.render_chat(agent.messages[:5], agent.tools))
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n"
        '{"status": "cancelled"}\n</tool_response>\n<tool_response>\n{"refund": 120}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_answers_starting_with_text_or_space_extend_the_previous_turn(qwen: HFTokenizer, scenario_path: Path) -> None:
    agent, chat, _ = _conversations(scenario_path)
    agent_requests = conversation_requests(agent, qwen, "s")
    chat_requests = conversation_requests(chat, qwen, "s")
    # Turn 2 (tool results in between) and the answer " 11..." keep the prompt an exact extension.
    assert agent_requests[1].drift_at is None
    assert chat_requests[1].drift_at is None and chat_requests[2].drift_at is None
    previous = chat_requests[1].prompt + chat_requests[1].answer
    assert chat_requests[2].prompt[: len(previous)] == previous


def test_answer_starting_with_a_newline_drifts_one_token_before_its_prompt_ends(
    qwen: HFTokenizer, scenario_path: Path
) -> None:
    agent = _conversations(scenario_path)[0]
    requests = conversation_requests(agent, qwen, "s")
    second = requests[1]

    assert [r.drift_at for r in requests] == [None, None, len(second.prompt) - 1]
    # The answer was split off where the full rendering leaves the prompt: at the merged "\n\n\n" token.
    assert qwen.decode(second.answer[:1]) == "\n\n\n"


def test_replay_counts_drift_exactly_and_still_reuses_up_to_it(qwen: HFTokenizer, scenario_path: Path) -> None:
    requests = [r for c in _conversations(scenario_path) for r in conversation_requests(c, qwen, "s")]
    log: list[dict] = []

    report = Replayer(None, qwen, block_size=1).replay("s", requests, log=log)

    # agent turn 3 drifts; the last answer "\n13" of each chat copy ends no turn that is replayed after it.
    assert (report.requests, report.drift_requests) == (9, 1)
    drifted = next(record for record in log if record["drift_at"] is not None)
    assert drifted["usage"]["prompt_tokens_details"]["cached_tokens"] == drifted["drift_at"]


def test_byte_tokenizer_does_not_drift_on_the_same_conversations(scenario_path: Path) -> None:
    byte = ByteTokenizer()
    requests = [r for c in _conversations(scenario_path) for r in conversation_requests(c, byte, "s")]
    assert [r.drift_at for r in requests] == [None] * 9


def test_cli_reports_drift_count_and_most_common_position(
    qwen: HFTokenizer, qwen_dir: Path, scenario_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    second = conversation_requests(_conversations(scenario_path)[0], qwen, "s")[1]
    out = tmp_path / "report.json"

    status = main(
        ["replay", str(scenario_path), "--tokenizer", str(qwen_dir), "--no-model", "--no-progress", "--json", str(out)]
    )

    assert status == 0
    drift = json.loads(out.read_text())["scenarios"][str(scenario_path)]["drift"]
    # Turn 3 leaves turn 2's prompt + answer one token before the prompt's end, i.e. len(answer) + 1 before its end.
    before_end = len(second.answer) + 1
    assert drift == {
        "requests": 1,
        "tokens_before_end_range": [before_end, before_end],
        "most_common_tokens_before_end": before_end,
        "most_common_requests": 1,
        "tokens_before_end": {str(before_end): 1},
    }
    printed = capsys.readouterr().out
    assert f"1 requests do not extend the previous prompt+answer; they leave it {before_end} tokens before" in printed
    assert "tokenizer: Qwen2Tokenizer:qwen2.5-0.5b-instruct:" in printed
