"""Specification of HFTokenizer's piecewise rendering: the ids equal the tokenizer's own ``apply_chat_template``
(tokenized whole) on real transcripts and on edge cases, and pieces are encoded once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from prefixcache.chat.hf_tokenizer import HFTokenizer  # noqa: E402

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
QWEN = DATA / "tokenizers" / "qwen2.5-0.5b-instruct"
needs_data = pytest.mark.skipif(
    not (QWEN.is_dir() and (DATA / "tau_bench_airline_gpt4o.jsonl").is_file()) and os.environ.get("CI") != "true",
    reason=f"shared data not found under {DATA} (CI=true makes this an error)",
)


@pytest.fixture(scope="module")
def qwen() -> HFTokenizer:
    return HFTokenizer(QWEN)


def _whole(tok: HFTokenizer, messages, tools=None, add_generation_prompt=True) -> list[int]:
    ids = tok.tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    return [int(t) for t in ids]


def _conversations(name: str, count: int) -> list[list[dict]]:
    with (DATA / name).open(encoding="utf-8") as f:
        return [json.loads(line)["messages"] for _, line in zip(range(count), f, strict=False)]


@needs_data
def test_every_turn_of_tau_bench_renders_as_the_whole_tokenization(qwen: HFTokenizer) -> None:
    tools = json.loads((DATA / "tau_bench_airline_tools.json").read_text(encoding="utf-8"))
    for messages in _conversations("tau_bench_airline_gpt4o.jsonl", 2):
        for turn in range(1, len(messages) + 1):
            history = messages[:turn]
            assert qwen.render_chat(history, tools) == _whole(qwen, history, tools)
            assert qwen.render_chat(history, tools, False) == _whole(qwen, history, tools, False)


@needs_data
def test_non_ascii_transcripts_render_as_the_whole_tokenization(qwen: HFTokenizer) -> None:
    for name in ("oasst_en100_tree_paths.jsonl", "mtbench_31models.jsonl"):
        for messages in _conversations(name, 20):
            assert qwen.render_chat(messages) == _whole(qwen, messages)


@needs_data
@pytest.mark.parametrize(
    "content",
    [
        "literal <|im_end|> and <tool_call>{}</tool_call> inside a message",
        "<|im_start|><|im_start|>",
        "  leading and trailing spaces  ",
        "combining after a special: \u0338 e\u0301 \u00e9",
        "",
        "emoji 👩‍💻 and CJK 漢字 and RTL שלום",
    ],
)
def test_edge_texts_render_as_the_whole_tokenization(qwen: HFTokenizer, content: str) -> None:
    messages = [{"role": "system", "content": content}, {"role": "user", "content": content + "?"}]
    assert qwen.render_chat(messages) == _whole(qwen, messages)


@needs_data
def test_a_repeated_system_prompt_is_encoded_once(qwen: HFTokenizer) -> None:
    tools = json.loads((DATA / "tau_bench_airline_tools.json").read_text(encoding="utf-8"))
    system = {"role": "system", "content": "A fresh system prompt for this test only."}
    calls: list[int] = []
    original = qwen.tokenizer.__class__.__call__

    def counting(self, text, *args, **kwargs):
        calls.append(len(text) if isinstance(text, list) else 1)
        return original(self, text, *args, **kwargs)

    qwen.tokenizer.__class__.__call__ = counting
    try:
        qwen.render_chat([system, {"role": "user", "content": "first question"}], tools)
        first = sum(calls)
        qwen.render_chat([system, {"role": "user", "content": "second question"}], tools)
    finally:
        qwen.tokenizer.__class__.__call__ = original
    assert first >= 2  # the system piece (with the tool schemas) and the user piece were new
    assert sum(calls) - first == 1  # only the new user piece is encoded the second time
