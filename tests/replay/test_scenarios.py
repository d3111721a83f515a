from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixcache.errors import InvalidArgumentError, ScenarioError
from prefixcache.replay.formats import detect_format
from prefixcache.replay.scenarios import (
    Conversation,
    default_tools_for,
    iter_mooncake,
    load_mooncake,
    load_scenario,
)

REPO = Path(__file__).parents[2]
SCENARIO_DIR = REPO / "scenarios"
SCENARIO_FILES = sorted(SCENARIO_DIR.glob("*.jsonl"))

GOOD = {"id": "ok", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def good_line(conversation_id: str) -> str:
    return json.dumps({**GOOD, "id": conversation_id})


def test_there_are_at_least_seven_scenario_files() -> None:
    names = {path.name for path in SCENARIO_FILES}
    assert {
        "support_bot.jsonl",
        "multi_turn_chat.jsonl",
        "agent_tool_loop.jsonl",
        "few_shot.jsonl",
        "long_document_qa.jsonl",
        "edit_earlier_message.jsonl",
        "timestamp_system_prompt.jsonl",
    } <= names


@pytest.mark.parametrize("path", SCENARIO_FILES, ids=lambda p: p.name)
def test_scenario_file_loads_cleanly_and_ends_every_conversation_with_assistant(path: Path) -> None:
    assert path.stat().st_size < 150_000
    assert detect_format(path) == "chat"
    scenario = load_scenario(path, tools=default_tools_for(path))
    assert scenario.skipped == ()
    assert len(scenario.conversations) >= 5
    for conversation in scenario.conversations:
        assert conversation.messages[-1]["role"] == "assistant", conversation.id
        assert conversation.source == str(path)


def test_readme_table_lists_every_scenario_file() -> None:
    readme = (SCENARIO_DIR / "README.md").read_text(encoding="utf-8")
    for path in SCENARIO_FILES:
        assert f"`{path.name}`" in readme


def test_agent_scenario_has_tools_and_tool_results() -> None:
    scenario = load_scenario(SCENARIO_DIR / "agent_tool_loop.jsonl")
    for conversation in scenario.conversations:
        assert conversation.tools, conversation.id
        roles = [message["role"] for message in conversation.messages]
        assert "tool" in roles
        assert any("<tool_call>" in m["content"] for m in conversation.messages if m["role"] == "assistant")


def test_timestamp_scenario_prompts_differ_only_in_their_first_line() -> None:
    scenario = load_scenario(SCENARIO_DIR / "timestamp_system_prompt.jsonl")
    systems = [conversation.messages[0]["content"] for conversation in scenario.conversations]
    first_lines = {system.split("\n", 1)[0] for system in systems}
    bodies = {system.split("\n", 1)[1] for system in systems}
    assert len(first_lines) == len(systems)
    assert all(line.startswith("Current date and time: 2024-05-15 15:0") for line in first_lines)
    assert len(bodies) == 1


def test_edit_scenario_variants_share_history_up_to_message_three() -> None:
    conversations = load_scenario(SCENARIO_DIR / "edit_earlier_message.jsonl").conversations
    originals = [c for c in conversations if c.id.endswith("-original")]
    assert originals
    for original in originals:
        group = original.id.removesuffix("-original")
        variants = [c for c in conversations if c.id.startswith(group) and c is not original]
        assert len(variants) >= 2
        for variant in variants:
            assert variant.messages[:3] == original.messages[:3]
            assert variant.messages[3]["role"] == "user"
            assert variant.messages[3] != original.messages[3]


BAD_LINES = [
    ("not_json", '{"id": "x", "messages": [', "not valid JSON"),
    ("not_object", "[1, 2, 3]", "expected a JSON object, got list"),
    ("missing_messages", '{"id": "x"}', "missing 'messages'"),
    ("empty_messages", '{"id": "x", "messages": []}', "non-empty list"),
    ("messages_not_list", '{"id": "x", "messages": "hi"}', "non-empty list"),
    ("bad_role", '{"id": "x", "messages": [{"role": "robot", "content": "hi"}]}', "message 0 has role 'robot'"),
    ("missing_role", '{"id": "x", "messages": [{"content": "hi"}]}', "message 0 has role None"),
    ("non_string_content", '{"id": "x", "messages": [{"role": "user", "content": 5}]}', "content of type int"),
    ("null_content", '{"id": "x", "messages": [{"role": "user", "content": null}]}', "content of type NoneType"),
    ("message_not_object", '{"id": "x", "messages": ["hi"]}', "message 0 must be an object"),
    (
        "tools_not_list",
        f'{{"id": "x", "messages": {json.dumps(GOOD["messages"])}, "tools": {{"a": 1}}}}',
        "tools must be a list",
    ),
    (
        "tools_not_objects",
        f'{{"id": "x", "messages": {json.dumps(GOOD["messages"])}, "tools": ["f"]}}',
        "tool 0 must be an object",
    ),
    ("bad_id", f'{{"id": 7, "messages": {json.dumps(GOOD["messages"])}}}', "'id' must be a non-empty string"),
    ("duplicate_id", good_line("first"), "duplicate id 'first' (first on line 1)"),
]


@pytest.mark.parametrize(("kind", "line", "message"), BAD_LINES, ids=[row[0] for row in BAD_LINES])
def test_bad_line_raises_scenario_error_with_file_and_line(tmp_path: Path, kind: str, line: str, message: str) -> None:
    # The blank line 2 still counts: line numbers are physical, 1-based.
    path = write_lines(tmp_path / "bad.jsonl", [good_line("first"), "", line, good_line("last")])
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert info.value.line_no == 3
    assert info.value.path == str(path)
    assert message in str(info.value)
    assert str(info.value).startswith(f"{path}:3: ")


def test_invalid_utf8_line_is_reported_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(good_line("a").encode() + b"\n" + b'{"id": "\xff"}\n')
    with pytest.raises(ScenarioError, match="not valid UTF-8") as info:
        load_scenario(path)
    assert info.value.line_no == 2


def test_skip_invalid_records_bad_lines_and_loads_the_rest(tmp_path: Path) -> None:
    lines = [good_line("a"), "{oops", good_line("b"), '{"id": "c"}', "", good_line("a"), good_line("d")]
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    scenario = load_scenario(path, skip_invalid=True)
    assert [c.id for c in scenario.conversations] == ["a", "b", "d"]
    assert [error.line_no for error in scenario.skipped] == [2, 4, 6]
    assert all(isinstance(error, ScenarioError) for error in scenario.skipped)
    assert scenario.num_requests == 3


def test_missing_file_raises_scenario_error(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="absent.jsonl: not found: no such file or folder"):
        load_scenario(tmp_path / "absent.jsonl", skip_invalid=True)


def test_conversation_record_fields_and_ignored_keys(tmp_path: Path) -> None:
    line = {
        "id": "c1",
        "source": "somewhere",
        "messages": [
            {"role": "system", "content": "s", "weight": "ignored", "name": "kept"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "a2"},
        ],
    }
    path = write_lines(tmp_path / "one.jsonl", ["", json.dumps(line)])
    (conversation,) = load_scenario(path).conversations
    assert isinstance(conversation, Conversation)
    assert conversation.id == "c1"
    assert conversation.line_no == 2
    assert conversation.tools is None
    assert conversation.messages[0] == {"role": "system", "content": "s", "name": "kept"}
    assert conversation.assistant_turns == (2, 4)


def test_line_without_id_gets_file_and_line_id(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "anon.jsonl", [json.dumps({"messages": GOOD["messages"]})])
    assert load_scenario(path).conversations[0].id == "anon:1"


def test_shared_tools_apply_unless_the_line_has_its_own(tmp_path: Path) -> None:
    own_tool = {"type": "function", "function": {"name": "own"}}
    path = write_lines(tmp_path / "t.jsonl", [good_line("a"), json.dumps({**GOOD, "id": "b", "tools": [own_tool]})])
    a, b = load_scenario(path, tools=[TOOL]).conversations
    assert a.tools == (TOOL,)
    assert b.tools == (own_tool,)
    assert load_scenario(path).conversations[0].tools is None


def test_bad_tools_argument_raises_invalid_argument(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [good_line("a")])
    with pytest.raises(InvalidArgumentError):
        load_scenario(path, tools=["not a schema"])  # type: ignore[list-item]


def test_default_tools_for_finds_sibling_by_prefix(tmp_path: Path) -> None:
    scenario = write_lines(tmp_path / "airline_gpt4o.jsonl", [good_line("a")])
    assert default_tools_for(scenario) is None
    (tmp_path / "airline_tools.json").write_text(json.dumps([TOOL]), encoding="utf-8")
    assert default_tools_for(scenario) == [TOOL]
    # An exact <stem>_tools.json wins over the cut-at-underscore name.
    (tmp_path / "airline_gpt4o_tools.json").write_text(json.dumps([]), encoding="utf-8")
    assert default_tools_for(scenario) == []


def test_default_tools_for_rejects_malformed_tools_file(tmp_path: Path) -> None:
    scenario = write_lines(tmp_path / "x_y.jsonl", [good_line("a")])
    (tmp_path / "x_tools.json").write_text('{"not": "a list"}', encoding="utf-8")
    with pytest.raises(ScenarioError, match="tools must be a list"):
        default_tools_for(scenario)


def test_detect_format(tmp_path: Path) -> None:
    chat = write_lines(tmp_path / "c.jsonl", ["", good_line("a")])
    trace = write_lines(
        tmp_path / "m.jsonl", [json.dumps({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]})]
    )
    other = write_lines(tmp_path / "o.jsonl", ['{"prompt": "x"}'])
    empty = write_lines(tmp_path / "e.jsonl", ["", "  "])
    assert detect_format(chat) == "chat"
    assert detect_format(trace) == "mooncake"
    with pytest.raises(ScenarioError, match="cannot tell the format") as info:
        detect_format(other)
    assert info.value.line_no == 1
    with pytest.raises(ScenarioError, match="empty file"):
        detect_format(empty)


