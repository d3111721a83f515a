"""Tool calls in generated text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` to OpenAI ``tool_calls``.

This is the format of Qwen2.5's chat template (Hermes-style function calling) and of our byte-level ChatML template:
the model writes an optional text answer, then one block per call, each holding a JSON object with ``name`` and
``arguments``.  :func:`parse_tool_calls` turns such text into the OpenAI shape (``id``, ``type: "function"``,
``function.name``, ``function.arguments`` as a JSON string) and :func:`render_tool_call` writes a call back as the
templates render it, so a parsed call re-renders to the bytes the model produced and the next turn hits the cache.

Each block is read as JSON from its open tag (:meth:`json.JSONDecoder.raw_decode`), and its end tag must follow the
object, so arguments that hold the text ``</tool_call>`` (a tool that edits files writing about tool calls) stay
inside their call.  A block that is not valid JSON, lacks a string ``name``, has non-object ``arguments`` or is
never closed makes the whole output plain text: the caller gets what the model wrote, never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ParsedOutput",
    "call_arguments",
    "call_name",
    "parse_tool_calls",
    "render_tool_call",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_JSON_SPACE = re.compile(r"[ \t\n\r]*")
"""What JSON counts as whitespace, and so what may stand between a tag and its object."""


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """Generated text split into the answer ``content`` (``None`` when only calls were made) and ``tool_calls``
    (OpenAI format dicts; empty when the text holds no well-formed call)."""

    content: str | None
    tool_calls: tuple[dict[str, Any], ...]

    @property
    def finish_reason(self) -> str | None:
        """``"tool_calls"`` when at least one call was parsed, else ``None`` (the caller keeps its own reason)."""
        return "tool_calls" if self.tool_calls else None


def call_name(call: Mapping[str, Any]) -> Any:
    """The function name of an OpenAI call (``{"function": {"name": ...}}``) or of the flat ``{"name": ...}`` form."""
    function = call.get("function")
    return (function if isinstance(function, Mapping) else call).get("name")


def call_arguments(call: Mapping[str, Any]) -> Any:
    """The arguments of a call as an object: OpenAI's JSON string is parsed, a mapping is returned as is.

    Raises ``ValueError`` when a string is not JSON.
    """
    function = call.get("function")
    arguments = (function if isinstance(function, Mapping) else call).get("arguments", {})
    if isinstance(arguments, str):
        return json.loads(arguments) if arguments.strip() else {}
    return arguments


def render_tool_call(call: Mapping[str, Any]) -> str:
    """The text a template writes for one call: ``<tool_call>\\n{"name": "N", "arguments": {...}}\\n</tool_call>``.

    Arguments go through ``json.dumps`` with default separators and ``ensure_ascii=False``, as the ``tojson`` filter
    of Hugging Face chat templates writes them.  Raises ``ValueError`` for non-JSON arguments.
    """
    name = call_name(call)
    arguments = json.dumps(call_arguments(call), ensure_ascii=False)
    return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": {arguments}}}\n{TOOL_CALL_CLOSE}'


def _call_id(index: int, name: str, arguments: str, salt: str) -> str:
    # Deterministic ids keep re-rendered transcripts (and so the cache) identical across runs.
    return "call_" + xxhash.xxh64(f"{salt}|{index}|{name}|{arguments}".encode()).hexdigest()


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _strict_call(obj: Any) -> tuple[str, str] | None:
    """``(name, arguments as JSON)`` of one block's decoded object, or ``None`` when it is not a call in strict JSON.

    Python's json reads NaN and Infinity (and turns 1e999 into inf), which no other JSON parser a client runs
    accepts, and ``\\ud800`` escapes into a lone surrogate, which cannot be sent as UTF-8: all make the block text.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    try:
        arguments_json = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        (obj["name"] + arguments_json).encode()
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return obj["name"], arguments_json


_DECODER = json.JSONDecoder(parse_constant=_not_json)


def _read_block(text: str, at: int) -> tuple[tuple[str, str], int] | None:
    """The call of the block opening at ``text[at:]`` and the index just past its end tag, or ``None``.

    The object is decoded from the open tag on, so a ``</tool_call>`` inside one of its strings is part of the
    arguments; only JSON whitespace may lie between the tags and the object.  O(length of the block).
    """
    start = _JSON_SPACE.match(text, at + len(TOOL_CALL_OPEN)).end()
    try:
        obj, end = _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None
    end = _JSON_SPACE.match(text, end).end()
    call = _strict_call(obj)
    if call is None or not text.startswith(TOOL_CALL_CLOSE, end):
        return None
    return call, end + len(TOOL_CALL_CLOSE)


def parse_tool_calls(text: str, *, id_salt: str = "") -> ParsedOutput:
    """Split generated ``text`` into content and OpenAI tool calls.  O(len(text)).

    Text before the first ``<tool_call>`` (stripped; ``None`` if empty) is the content; every block must hold a JSON
    object with a string ``name`` and object ``arguments`` (missing arguments count as ``{}``; strict JSON: no NaN or
    Infinity, nothing that is not valid UTF-8 once decoded) followed by ``</tool_call>``, and only whitespace
    may lie between and after blocks.  Otherwise the result is ``ParsedOutput(text, ())``.  Call ids are
    ``call_<xxh64>`` of ``id_salt``, the call's index, name and arguments.  Never raises.
    """
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ParsedOutput(text, ())
    calls: list[dict[str, Any]] = []
    position = start
    while True:
        at = text.find(TOOL_CALL_OPEN, position)
        if at < 0:
            break
        if text[position:at].strip():
            return ParsedOutput(text, ())
        block = _read_block(text, at)
        if block is None:
            return ParsedOutput(text, ())
        (name, arguments_json), position = block
        calls.append(
            {
                "id": _call_id(len(calls), name, arguments_json, id_salt),
                "type": "function",
                "function": {"name": name, "arguments": arguments_json},
            }
        )
    if text[position:].strip():
        return ParsedOutput(text, ())
    content = text[:start].rstrip()
    return ParsedOutput(content or None, tuple(calls))
