"""OpenAI's ``tool_choice`` and the tool list it picks from: the checks, and the start of a call that forces a choice.

:func:`check_tool_choice` turns a choice into the text appended to the prompt (``"required"``: the opening of a call;
a named function: the call up to its arguments), :func:`encode_forced` into the ids the model would have generated
for it, and :func:`check_tool_names` refuses a list whose functions have no name or share one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from prefixcache.chat.template import repeated_name
from prefixcache.chat.tool_calls import TOOL_CALL_OPEN
from prefixcache.errors import InvalidArgumentError

__all__ = ["check_tool_choice", "check_tool_names", "encode_forced"]


def check_tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]] | None) -> str:
    """Validate OpenAI's ``tool_choice`` against ``tools``; returns the text that forces it (appended to the prompt).

    ``None``, ``"auto"`` and ``"none"`` force nothing (``""``); ``"required"`` forces the start of a call,
    ``<tool_call>\\n{"name": "``; ``{"type": "function", "function": {"name": N}}`` forces the call up to its
    arguments, ``<tool_call>\\n{"name": "N", "arguments":``.  Both end where the template's own rendering of the
    finished call has a token boundary (a BPE pre-tokenizer keeps a space with what follows it: Qwen2.5 encodes the
    template's ``"arguments": {"`` as ``":`` and `` {"``; a forced lone space was a token the template never writes),
    so the forced ids are a prefix of the next turn's prompt and that turn hits all of them.
    Raises :class:`InvalidArgumentError` for anything else, ``"required"`` or a name without tools, or a name that is
    not a tool's.  (:func:`~prefixcache.engine.chat.prepare_chat` also refuses a forced call where no grammar can
    constrain the rest of it: llguidance, extra ``structured``, missing, or a tokenizer it cannot read.)
    """
    if tool_choice is None or tool_choice in ("auto", "none"):
        return ""
    known = [_tool_name(tool) for tool in tools or ()]
    if tool_choice == "required":
        if not known:
            raise InvalidArgumentError("tool_choice 'required' needs tools")
        return f'{TOOL_CALL_OPEN}\n{{"name": "'
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or name not in known:
            raise InvalidArgumentError(f"tool_choice names function {name!r}, which is not among the tools {known}")
        # As JSON, so that a name with a quote or a backslash still leaves a call the parser reads back.
        return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments":'
    raise InvalidArgumentError(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}, "
        f"got {tool_choice!r}"
    )


def _tool_name(tool: Mapping[str, Any]) -> Any:
    function = tool.get("function")
    return (function if isinstance(function, Mapping) else tool).get("name")


def check_tool_names(tools: Sequence[Mapping[str, Any]] | None) -> None:
    """Refuse a function with no name or two tools of one name (``tools`` already passed
    :func:`~prefixcache.chat.template.validate_tools`: every tool is an object).  O(len(tools)).

    Raises:
        InvalidArgumentError: naming the tool (``tools[i].function.name`` or ``tools[i].name``) and, for a repeat,
            the first tool of that name.
    """
    # The server refuses such lists too (a 400): in-process callers (LangChain's bind_tools, smolagents) get the same
    # checks.  A tool of another kind (a hosted or custom one, named elsewhere or not at all) is left to the template,
    # as a replayed log may hold any.
    names = [_tool_name(tool) for tool in tools or ()]
    for index, (tool, name) in enumerate(zip(tools or (), names, strict=True)):
        if ("function" in tool or "name" in tool) and (not isinstance(name, str) or not name):
            where = f"tools[{index}].function.name" if "function" in tool else f"tools[{index}].name"
            raise InvalidArgumentError(f"{where} must be a non-empty string, got {name!r}")
    repeat = repeated_name([name if isinstance(name, str) else object() for name in names])  # only str names match
    if repeat is not None:
        index, first = repeat
        raise InvalidArgumentError(
            f"tools[{index}] is named {names[index]!r}, as tools[{first}] is; each tool needs its own name"
        )


def encode_forced(tokenizer: Any, text: str) -> list[int]:
    """The ids of the forced text :func:`check_tool_choice` returned (``[]`` for ``""``): ``<tool_call>`` as the one
    added token the model generates where the tokenizer has it (Qwen's), spelled out otherwise (the byte tokenizer)."""
    if not text:
        return []
    try:
        opener = [tokenizer.special_token_id(TOOL_CALL_OPEN)]
    except InvalidArgumentError:
        return tokenizer.encode(text)
    return opener + tokenizer.encode(text[len(TOOL_CALL_OPEN) :])