def trace_line(timestamp: int, input_length: int, hash_ids: list[int], output_length: int = 10) -> str:
    return json.dumps(
        {"timestamp": timestamp, "input_length": input_length, "output_length": output_length, "hash_ids": hash_ids}
    )


def test_mooncake_expands_hash_ids_to_token_blocks(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "trace.jsonl",
        [trace_line(0, 1100, [0, 1, 2]), "", trace_line(5, 1024, [0, 1], 7), trace_line(9, 600, [0, 3])],
    )
    first, second, third = load_mooncake(path)
    assert [r.num_input_tokens for r in (first, second, third)] == [1100, 1024, 600]
    assert (first.timestamp_ms, second.timestamp_ms, second.output_length) == (0, 5, 7)
    assert first.token_ids.typecode == "i"
    assert list(first.token_ids[:512]) == list(range(512))
    assert list(first.token_ids[1024:]) == list(range(1024, 1024 + 76))  # last block cut to the remainder
    # Equal hash ids => equal token ids; a different id diverges at exactly the block boundary.
    assert second.token_ids == first.token_ids[:1024]
    assert third.token_ids[:512] == first.token_ids[:512]
    assert third.token_ids[512] != first.token_ids[512]
    assert list(third.token_ids[512:]) == list(range(3 * 512, 3 * 512 + 88))


