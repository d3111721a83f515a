"""Issue 12 item 10: OpenAI tool calls in scenario files are kept, rendered, and never share cache they must not."""

from __future__ import annotations

import json
from pathlib import Path

from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.replay.replayer import Replayer, replay_paths
from prefixcache.replay.scenarios import load_scenario


def agent_line(conversation_id: str, tool: str) -> dict:
    call = {"id": "call_7", "type": "function", "function": {"name": tool, "arguments": '{"order_id": "W1"}'}}
    return {
        "id": conversation_id,
        "messages": [
            {"role": "system", "content": "You are an order assistant. " * 8},
            {"role": "user", "content": "Where is my order W1?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_7", "name": tool, "content": '{"status": "shipped"}'},
            {"role": "assistant", "content": "It has shipped."},
        ],
    }


def write(path: Path, *lines: dict) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_tool_calls_tool_call_id_and_name_are_kept(tmp_path: Path) -> None:
    [conversation] = load_scenario(write(tmp_path / "a.jsonl", agent_line("a", "get_order"))).conversations
    assistant, tool = conversation.messages[2], conversation.messages[3]
    assert assistant == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "get_order", "arguments": '{"order_id": "W1"}'}}
        ],
    }
    assert tool == {"role": "tool", "content": '{"status": "shipped"}', "tool_call_id": "call_7", "name": "get_order"}


def test_conversations_differing_only_in_the_tool_called_share_nothing_after_the_call(tmp_path: Path) -> None:
    path = write(tmp_path / "calls.jsonl", agent_line("a", "get_order"), agent_line("b", "cancel_order"))
    report = replay_paths([path], Replayer(None), order="file", log_requests=True)
    records = {(r["conversation_id"], r["turn"]): r["usage"] for r in report.requests_log}
    tok = ByteTokenizer()
    a, b = (load_scenario(path).conversations[i].messages for i in (0, 1))
    prompt_b = tok.render_chat(b[:4], add_generation_prompt=True)
    through_a = tok.render_chat(a, add_generation_prompt=False)
    common = next(i for i, (x, y) in enumerate(zip(through_a, prompt_b, strict=False)) if x != y)
    history = len(tok.render_chat(b[:2], add_generation_prompt=True))
    # The two calls render differently right after the shared history ...
    assert history < common < history + len('<tool_call>\n{"name": "') + 1
    # ... so b shares only the history with a: its first request finds the history (a's), its second its own call
    # (b's first answer), never a's call, tool result or answer, which an identical rendering would have served.
    assert records[("b", 2)]["prompt_tokens_details"]["cached_tokens"] == history - 1
    own = len(tok.render_chat(b[:3], add_generation_prompt=False))
    assert records[("b", 4)]["prompt_tokens_details"]["cached_tokens"] == own
    assert records[("a", 4)]["prompt_tokens_details"]["cached_tokens"] == len(
        tok.render_chat(a[:3], add_generation_prompt=False)
    )
    assert own < records[("b", 4)]["prompt_tokens"] - 1
