"""Specification of the replay's input formats: a request log line is one request as sent, an OpenAI Batch line one
request per body (per prompt), a ShareGPT conversation a request per gpt turn as a transcript is; the format is told
from the first record and named in the report, and a file of no known format is refused naming its line and the
formats accepted.

Token counts are worked out by hand for the byte tokenizer's ChatML: a message costs ``len(role) + len(content) + 4``
tokens (``<|im_start|>``, ``"\\n"``, ``<|im_end|>``, ``"\\n"``), the generation prompt ``<|im_start|>assistant\\n`` 11.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from prefixcache.chat.tokenizer import ByteTokenizer
from prefixcache.cli import build_parser, main
from prefixcache.errors import ScenarioError
from prefixcache.models import build_model
from prefixcache.replay.formats import (
    FILE_FORMATS,
    detect_format,
    input_format,
    input_lines,
    load_request_log,
    load_sharegpt,
)
from prefixcache.replay.lines import iter_json_records
from prefixcache.replay.replayer import Replayer, replay_paths
from prefixcache.replay.requests import read_requests


def message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def write_lines(path: Path, lines: Sequence[object]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


SYSTEM = message("system", "S")  # 1 + 4 + 6 = 11 tokens
# What a gateway logs: each call's whole body.  The second call of user u1 re-sends the first exchange.
REQUEST_LOG = [
    {"model": "gpt-4o", "timestamp": 1, "user": "u1", "messages": [SYSTEM, message("user", "a")]},
    {
        "model": "gpt-4o",
        "timestamp": 2,
        "user": "u1",
        "messages": [SYSTEM, message("user", "a"), message("assistant", "b"), message("user", "c")],
    },
    {"model": "gpt-4o", "timestamp": 3, "user": "u2", "messages": [SYSTEM, message("user", "x")]},
]
# Prompts: 11 + 9 + 11 = 31; 11 + 9 + 14 + 9 + 11 = 54; 31.  Hits: none; all of the first prompt (its generation
# prompt starts the second's assistant message): 31; the system message and "<|im_start|>user\n": 11 + 6 = 17.
REQUEST_LOG_PROMPTS = [31, 54, 31]
REQUEST_LOG_CACHED = 31 + 17

SHAREGPT = {
    "id": "sg-1",
    "conversations": [
        {"from": "system", "value": "S"},
        {"from": "human", "value": "a"},
        {"from": "gpt", "value": "b"},
        {"from": "human", "value": "c"},
        {"from": "gpt", "value": "d"},
    ],
}
# As a transcript: prompts 31 and 54, answers "b<|im_end|>\n" and "d<|im_end|>\n" (3 tokens each); the second prompt
# extends the first prompt + answer, 34 tokens, all cached.

BATCH = [
    {
        "custom_id": "req-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o-mini", "messages": [SYSTEM, message("user", "a")], "max_tokens": 100},
    },
    {"custom_id": "req-2", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "hello"}},
    {
        "custom_id": "req-3",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": ["hello world", [104, 105]]},
    },
]
# Prompts 31, 5, 11 and 2 tokens; hits: 0, 0 ("h" vs <|im_start|>), "hello" = 5, "h" = 1.


def test_a_request_log_line_is_one_request_prompted_with_its_messages_as_sent(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "requests.jsonl", REQUEST_LOG)

    loaded = read_requests(path, ByteTokenizer())

    assert loaded.file_format == "requests"
    assert [len(r.prompt) for r in loaded.requests] == REQUEST_LOG_PROMPTS
    assert [len(r.answer) for r in loaded.requests] == [0, 0, 0]  # no teacher forcing
    assert [(r.conversation_id, r.turn) for r in loaded.requests] == [("line1", 2), ("line2", 4), ("line3", 2)]
    assert list(loaded.requests[1].prompt) == ByteTokenizer().render_chat(REQUEST_LOG[1]["messages"])


def test_a_request_log_replays_with_the_hits_worked_out_by_hand(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "requests.jsonl", REQUEST_LOG)

    report = replay_paths([path], Replayer(None)).scenarios[0]

    assert (report.requests, report.prompt_tokens) == (3, sum(REQUEST_LOG_PROMPTS))
    assert (report.cached_tokens, report.ideal_cached_tokens) == (REQUEST_LOG_CACHED, REQUEST_LOG_CACHED)
    assert report.input_format == "requests"


def test_the_same_log_read_as_transcripts_sends_none_of_its_prompts(tmp_path: Path) -> None:
    # The old reading, still there with --format chat: a request per recorded assistant message, so the log's three
    # prompts become one request, the history of line 2's only answer.
    path = write_lines(tmp_path / "requests.jsonl", REQUEST_LOG)

    loaded = read_requests(path, ByteTokenizer(), file_format="chat")

    assert [(r.conversation_id, len(r.prompt), len(r.answer)) for r in loaded.requests] == [("requests:2", 31, 3)]


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"id": "c", "messages": [message("user", "a"), message("assistant", "b")]}, "chat"),
        ({"messages": [message("user", "a")]}, "chat"),  # no request field: a transcript, as every file so far
        ({"model": "m", "messages": [message("user", "a")]}, "requests"),
        ({"timestamp": 5, "messages": [message("user", "a")]}, "requests"),
        ({"id": "c", "model": "m", "messages": [message("user", "a"), message("assistant", "b")]}, "chat"),
        ({"model": "m", "prompt": "text"}, "requests"),
        ({"custom_id": "r", "method": "POST", "url": "/v1/completions", "body": {}}, "batch"),
        ({"conversations": [{"from": "human", "value": "a"}]}, "sharegpt"),
        ({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}, "mooncake"),
    ],
)
def test_the_format_is_told_from_the_first_record(tmp_path: Path, record: dict[str, Any], expected: str) -> None:
    assert detect_format(write_lines(tmp_path / "f.jsonl", ["", record])) == expected


@pytest.mark.parametrize(
    "name", ["tau_bench_airline_gpt4o.jsonl", "mtbench_31models.jsonl", "oasst_en100_tree_paths.jsonl"]
)
def test_the_shared_transcripts_are_still_read_as_transcripts(shared_data, name: str) -> None:
    assert detect_format(shared_data(name)) == "chat"


def test_a_file_of_no_known_format_is_refused_naming_its_line_and_the_formats(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "notes.jsonl", ["", {"text": "hello", "label": 1}])

    with pytest.raises(ScenarioError) as info:
        read_requests(path, ByteTokenizer())

    assert (info.value.path, info.value.line_no) == (str(path), 2)
    message_text = str(info.value)
    assert message_text.startswith(f"{path}:2: cannot tell the format: an object with 'text', 'label'")
    for named in ("chat transcripts", "request logs", "OpenAI Batch input", "ShareGPT", "Mooncake", "--format"):
        assert named in message_text


def test_a_file_that_is_not_json_is_refused_naming_the_formats(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "log.csv", ["timestamp,prompt", "1,hello"])

    with pytest.raises(ScenarioError) as info:
        detect_format(path)

    assert info.value.line_no == 1
    assert "not valid JSON: Expecting value at column 1; replay reads:\n  chat transcripts" in str(info.value)


def test_request_bodies_are_read_as_a_server_reads_them(tmp_path: Path) -> None:
    # Content parts are joined, developer is the system role, tools are rendered after the system prompt.
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        "tools": [tool],
        "temperature": 0,
    }
    path = write_lines(tmp_path / "r.jsonl", [body])

    [request] = read_requests(path, ByteTokenizer()).requests

    expected = ByteTokenizer().render_chat([SYSTEM, message("user", "a\nb")], [tool])
    assert list(request.prompt) == expected


def test_template_variables_of_a_body_reach_the_chat_template(tmp_path: Path) -> None:
    seen: list[Any] = []

    class Recording(ByteTokenizer):
        def render_chat(self, messages, tools=None, add_generation_prompt=True, *, template_kwargs=None):
            seen.append(template_kwargs)
            return super().render_chat(messages, tools, add_generation_prompt, template_kwargs=template_kwargs)

    body = {
        "model": "m",
        "messages": [message("user", "a")],
        "chat_template_kwargs": {"enable_thinking": False},
        "reasoning_effort": "low",
    }
    path = write_lines(tmp_path / "r.jsonl", [body])

    read_requests(path, Recording())

    assert seen == [{"enable_thinking": False, "reasoning_effort": "low"}]


def test_a_completions_body_in_a_request_log_is_its_prompt_encoded_or_its_token_ids(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "r.jsonl", [{"model": "m", "prompt": "hey"}, {"model": "m", "prompt": [1, 2]}])

    requests = read_requests(path, ByteTokenizer()).requests

    assert [list(r.prompt) for r in requests] == [[104, 101, 121], [1, 2]]


def test_token_ids_outside_the_tokenizer_are_refused_naming_the_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "r.jsonl", [{"model": "m", "prompt": "ok"}, {"model": "m", "prompt": [5, 300]}])

    with pytest.raises(ScenarioError, match="prompt token id 300 is not below the vocabulary size 259") as info:
        read_requests(path, ByteTokenizer())

    assert info.value.line_no == 2


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"model": "m", "messages": []}, "'messages' must be a non-empty list"),
        ({"model": "m", "messages": [message("robot", "a")]}, "message 0 has role 'robot'"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "only text content parts can be rendered",
        ),
        ({"model": "m", "prompt": []}, "'prompt' must be a string, a list of token ids"),
        ({"model": "m", "prompt": ""}, "prompt 0 is empty"),
        ({"model": 7, "messages": [message("user", "a")]}, "'model' must be a non-empty string"),
    ],
)
def test_a_bad_request_line_is_refused_naming_the_line(tmp_path: Path, record: dict, problem: str) -> None:
    path = write_lines(tmp_path / "r.jsonl", [REQUEST_LOG[0], record])

    with pytest.raises(ScenarioError) as info:
        load_request_log(path)

    assert info.value.line_no == 2
    assert problem in str(info.value)


def test_bad_request_lines_are_skipped_and_counted_with_skip_invalid(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "r.jsonl", [REQUEST_LOG[0], "{oops", {"model": "m", "messages": []}, REQUEST_LOG[2]])

    loaded = read_requests(path, ByteTokenizer(), skip_invalid=True)

    assert ([r.conversation_id for r in loaded.requests], loaded.skipped) == (["line1", "line4"], 2)


def test_limit_keeps_the_first_lines_of_a_request_log(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "r.jsonl", REQUEST_LOG)

    assert [len(r.prompt) for r in read_requests(path, ByteTokenizer(), limit=2).requests] == [31, 54]


def test_a_log_of_several_models_warns_that_the_replay_shares_one_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_lines(tmp_path / "r.jsonl", [REQUEST_LOG[0], {**REQUEST_LOG[2], "model": "gpt-4o-mini"}])

    with caplog.at_level(logging.WARNING, logger="prefixcache.replay.formats"):
        load_request_log(path)

    assert "requests to 2 models: gpt-4o (1), gpt-4o-mini (1)" in caplog.text


def test_a_batch_file_is_a_request_per_body_and_per_prompt_of_a_list(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "batch.jsonl", BATCH)

    loaded = read_requests(path, ByteTokenizer())
    report = replay_paths([path], Replayer(None)).scenarios[0]

    assert loaded.file_format == "batch"
    assert [(r.conversation_id, len(r.prompt)) for r in loaded.requests] == [
        ("req-1", 31),
        ("req-2", 5),
        ("req-3[0]", 11),
        ("req-3[1]", 2),
    ]
    assert (report.requests, report.prompt_tokens, report.cached_tokens) == (4, 49, 6)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"url": "/v1/embeddings"}, "'url' '/v1/embeddings' is not replayed; accepted: /v1/chat/completions"),
        ({"method": "GET"}, "'method' must be \"POST\", got 'GET'"),
        ({"custom_id": "req-1"}, "duplicate custom_id 'req-1' (first on line 1)"),
        ({"body": "text"}, "'body' must be a JSON object (a request body), got str"),
        ({"custom_id": ""}, "'custom_id' must be a non-empty string"),
    ],
)
def test_a_bad_batch_line_is_refused_naming_the_line(tmp_path: Path, change: dict, problem: str) -> None:
    path = write_lines(tmp_path / "batch.jsonl", [BATCH[0], {**BATCH[1], **change}])

    with pytest.raises(ScenarioError) as info:
        load_request_log(path, file_format="batch")

    assert info.value.line_no == 2
    assert problem in str(info.value)


@pytest.mark.parametrize("layout", ["jsonl", "array"])
def test_a_sharegpt_conversation_replays_as_a_transcript(tmp_path: Path, layout: str) -> None:
    path = tmp_path / "sharegpt.json"
    if layout == "array":
        path.write_text(json.dumps([SHAREGPT], indent=2))
    else:
        write_lines(path, [SHAREGPT])

    loaded = read_requests(path, ByteTokenizer())
    report = replay_paths([path], Replayer(None)).scenarios[0]

    assert loaded.file_format == "sharegpt"
    assert [(r.conversation_id, r.turn, len(r.prompt), len(r.answer)) for r in loaded.requests] == [
        ("sg-1", 2, 31, 3),
        ("sg-1", 4, 54, 3),
    ]
    assert (report.requests, report.prompt_tokens, report.cached_tokens) == (2, 85, 34)


def test_sharegpt_takes_a_top_level_system_prompt_and_numeric_ids(tmp_path: Path) -> None:
    record = {"id": 7, "system": "S", "conversations": SHAREGPT["conversations"][1:3]}
    path = write_lines(tmp_path / "s.jsonl", [record])

    [conversation] = load_sharegpt(path).conversations

    assert conversation.id == "7"
    assert conversation.messages == (SYSTEM, message("user", "a"), message("assistant", "b"))


def test_a_bad_sharegpt_record_is_refused_naming_the_line_it_starts_on(tmp_path: Path) -> None:
    bad = {"conversations": [{"from": "human", "value": "a"}, {"from": "robot", "value": "b"}]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps([SHAREGPT, bad], indent=1))
    start = 1 + json.dumps([SHAREGPT, bad], indent=1).splitlines().index(" {", 2)

    with pytest.raises(ScenarioError) as info:
        read_requests(path, ByteTokenizer())

    assert info.value.line_no == start
    assert "conversations[1] has 'from': 'robot'; accepted: human, user, gpt" in str(info.value)


def test_a_json_array_reports_its_syntax_errors_where_they_are(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text('[\n {"a": 1},\n {"b": }\n]\n')
    unclosed = tmp_path / "b.json"
    unclosed.write_text('[{"a": 1},\n')
    trailing = tmp_path / "c.json"
    trailing.write_text('[\n{"a": 1}\n]\n{"b": 2}\n')
    one_line = tmp_path / "d.json"
    one_line.write_text('[{"a": 1}, {"b": 2}]\n')
    jsonl = tmp_path / "e.jsonl"
    jsonl.write_text('[{"a": 1}]\n{"b": 2}\n' + "[" * 100_000 + "\n")

    assert [(line, obj) for line, obj, _ in iter_json_records(path)][0] == (2, {"a": 1})
    [(_, _, first), (line, _, error)] = list(iter_json_records(path))
    assert (first, line, str(error)) == (None, 3, f"{path}:3: not valid JSON: Expecting value at column 8")
    assert str(list(iter_json_records(unclosed))[-1][2]).endswith("not valid JSON: the array is not closed with ']'")
    assert str(list(iter_json_records(trailing))[-1][2]) == f"{trailing}:4: not valid JSON: text after the closing ']'"
    assert list(iter_json_records(one_line)) == [(1, {"a": 1}, None), (1, {"b": 2}, None)]
    # A line that is an array, or too deep to read, in a JSON Lines file is that line's own record, as before.
    records = list(iter_json_records(jsonl))
    assert [(line, obj) for line, obj, _ in records[:2]] == [(1, [{"a": 1}]), (2, {"b": 2})]
    assert "not usable JSON: nested 100000 levels deep" in str(records[2][2])


def test_every_format_has_a_cli_choice() -> None:
    parser = build_parser()

    for name in ("auto", *FILE_FORMATS):
        assert parser.parse_args(["replay", "x.jsonl", "--format", name]).file_format == name


def test_cli_replays_a_request_log_and_names_the_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_lines(tmp_path / "requests.jsonl", REQUEST_LOG)
    out = tmp_path / "report.json"

    assert main(["replay", str(path), "--no-model", "--no-progress", "--json", str(out)]) == 0

    printed = capsys.readouterr().out
    assert f"input: {FILE_FORMATS['requests']}: {path}" in printed.splitlines()[2]
    report = json.loads(out.read_text())
    assert (report["input_format"], report["scenarios"][str(path)]["input_format"]) == ("requests", "requests")
    assert (report["requests"], report["prompt_tokens"], report["cached_tokens"]) == (3, 116, 48)


def test_cli_refuses_a_file_of_no_known_format_with_exit_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_lines(tmp_path / "notes.jsonl", [{"text": "hello"}])

    assert main(["replay", str(path), "--no-model", "--no-progress"]) == 2

    err = capsys.readouterr().err
    assert f"{path}:1: cannot tell the format" in err and "request logs" in err


def test_a_request_log_replays_on_a_model_and_verifies(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "requests.jsonl", REQUEST_LOG)

    report = replay_paths([path], Replayer(build_model("tiny"), verify=True)).scenarios[0]

    assert (report.requests, report.cached_tokens, report.verified) == (3, REQUEST_LOG_CACHED, True)


def test_the_readme_shows_a_line_of_each_format_it_names(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- input-formats -->\n```jsonl\n", 1)[1].split("```", 1)[0]
    found = []
    for index, line in enumerate(block.splitlines()):
        path = write_lines(tmp_path / f"{index}.jsonl", [line])
        loaded = read_requests(path, ByteTokenizer())
        found.append((loaded.file_format, len(loaded.requests)))

    assert found == [("requests", 1), ("batch", 1), ("sharegpt", 1)]


def test_a_gateway_log_of_real_agent_runs_sends_the_transcripts_prompts_token_for_token(
    shared_data, tmp_path: Path
) -> None:
    # What a gateway logs for 10 tau-bench runs: a body per assistant turn, the history so far and the tools.
    transcripts = shared_data("tau_bench_airline_gpt4o.jsonl")
    tools = json.loads(shared_data("tau_bench_airline_tools.json").read_text())
    conversations = [json.loads(line) for line in transcripts.read_text().splitlines()[:10]]
    bodies = [
        {"model": "gpt-4o", "user": c["id"], "messages": c["messages"][:i], "tools": tools}
        for c in conversations
        for i, m in enumerate(c["messages"])
        if m["role"] == "assistant"
    ]
    log = write_lines(tmp_path / "gateway.jsonl", bodies)

    logged = read_requests(log, ByteTokenizer())
    replayed = read_requests(transcripts, ByteTokenizer(), order="file", limit=10)

    assert logged.file_format == "requests" and len(logged.requests) == len(replayed.requests) > 10
    assert [r.prompt for r in logged.requests] == [r.prompt for r in replayed.requests]


@pytest.mark.parametrize("forced", ["chat", "requests", "batch", "sharegpt", "mooncake"])
def test_an_empty_file_with_a_forced_format_is_refused_as_with_detection(forced: str, tmp_path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")

    with pytest.raises(ScenarioError, match="empty file"):
        read_requests(empty, ByteTokenizer(), file_format=forced)


@pytest.mark.parametrize("file_format", ["auto", *FILE_FORMATS])
def test_a_missing_file_is_not_found_whatever_the_format(file_format: str, tmp_path: Path) -> None:
    missing = tmp_path / "absent.jsonl"

    with pytest.raises(ScenarioError) as raised:
        read_requests(missing, ByteTokenizer(), file_format=file_format)

    assert str(raised.value) == f"{missing}: not found: no such file or folder"


def test_input_lines_reads_the_first_record_at_once_and_refuses_a_file_without_one(tmp_path: Path) -> None:
    path = tmp_path / "two.jsonl"
    path.write_text('\n{"a": 1}\n\n[2]\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("[]")

    assert [(line_no, obj) for line_no, obj, _ in input_lines(path)] == [(2, {"a": 1}), (4, [2])]
    with pytest.raises(ScenarioError) as raised:
        input_lines(empty)  # no iteration needed
    assert str(raised.value) == f"{empty}: empty file: no conversations or requests"


def test_a_forced_format_is_kept_and_auto_is_told_after_the_same_checks(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1]}\n')

    assert input_format(path) == "mooncake"
    assert input_format(path, "chat") == "chat"
    with pytest.raises(ScenarioError, match="not found: no such file or folder"):
        input_format(tmp_path / "absent.jsonl", "chat")