def test_mooncake_block_tokens_and_limit(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [trace_line(0, 6, [5, 2]), trace_line(1, 3, [5]), "not json at all"])
    first, second = load_mooncake(path, block_tokens=4, limit=2)
    assert list(first.token_ids) == [20, 21, 22, 23, 8, 9]
    assert list(second.token_ids) == [20, 21, 22]
    assert len(list(iter_mooncake(path, block_tokens=4, limit=0))) == 0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (trace_line(0, 1100, [0, 1]), "2 hash_ids for input_length 1100; expected ceil(1100/512) = 3"),
        (trace_line(0, 100, [0, 1]), "expected ceil(100/512) = 1"),
        (trace_line(0, 0, []), "'input_length' must be an integer >= 1"),
        (trace_line(0, 10, [-1]), "hash id -1"),
        (trace_line(0, 10, [2**22]), "hash id 4194304"),
        (trace_line(0, 10, ["a"]), "hash id 'a'"),
        (json.dumps({"timestamp": 0, "input_length": 10, "hash_ids": [0]}), "'output_length' must be an integer"),
        (json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1}), "'hash_ids' must be a list"),
        (json.dumps({"timestamp": 0.5, "input_length": 10, "output_length": 1, "hash_ids": [0]}), "'timestamp'"),
        ("[]", "expected a JSON object"),
        ("{", "not valid JSON"),
    ],
)
def test_bad_mooncake_line_raises_with_line_number(tmp_path: Path, line: str, message: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", [trace_line(0, 10, [0]), line])
    with pytest.raises(ScenarioError) as info:
        load_mooncake(path)
    assert info.value.line_no == 2
    assert message in str(info.value)


def test_mooncake_rejects_bad_block_tokens(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [trace_line(0, 10, [0])])
    with pytest.raises(InvalidArgumentError):
        load_mooncake(path, block_tokens=0)


@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_real_mooncake_trace_first_100_requests_load(shared_data, name: str) -> None:
    path = shared_data(f"mooncake/{name}")
    assert detect_format(path) == "mooncake"
    requests = load_mooncake(path, limit=100)
    assert len(requests) == 100
    timestamps = [r.timestamp_ms for r in requests]
    assert timestamps == sorted(timestamps)
    for request in requests:
        assert request.num_input_tokens > 0
        assert max(request.token_ids) < 2**31


@pytest.mark.parametrize(
    ("name", "conversations", "with_tools"),
    [
        ("tau_bench_airline_gpt4o.jsonl", 200, True),
        ("mtbench_31models.jsonl", 2480, False),
        ("oasst_en100_tree_paths.jsonl", 626, False),
    ],
)
def test_shared_chat_files_load_completely(shared_data, name: str, conversations: int, with_tools: bool) -> None:
    path = shared_data(name)
    if with_tools:
        shared_data("tau_bench_airline_tools.json")
    tools = default_tools_for(path)
    assert (tools is not None) == with_tools
    scenario = load_scenario(path, tools=tools)
    assert scenario.skipped == ()
    assert len(scenario.conversations) == conversations
    if with_tools:
        assert all(c.tools == tuple(tools) for c in scenario.conversations)
    assert len({c.id for c in scenario.conversations}) == conversations
