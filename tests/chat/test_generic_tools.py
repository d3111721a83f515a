"""Tools with a chat template that cannot show them (:mod:`prefixcache.chat.generic_tools`): the Qwen2.5 tokenizer
under templates that ignore ``tools`` (a ChatML one as SmolLM2's, an alternating user/assistant one as Llama 2's),
against its own template, which renders tools and must stay untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs: pip install 'prefixcache[hf]'")

from prefixcache.chat import generic_tools  # noqa: E402
from prefixcache.chat.generic_tools import (  # noqa: E402
    TemplateAbilities,
    probe_template,
    rewrite_chat,
    template_abilities,
    tools_block,
)
from prefixcache.chat.hf_tokenizer import HFTokenizer, _template_message  # noqa: E402
from prefixcache.chat.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, render_tool_call  # noqa: E402

# As SmolLM2's: ChatML, a default system prompt, every role written as given, and no tools; content is concatenated,
# so an assistant message with tool calls and no content fails (None is not a string).
CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
    "You are a small assistant.<|im_end|>\n{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# As Llama 2's: user and assistant turns strictly alternating, no system message, no other role, no tools.
ALTERNATING = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] or (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %} {{ m['content'] }} .{% endif %}"
    "{% endfor %}"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time"}},
]
SYSTEM = {"role": "system", "content": "You help travellers."}
ASK = {"role": "user", "content": "Weather in Paris and Oslo?"}
PARIS = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
OSLO = {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
RESULTS = [
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "9 C"},
]


@pytest.fixture(scope="module")
def chatml(qwen_dir: Path) -> HFTokenizer:
    return HFTokenizer(qwen_dir, chat_template=CHATML)


@pytest.fixture(scope="module")
def alternating(qwen_dir: Path) -> HFTokenizer:
    return HFTokenizer(qwen_dir, chat_template=ALTERNATING)


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> HFTokenizer:
    return HFTokenizer(qwen_dir)


def whole_ids(tok: HFTokenizer, messages, tools=None) -> list[int]:
    """The ids of the template's rendering tokenized whole by transformers, as render_chat gave them before."""
    ids = tok.tokenizer.apply_chat_template(
        [_template_message(m) for m in messages], tools=tools, add_generation_prompt=True, return_dict=False
    )
    return [int(t) for t in ids]


def text(tok: HFTokenizer, messages, tools=None, add_generation_prompt=True) -> str:
    return tok.decode(tok.render_chat(messages, tools, add_generation_prompt))


def generated_ids(tok: HFTokenizer, answer: str) -> list[int]:
    """The ids a model writes for ``answer`` and its end of turn: Qwen's ``<tool_call>`` and ``</tool_call>`` are one
    added token each, the rest its plain encoding."""
    ids: list[int] = []
    for index, piece in enumerate(answer.replace(TOOL_CALL_CLOSE, TOOL_CALL_OPEN).split(TOOL_CALL_OPEN)):
        if index:
            ids.append(tok.special_token_id(TOOL_CALL_OPEN if index % 2 else TOOL_CALL_CLOSE))
        ids.extend(tok.encode(piece))
    return [*ids, tok.special_token_id("<|im_end|>")]


def test_the_block_lists_each_function_as_json_and_shows_a_call() -> None:
    block = tools_block(TOOLS)
    lines = block.splitlines()
    start, end = lines.index("<tools>"), lines.index("</tools>")
    assert lines[start + 1 : end] == [
        '{"name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", "properties": '
        '{"city": {"type": "string"}}, "required": ["city"]}}',
        '{"name": "get_time"}',
    ]
    example = '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>\n'
    assert block.startswith("# Tools\n\n") and example in block
    # A hosted tool cannot be called in this format: it is left out, and with no function there is no block.
    assert tools_block([{"type": "web_search"}, TOOLS[1]]) == tools_block([TOOLS[1]])
    assert tools_block([{"type": "web_search"}]) == ""


def test_the_probe_tells_what_each_template_shows(chatml, alternating, qwen) -> None:
    def probe(tok: HFTokenizer) -> TemplateAbilities:
        return probe_template(lambda m, t: tok.tokenizer.apply_chat_template(m, tools=t, tokenize=False))

    assert probe(chatml) == TemplateAbilities(renders_tools=False, renders_tool_role=True, renders_system=True)
    assert probe(alternating) == TemplateAbilities(renders_tools=False, renders_tool_role=False, renders_system=False)
    assert probe(qwen).renders_tools is True


def test_a_template_that_fails_on_any_chat_is_left_to_fail_as_before() -> None:
    def broken(messages, tools):
        raise ValueError("no")

    assert probe_template(broken) == TemplateAbilities(True, True, True)


def test_each_template_is_probed_once(monkeypatch) -> None:
    monkeypatch.setattr(generic_tools, "_memo", {})
    renders = []

    def render(messages, tools):
        renders.append(len(messages))
        return str(messages)

    first = template_abilities(("tok", "template"), render)
    assert template_abilities(("tok", "template"), render) == first
    assert len(renders) == 4
    template_abilities(("tok", "another template"), render)
    assert len(renders) == 8


