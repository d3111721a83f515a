"""A ChatML chat template (Qwen-style) that renders OpenAI-format messages as text and special-token segments.

Every message becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.  An assistant message's ``tool_calls``
follow its content as ``\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, exactly as
Qwen2.5's template writes them (and as the model generates them), so two conversations that differ only in the
call made render differently from that call on.  A ``tools`` list (OpenAI function schemas) is written into the
system message, after the system prompt, as one JSON object per line; without a system message a default one
carries them, so tools always sit in the prefix every turn shares.
``add_generation_prompt`` appends ``<|im_start|>assistant\\n``.

The rendering is a list of :class:`Segment` rather than a string so that any tokenizer turns the special
markers into their ids while encoding the text around them as plain text (a user typing ``<|im_end|>`` must
not end the turn).  Rendering is append-only: the prompt for turn *i* plus the assistant's answer equals the
rendering of the conversation through that answer, which is what makes multi-turn prefix caching hit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from prefixcache.chat.tool_calls import call_arguments, call_name, render_tool_call
from prefixcache.errors import TemplateError

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "IM_END",
    "IM_START",
    "MAX_JSON_DEPTH",
    "RESERVED_TEMPLATE_VARIABLES",
    "ROLES",
    "Segment",
    "check_json_depth",
    "check_template_kwargs",
    "encode_segments",
    "join_text_parts",
    "message_text",
    "render_segments",
    "render_text",
    "validate_messages",
    "validate_tools",
]

ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})
MAX_JSON_DEPTH = 100
"""How deep objects and arrays may nest in a tool schema or a tool call's arguments.  Far above any real schema, and
far below where ``json.dumps`` (and a Jinja template's ``tojson``) run out of Python's recursion limit."""
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
"""System prompt used only to hold the tools block when the conversation has no system message."""

_TOOLS_HEADER = (
    "\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


RESERVED_TEMPLATE_VARIABLES: frozenset[str] = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "conversation",
        "chat_template",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""Names a caller's extra template variables may not take: those the renderer sets itself (``messages``, ``tools``,
``add_generation_prompt``) and the options of transformers' ``apply_chat_template``, which would be taken as options
(or fail as given twice) rather than reach the template."""


def check_template_kwargs(template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``template_kwargs`` (extra variables for a chat template, such as Qwen3's ``enable_thinking`` or gpt-oss's
    ``reasoning_effort``) as a new dict; ``None`` gives ``{}``.  O(len(template_kwargs)).

    Raises :class:`TemplateError` for a non-mapping, a name that is not a string, or a reserved name
    (:data:`RESERVED_TEMPLATE_VARIABLES`).
    """
    if template_kwargs is None:
        return {}
    if not isinstance(template_kwargs, Mapping):
        raise TemplateError(f"template variables must be an object of names to values, got {template_kwargs!r}")
    for name in template_kwargs:
        if not isinstance(name, str) or not name:
            raise TemplateError(f"template variable names must be non-empty strings, got {name!r}")
        if name in RESERVED_TEMPLATE_VARIABLES:
            raise TemplateError(f"{name!r} is set by the renderer, not a template variable a request can set")
    return dict(template_kwargs)


class Segment(NamedTuple):
    """One piece of a rendering: ``("text", s)`` is encoded as plain text, ``("special", name)`` as one id."""

    kind: Literal["text", "special"]
    value: str


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Check that ``messages`` is a sequence of ``{"role": <one of ROLES>, "content": str}`` mappings.

    An assistant message may carry ``tool_calls`` (a list of OpenAI calls, ``{"function": {"name": str, "arguments":
    JSON string or object}}``, or the flat ``{"name", "arguments"}`` form) and then a ``None`` or missing content.
    Other keys (``tool_call_id``, ``name``) are allowed and not rendered.  O(len(messages)).
    Raises :class:`TemplateError` naming the offending message index and what is allowed.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TemplateError(f"messages must be a list of objects, got {type(messages).__name__}")
    allowed = ", ".join(sorted(ROLES))
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(
                f"message {index} must be an object with role and content, got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise TemplateError(f"message {index} has role {role!r}; allowed roles: {allowed}")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise TemplateError(f"message {index} ({role}) has tool_calls; only assistant messages may")
            _validate_tool_calls(index, tool_calls)
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and tool_calls):
            raise TemplateError(
                f"message {index} ({role}) has content of type {type(content).__name__}; content must be a string"
                " (or null in an assistant message with tool_calls)"
            )


def _validate_tool_calls(index: int, tool_calls: Any) -> None:
    if isinstance(tool_calls, (str, bytes, Mapping)) or not isinstance(tool_calls, Sequence):
        raise TemplateError(f"message {index}: tool_calls must be a list of objects")
    for number, call in enumerate(tool_calls):
        if not isinstance(call, Mapping):
            raise TemplateError(f"message {index}: tool call {number} must be an object")
        name = call_name(call)
        if not isinstance(name, str) or not name:
            raise TemplateError(f"message {index}: tool call {number} has no function name")
        try:
            arguments = call_arguments(call)
        except (ValueError, RecursionError):
            raise TemplateError(
                f"message {index}: tool call {number} ({name}) has arguments that are not JSON"
            ) from None
        if not isinstance(arguments, Mapping):
            raise TemplateError(f"message {index}: tool call {number} ({name}) arguments must be a JSON object")
        check_json_depth(arguments, f"message {index}: tool call {number} ({name}) arguments")
        try:
            json.dumps(arguments)
        except (TypeError, ValueError) as exc:
            raise TemplateError(f"message {index}: tool call {number} ({name}) arguments: {exc}") from None


def join_text_parts(content: Any) -> Any:
    """OpenAI content given as a list of ``{"type": "text", "text": ...}`` parts, joined by newlines (as vLLM does);
    any other value is returned unchanged (and validated later).  Raises :class:`TemplateError` for a part that is
    not text (images and audio cannot be rendered by a text-only template)."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise TemplateError(f"only text content parts can be rendered, got a {kind!r} part")
        texts.append(part["text"])
    return "\n".join(texts)


def message_text(message: Mapping[str, Any]) -> str:
    """The text a message renders to after ``<|im_start|>{role}\\n``: its content, then its tool calls.

    With calls and no content the first call starts the turn (Qwen2.5 writes no blank line there).
    """
    content = message.get("content") or ""
    calls = "".join("\n" + render_tool_call(call) for call in message.get("tool_calls") or ())
    return content + calls if content else calls[1:]


def check_json_depth(value: Any, what: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse ``value`` if its dicts and lists nest more than ``limit`` deep.  Iterative, so any depth is measured
    without recursing.  O(elements).

    Raises:
        TemplateError: naming ``what`` and the limit.
    """
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            raise TemplateError(f"{what} nests objects and arrays more than {limit} levels deep")
        stack.extend((child, depth + 1) for child in children)


def repeated_name(names: Sequence[Any]) -> tuple[int, int] | None:
    """``(index, first index)`` of the first name in ``names`` that an earlier one already has, or None: two tools of
    one name leave to chance which one the model's call runs (OpenAI refuses such a list).  O(len(names))."""
    first: dict[Any, int] = {}
    for index, name in enumerate(names):
        if first.setdefault(name, index) != index:
            return index, first[name]
    return None


def validate_tools(tools: Sequence[Mapping[str, Any]] | None) -> None:
    """Check that ``tools`` is ``None`` or a list of JSON-serialisable objects (OpenAI function schemas, whose
    ``function``, where given, is an object), none nested more than :data:`MAX_JSON_DEPTH` deep.

    Raises :class:`TemplateError` naming the offending tool index.
    """
    if tools is None:
        return
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TemplateError(f"tools must be a list of objects, got {type(tools).__name__}")
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TemplateError(f"tool {index} must be an object (function schema), got {type(tool).__name__}")
        if "function" in tool and not isinstance(tool["function"], Mapping):
            function = type(tool["function"]).__name__
            raise TemplateError(f"tool {index}'s function must be an object (name, parameters), got {function}")
        check_json_depth(tool, f"tool {index}")
        try:
            json.dumps(tool)
        except (TypeError, ValueError) as exc:
            raise TemplateError(f"tool {index} is not JSON-serialisable: {exc}") from None


def _tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    # Key order is kept (not sorted) so the text matches what the caller wrote, as Qwen's template does;
    # the same tools object therefore always renders to the same bytes.
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _TOOLS_HEADER + lines + _TOOLS_FOOTER


def render_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[Segment]:
    """Render ``messages`` (and ``tools``) as ChatML segments.

    An empty ``tools`` list counts as no tools.  An empty ``messages`` list is allowed (it renders the tools
    block, if any, and the generation prompt).  O(total characters).
    Raises :class:`TemplateError` for an unknown role, non-string content, or malformed tools.
    """
    validate_messages(messages)
    validate_tools(tools)
    segments: list[Segment] = []

    def emit(role: str, content: str) -> None:
        segments.append(Segment("special", IM_START))
        segments.append(Segment("text", f"{role}\n{content}"))
        segments.append(Segment("special", IM_END))
        segments.append(Segment("text", "\n"))

    rest: Sequence[Mapping[str, Any]] = messages
    if tools:
        has_system = bool(messages) and messages[0]["role"] == "system"
        system_prompt = message_text(messages[0]) if has_system else DEFAULT_SYSTEM_PROMPT
        emit("system", system_prompt + _tools_block(tools))
        rest = messages[1:] if has_system else messages
    for message in rest:
        emit(message["role"], message_text(message))
    if add_generation_prompt:
        segments.append(Segment("special", IM_START))
        segments.append(Segment("text", "assistant\n"))
    return segments


def render_text(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The rendering as one string, specials spelled out; same arguments and errors as :func:`render_segments`."""
    return "".join(segment.value for segment in render_segments(messages, tools, add_generation_prompt))


def encode_segments(
    segments: Sequence[Segment],
    encode: Callable[[str], list[int]],
    special_token_id: Callable[[str], int],
) -> list[int]:
    """Token ids of ``segments``: text through ``encode``, specials through ``special_token_id``.

    Text segments are encoded one by one, never merged across a special, exactly as a server applying this
    template would.  Errors are those of the two callables.
    """
    ids: list[int] = []
    for kind, value in segments:
        if kind == "special":
            ids.append(special_token_id(value))
        else:
            ids.extend(encode(value))
    return ids
