"""Tools for a chat template that cannot show them: prefixcache writes the tools block and the tool history itself.

Many chat templates (SmolLM2's ChatML one, Llama 2's, most small models') never read ``tools``: handed to
``apply_chat_template``, the tools vanish without an error, and under ``tool_choice: "auto"`` the model can never
call one.  Nor do such templates show an assistant's ``tool_calls`` (SmolLM2's fails on their ``None`` content) or,
some of them, a ``role: "tool"`` message.  The idea is llama.cpp server's generic tool-call handling (its chat
template capabilities are probed with sample chats, and a template lacking one gets the chat rewritten into what it
can render); the format here is the Hermes one that the rest of prefixcache parses, forces and constrains
(:mod:`prefixcache.chat.tool_calls`), not llama.cpp's JSON envelope.

:func:`probe_template` renders a few tiny chats holding sentinel strings to learn what a template shows
(:class:`TemplateAbilities`); :func:`template_abilities` memoises that per key (a tokenizer's name and template).
Where tools are not shown, :func:`rewrite_chat` makes a chat the template can render:

- :func:`tools_block` (each function's name, description and parameters as JSON, one per line, and how to call
  one) is appended to the first system message's content, or is a new first system message when there is none
  (prepended to the first user message instead where the template does not show a system message);
- an assistant message with ``tool_calls`` becomes one whose content is its content followed by each call as
  :func:`~prefixcache.chat.tool_calls.render_tool_call` writes it, the text the model generated, so the next turn's
  prompt extends the previous prompt + answer and hits the cache;
- a ``role: "tool"`` message stays one where the template shows a message of that role (ChatML templates that
  write any role); otherwise each run of consecutive tool messages becomes one user message, each result inside
  ``<tool_response>\\n...\\n</tool_response>``, joined by a newline, as Qwen2.5's template writes them (a template
  that insists on alternating user and assistant turns accepts this).

:func:`for_template` is the one call a renderer makes: it returns its arguments unchanged when the chat has nothing
of tools or the template shows tools, so plain chats and tool-aware templates render byte for byte as before.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.chat.template import message_text

__all__ = [
    "TemplateAbilities",
    "TemplateRender",
    "for_template",
    "probe_template",
    "rewrite_chat",
    "template_abilities",
    "tools_block",
]

TemplateRender = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]
"""``render(messages, tools)``: a template's text for a chat, without the generation prompt; may raise anything."""

_NAME = "prefixcache_probe_function"
_DESCRIPTION = "prefixcache probe: a function description"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": _NAME, "description": _DESCRIPTION, "parameters": {"type": "object", "properties": {}}},
}
_USER = {"role": "user", "content": "prefixcache probe: a question"}
_ASSISTANT = {"role": "assistant", "content": "prefixcache probe: an answer"}
_RESULT = "prefixcache probe: a tool result"
_SYSTEM = "prefixcache probe: a system prompt"

_MEMO_TEMPLATES = 64
"""Templates whose abilities :func:`template_abilities` remembers before starting over (a bound on memory only)."""
_memo: dict[Hashable, TemplateAbilities] = {}

_BLOCK_HEAD = (
    "# Tools\n\n"
    "You can call functions to help you answer. Each one is described below, one JSON object per line: its name, "
    "what it does, and the JSON Schema of its arguments.\n"
    "<tools>"
)
_BLOCK_TAIL = (
    "\n</tools>\n\n"
    "To call a function, write a block like this one, with the function's name and a JSON object of arguments that "
    "follows its schema:\n"
    '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>\n'
    "Write one block per call; you may write text before the first block, but nothing after the last one. The "
    "results come back to you in a later message. When no function helps, answer in plain text."
)


@dataclass(frozen=True, slots=True)
class TemplateAbilities:
    """What a chat template shows of a chat: the ``tools`` list (``renders_tools``), a ``role: "tool"`` message's
    content (``renders_tool_role``), a system message's content (``renders_system``).  A template that cannot even
    render a one-message chat gets all three True: prefixcache then changes nothing and the template's own error
    reaches the caller, as before."""

    renders_tools: bool
    renders_tool_role: bool
    renders_system: bool


