"""Explain and drift with a template that re-renders history: like Qwen3's, it drops the reasoning (``<think>``)
of assistant turns before the last user message, so a prompt is not its partial renderings glued together.
Messages must be located on the prompt the model really saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.replay.explain import MessageLocator, message_spans
from prefixcache.replay.replayer import Replayer, replay_paths
from prefixcache.replay.report import format_drift, format_drift_requests

ROOT = Path(__file__).resolve().parents[2]
QWEN_DIR = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen2.5-0.5b-instruct"

STRIPPING_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' and loop.index0 < ns.last_user %}{{ m.content.split('</think>')[-1] }}\
{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""


class StripsEarlierReasoning(ByteTokenizer):
    """The byte-level ChatML, except that assistant reasoning before the last user message is dropped."""

    def render_chat(self, messages, tools=None, add_generation_prompt=True):
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        shown = [
            dict(m, content=m["content"].split("</think>")[-1]) if m["role"] == "assistant" and i < last_user else m
            for i, m in enumerate(messages)
        ]
        return super().render_chat(shown, tools, add_generation_prompt)


def conversation(conversation_id: str, reasoning: str, second_question: str) -> dict:
    return {
        "id": conversation_id,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": f"<think>{reasoning}</think>4"},
            {"role": "user", "content": second_question},
            {"role": "assistant", "content": "6"},
        ],
    }


LONG = "add two and two, carefully, checking the sum twice before answering"
MESSAGES = conversation("a", LONG, "And 3+3?")["messages"]


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "reasoning.jsonl"
    lines = [conversation("a", LONG, "And 3+3?"), conversation("b", LONG, "And 5+5?"), conversation("c", "add", "Ok?")]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_spans_on_a_rerendered_prompt_are_sorted_and_cover_each_message_where_it_really_is() -> None:
    tokenizer = StripsEarlierReasoning()
    prompt = tokenizer.render_chat(MESSAGES[:4])
    text = tokenizer.decode(prompt)

    spans = message_spans(tokenizer, MESSAGES[:4], prompt=prompt)

    assert [s.end for s in spans] == sorted(s.end for s in spans)
    assert all(s.start <= s.end for s in spans)
    assert "<think>" not in text
    assert tokenizer.decode(prompt[spans[2].start : spans[2].end]).endswith("4")
    assert tokenizer.decode(prompt[spans[3].start : spans[3].end]).endswith("And 3+3?<|im_end|>\n")


def test_a_position_in_a_user_message_after_a_stripped_reasoning_is_named_as_that_user_message() -> None:
    tokenizer = StripsEarlierReasoning()
    prompt = tokenizer.render_chat(MESSAGES[:4])
    question = tokenizer.encode("And 3+3?")
    position = next(i for i in range(len(prompt)) if prompt[i : i + len(question)] == question)

    located = MessageLocator(tokenizer, MESSAGES[:4], prompt=prompt).locate(position)

    assert (located.index, located.role) == (3, "user")


def test_replay_explain_names_the_user_message_that_really_differs(scenario: Path) -> None:
    report = replay_paths([scenario], Replayer(None, StripsEarlierReasoning(), explain=True))

    points = report.scenarios[0].divergences
    # b's second prompt leaves a's at "5" of "And 5+5?": message 3, not the long-reasoning assistant message 2.
    assert any(p.message_index == 3 and p.message_role == "user" for p in points)
    assert all(p.example.message_index is not None for p in points)


def test_drift_is_listed_per_request_with_its_message_and_summarised_as_a_range(scenario: Path) -> None:
    report = replay_paths([scenario], Replayer(None, StripsEarlierReasoning(), explain=True))
    result = report.scenarios[0]
    reasoning_tokens = {"a": len(f"<think>{LONG}</think>"), "b": len(f"<think>{LONG}</think>"), "c": 18}

    assert [(d.conversation_id, d.turn, d.message_index, d.message_role) for d in result.drifts] == [
        ("a", 4, 2, "assistant"),
        ("b", 4, 2, "assistant"),
        ("c", 4, 2, "assistant"),
    ]
    # The previous prompt + answer ends with "<think>...</think>4<|im_end|>\n": reasoning, "4", 2 more tokens.
    expected = [reasoning_tokens[d.conversation_id] + 3 for d in result.drifts]
    assert [d.tokens_before_end for d in result.drifts] == expected
    low, high = 18 + 3, len(f"<think>{LONG}</think>") + 3
    assert format_drift(result) == (
        f"template drift in {scenario}: 3 requests do not extend the previous prompt+answer; "
        f"they leave it {low} to {high} tokens (most often {high}) before its end"
    )
    assert "conversation c turn 4: token " in format_drift_requests(result)
    assert ", message 2 (assistant), 21 tokens before the end" in format_drift_requests(result)


def test_cli_explain_with_a_jinja_template_that_strips_reasoning(scenario: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    if not QWEN_DIR.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the Qwen tokenizer folder at {QWEN_DIR}")
        pytest.skip(f"Qwen tokenizer folder not found at {QWEN_DIR}")
    template = tmp_path / "strip.jinja"
    template.write_text(STRIPPING_TEMPLATE)
    out = tmp_path / "report.json"
    args = ["replay", scenario, "--no-model", "--no-progress", "--explain", "--json", out]
    args += ["--tokenizer", QWEN_DIR, "--chat-template", template]

    done = subprocess.run(
        [sys.executable, "-m", "prefixcache", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )

    assert done.returncode == 0, done.stderr
    assert "message 3 (user)" in done.stdout
    assert "template drift in" in done.stdout and "before its end" in done.stdout
    assert "conversation b turn 4: token" in done.stdout
    drift = json.loads(out.read_text())["scenarios"][str(scenario)]["drift"]
    assert drift["requests"] == 3 and drift["tokens_before_end_range"][0] < drift["tokens_before_end_range"][1]