def test_the_block_is_a_new_first_system_message_when_the_chat_has_none(chatml) -> None:
    assert text(chatml, [ASK], TOOLS) == (
        f"<|im_start|>system\n{tools_block(TOOLS)}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_block_is_appended_to_the_system_prompt(chatml) -> None:
    assert text(chatml, [SYSTEM, ASK], TOOLS) == (
        f"<|im_start|>system\nYou help travellers.\n\n{tools_block(TOOLS)}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_where_the_template_shows_no_system_message_the_block_opens_the_first_user_message(alternating) -> None:
    assert text(alternating, [ASK], TOOLS) == f"[INST] {tools_block(TOOLS)}\n\nWeather in Paris and Oslo? [/INST]"


def test_calls_are_the_assistants_content_and_results_keep_role_tool(chatml) -> None:
    said = {"role": "assistant", "content": "Looking.", "tool_calls": [PARIS, OSLO]}
    history = [SYSTEM, ASK, said, *RESULTS]
    prompt = text(chatml, history, TOOLS)
    calls = '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    assert prompt.endswith(
        f"<|im_start|>assistant\nLooking.\n<tool_call>\n{calls}"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n18 C<|im_end|>\n<|im_start|>tool\n9 C<|im_end|>\n<|im_start|>assistant\n"
    )


def test_where_the_template_refuses_role_tool_the_results_are_one_user_message(alternating) -> None:
    history = [ASK, {"role": "assistant", "content": None, "tool_calls": [PARIS, OSLO]}, *RESULTS]
    calls = "\n".join(render_tool_call(call) for call in (PARIS, OSLO))
    assert text(alternating, history, TOOLS).endswith(
        f" {calls} .[INST] <tool_response>\n18 C\n</tool_response>\n<tool_response>\n9 C\n</tool_response> [/INST]"
    )


def test_a_history_of_calls_renders_without_tools_given(chatml) -> None:
    history = [ASK, {"role": "assistant", "content": None, "tool_calls": [PARIS]}, RESULTS[0]]
    prompt = text(chatml, history)
    assert "# Tools" not in prompt
    assert f"<|im_start|>assistant\n{render_tool_call(PARIS)}<|im_end|>\n<|im_start|>tool\n18 C" in prompt


@pytest.mark.parametrize("content", [None, "Let me look."])
def test_the_next_turns_prompt_extends_the_prompt_and_the_generated_call(chatml, content) -> None:
    first = chatml.render_chat([SYSTEM, ASK], TOOLS)
    answer = (f"{content}\n" if content else "") + render_tool_call(PARIS)  # what the model wrote
    said = {"role": "assistant", "content": content, "tool_calls": [PARIS]}
    second = chatml.render_chat([SYSTEM, ASK, said, RESULTS[0]], TOOLS)
    generated = generated_ids(chatml, answer)
    assert second[: len(first) + len(generated)] == first + generated
    assert chatml.decode(second[len(first) + len(generated) :]) == (
        "\n<|im_start|>tool\n18 C<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_renders_tools_gets_the_same_ids_as_before(qwen) -> None:
    said = {"role": "assistant", "content": None, "tool_calls": [PARIS, OSLO]}
    for messages, tools in (([SYSTEM, ASK], TOOLS), ([SYSTEM, ASK, said, *RESULTS], TOOLS), ([ASK, said], None)):
        assert qwen.render_chat(messages, tools) == whole_ids(qwen, messages, tools)
    shown = text(qwen, [ASK], TOOLS)
    assert "# Tools\n\nYou may call one or more functions" in shown and tools_block(TOOLS) not in shown


def test_a_chat_without_tools_is_rendered_as_before_and_probes_nothing(chatml, monkeypatch) -> None:
    def refuse(render):
        raise AssertionError("probed a chat without tools")

    monkeypatch.setattr(generic_tools, "probe_template", refuse)
    monkeypatch.setattr(generic_tools, "_memo", {})
    messages = [SYSTEM, ASK, {"role": "assistant", "content": "Sunny."}]
    assert chatml.render_chat(messages) == whole_ids(chatml, messages)


def test_rewriting_leaves_the_callers_messages_alone() -> None:
    said = {"role": "assistant", "content": None, "tool_calls": [PARIS]}
    history = [dict(SYSTEM), ASK, said, RESULTS[0]]
    abilities = TemplateAbilities(renders_tools=False, renders_tool_role=False, renders_system=True)
    rewritten = rewrite_chat(history, TOOLS, abilities)
    assert history == [SYSTEM, ASK, said, RESULTS[0]]
    assert [m["role"] for m in rewritten] == ["system", "user", "assistant", "user"]
    assert rewritten[2] == {"role": "assistant", "content": render_tool_call(PARIS)}