def _shows(render: TemplateRender, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
    # A template fails on a chat it cannot show in any way it likes: raise_exception, a TypeError, an UndefinedError.
    try:
        text = render(messages, tools)
    except Exception:  # noqa: BLE001 - see above
        return None
    return text if isinstance(text, str) else None


def probe_template(render: TemplateRender) -> TemplateAbilities:
    """Learn what a template shows by rendering four chats of at most three messages, each with a sentinel string.

    ``renders_tools``: a user message rendered with one sentinel tool differs from it rendered with none and holds
    the tool's name or description.  ``renders_tool_role``: user, assistant, then a tool message renders and holds the
    tool message's content (a template that refuses the role or drops the message does not).  ``renders_system``:
    a system message before the user's renders and holds its content.  Any exception from ``render`` counts as "does
    not show it".  Cost: four renderings of tiny chats (0.3 ms with a compiled Jinja template); memoise it with
    :func:`template_abilities`.
    """
    plain = _shows(render, [dict(_USER)], None)
    if plain is None:
        return TemplateAbilities(True, True, True)
    with_tool = _shows(render, [dict(_USER)], [copy.deepcopy(_PROBE_TOOL)])
    renders_tools = with_tool is not None and with_tool != plain and (_NAME in with_tool or _DESCRIPTION in with_tool)
    result = {"role": "tool", "tool_call_id": "call_probe", "name": _NAME, "content": _RESULT}
    tool_chat = _shows(render, [dict(_USER), dict(_ASSISTANT), result], None)
    system_chat = _shows(render, [{"role": "system", "content": _SYSTEM}, dict(_USER)], None)
    return TemplateAbilities(
        renders_tools=renders_tools,
        renders_tool_role=tool_chat is not None and _RESULT in tool_chat,
        renders_system=system_chat is not None and _SYSTEM in system_chat,
    )


def template_abilities(key: Hashable, render: TemplateRender) -> TemplateAbilities:
    """:func:`probe_template` of ``render``, memoised under ``key`` (which must change whenever the template does:
    :class:`~prefixcache.chat.hf_tokenizer.HFTokenizer` gives its name and template source).  O(1) after the first
    call per key; two threads that miss at once both probe, harmlessly (same answer)."""
    found = _memo.get(key)
    if found is None:
        found = probe_template(render)
        if len(_memo) >= _MEMO_TEMPLATES:
            _memo.clear()
        _memo[key] = found
    return found


def _functions(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``{"name", "description", "parameters"}`` (those given) of each function tool, in order.  A tool of another
    kind (hosted, custom), or without a name, is left out: the model could not call it in this format."""
    shown = []
    for tool in tools:
        function = tool.get("function", tool)
        if tool.get("type", "function") != "function" or not isinstance(function, Mapping):
            continue
        if not isinstance(function.get("name"), str) or not function["name"]:
            continue
        shown.append({key: function[key] for key in ("name", "description", "parameters") if key in function})
    return shown


def tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system-prompt text that describes ``tools`` (OpenAI function tools) and how to call them; ``""`` when
    none is a function.  Keys keep the caller's order, so the same tools always give the same bytes (and tokens).
    O(size of the tools' JSON).  Raises ``TypeError`` or ``ValueError`` for tools that are not JSON (validated before
    this, by :func:`~prefixcache.chat.template.validate_tools`)."""
    functions = _functions(tools)
    if not functions:
        return ""
    lines = "".join("\n" + json.dumps(function, ensure_ascii=False) for function in functions)
    return _BLOCK_HEAD + lines + _BLOCK_TAIL


def _tool_responses(contents: list[str]) -> dict[str, Any]:
    return {"role": "user", "content": "\n".join(f"<tool_response>\n{c}\n</tool_response>" for c in contents)}


def rewrite_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    abilities: TemplateAbilities,
) -> list[dict[str, Any]]:
    """``messages`` rewritten for a template that does not show tools (see the module's docstring): the tools block
    in the system prompt, calls in the assistant's content, tool results in messages the template shows.  Give the
    template the result and no ``tools``.  Messages are validated before this
    (:func:`~prefixcache.chat.template.validate_messages`); other keys (``name``, ``tool_call_id``) are kept, except an
    assistant's ``tool_calls``, which are now in its content.  New dicts; ``messages`` is not changed.
    O(total characters).  Raises ``ValueError`` for a call whose arguments are not JSON (refused earlier by
    validation)."""
    out: list[dict[str, Any]] = []
    results: list[str] = []
    for message in messages:
        if message["role"] == "tool" and not abilities.renders_tool_role:
            results.append(message.get("content") or "")
            continue
        if results:
            out.append(_tool_responses(results))
            results = []
        if message.get("tool_calls"):
            rest = {key: value for key, value in message.items() if key != "tool_calls"}
            out.append({**rest, "content": message_text(message)})
        else:
            out.append(dict(message))
    if results:
        out.append(_tool_responses(results))
    block = tools_block(tools or ())
    if block:
        _place_block(out, block, abilities)
    return out


def _place_block(messages: list[dict[str, Any]], block: str, abilities: TemplateAbilities) -> None:
    """Put ``block`` where every turn of a conversation renders it the same way: in the first system message, or as
    a new one (or, where the template shows no system message, before the first user message's text)."""
    for message in messages:
        if message["role"] == "system":
            message["content"] = f"{message['content']}\n\n{block}" if message.get("content") else block
            return
    if not abilities.renders_system:
        for message in messages:
            if message["role"] == "user":
                message["content"] = f"{block}\n\n{message['content']}" if message.get("content") else block
                return
    messages.insert(0, {"role": "system", "content": block})


def _has_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> bool:
    return bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def for_template(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    key: Hashable,
    render: TemplateRender,
) -> tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None]:
    """``(messages, tools)`` as the template of ``render`` (memoised under ``key``, see :func:`template_abilities`)
    should get them: unchanged when the chat holds no tools, tool calls or tool messages (the template is not even
    probed) or when the template shows tools itself; else ``(rewrite_chat(...), None)``.  O(len(messages)) to look,
    plus :func:`rewrite_chat` where it rewrites.  Raises as :func:`rewrite_chat`."""
    if not _has_tools(messages, tools):
        return messages, tools
    abilities = template_abilities(key, render)
    if abilities.renders_tools:
        return messages, tools
    return rewrite_chat(messages, tools, abilities), None
