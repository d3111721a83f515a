"""Scenario files: chat transcripts (JSONL, one conversation per line) and Mooncake request traces.

The other input formats (request logs, OpenAI Batch files, ShareGPT) and the detection of each are in
:mod:`prefixcache.replay.formats`.

Chat format, one object per line (blank lines ignored, extra keys such as ``"source"`` ignored)::

    {"id": str, "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...],
     "tools": [<OpenAI function schema>, ...]}            # "tools" optional

OpenAI tool calling is kept: an assistant message's ``tool_calls`` (its ``content`` may then be null) and a tool
message's ``tool_call_id`` and ``name``; the chat template renders the calls.

Mooncake format (kvcache-ai/Mooncake FAST'25 traces), one request per line::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...]}

Each hash id names one 512-token block *together with everything before it*, so equal ids at equal positions
mean a shared prefix.  No token ids are published; :func:`iter_mooncake` gives hash id ``h`` the ids
``h*512 .. h*512+511`` (the last block cut to the remainder), which keeps exactly that prefix structure.  Those
ids are cache keys, not vocabulary entries: they go far beyond any model's vocabulary.

Every problem in a file is a :class:`ScenarioError` carrying the path and 1-based line number.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixcache.chat.template import validate_messages, validate_tools
from prefixcache.errors import InvalidArgumentError, ScenarioError, TemplateError
from prefixcache.replay.lines import NOT_FOUND, iter_json_records

__all__ = [
    "MESSAGE_KEYS",
    "MOONCAKE_BLOCK_TOKENS",
    "Conversation",
    "ScenarioFile",
    "TraceRequest",
    "default_tools_for",
    "expand_paths",
    "iter_mooncake",
    "load_mooncake",
    "load_scenario",
]

logger = logging.getLogger(__name__)

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in the published Mooncake traces."""

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Conversation:
    """One chat transcript from a scenario file.

    ``messages`` holds fresh ``{"role", "content"}`` dicts plus, where present, ``tool_calls``, ``tool_call_id`` and
    ``name`` (:data:`MESSAGE_KEYS`; other keys are dropped); ``tools`` is the
    line's own ``"tools"`` or else the tools given to :func:`load_scenario`.  ``source`` and ``line_no``
    (1-based) say where it came from.  Not hashable (it holds dicts).
    """

    id: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    source: str
    line_no: int

    @property
    def assistant_turns(self) -> tuple[int, ...]:
        """Indices ``i`` of the assistant messages: one replay request each, prompted with ``messages[:i]``."""
        return tuple(i for i, message in enumerate(self.messages) if message["role"] == "assistant")


@dataclass(frozen=True, slots=True)
class ScenarioFile:
    """A loaded chat scenario: its conversations in file order and, with ``skip_invalid``, the rejected lines."""

    path: str
    conversations: tuple[Conversation, ...]
    skipped: tuple[ScenarioError, ...]

    @property
    def num_requests(self) -> int:
        """Assistant turns over all conversations: the number of requests a replay sends."""
        return sum(len(conversation.assistant_turns) for conversation in self.conversations)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One Mooncake request: arrival time, synthetic prompt ids (``len == input_length``), tokens to generate."""

    timestamp_ms: int
    token_ids: array  # array('i'): int32, 4 bytes per token; a list would take ~9x the memory
    output_length: int

    @property
    def num_input_tokens(self) -> int:
        return len(self.token_ids)


MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
"""Message keys a scenario keeps; ``role`` and ``content`` always, the others when present."""


def _message_record(message: Mapping[str, Any]) -> dict[str, Any]:
    record = {"role": message["role"], "content": message.get("content")}
    record.update({key: message[key] for key in MESSAGE_KEYS[2:] if message.get(key) is not None})
    return record


def _parse_tools(value: Any) -> tuple[dict[str, Any], ...]:
    try:
        validate_tools(value)
    except TemplateError as exc:
        raise ValueError(str(exc)) from None
    return tuple(dict(tool) for tool in value)


def _parse_conversation(
    obj: Any, path: Path, line_no: int, shared_tools: tuple[dict[str, Any], ...] | None
) -> Conversation:
    where = (str(path), line_no)
    if not isinstance(obj, dict):
        raise ScenarioError(f"expected a JSON object, got {type(obj).__name__}", *where)
    conversation_id = obj.get("id", f"{path.stem}:{line_no}")
    if not isinstance(conversation_id, str) or not conversation_id:
        raise ScenarioError(f"'id' must be a non-empty string, got {conversation_id!r}", *where)
    messages = obj.get("messages")
    if messages is None:
        raise ScenarioError("missing 'messages'", *where)
    if not isinstance(messages, list) or not messages:
        raise ScenarioError("'messages' must be a non-empty list of {role, content} objects", *where)
    try:
        validate_messages(messages)
    except TemplateError as exc:
        raise ScenarioError(str(exc), *where) from None
    tools = shared_tools
    if obj.get("tools") is not None:
        try:
            tools = _parse_tools(obj["tools"])
        except ValueError as exc:
            raise ScenarioError(f"bad 'tools': {exc}", *where) from None
    return Conversation(
        id=conversation_id,
        messages=tuple(_message_record(m) for m in messages),
        tools=tools,
        source=str(path),
        line_no=line_no,
    )


def load_scenario(
    path: str | Path,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    skip_invalid: bool = False,
    progress: Callable[[Iterable[Any], str, int | None, str], Iterable[Any]] | None = None,
    convert: Callable[[Any], Any] | None = None,
) -> ScenarioFile:
    """Load a chat scenario file (format in the module docstring; JSON Lines, or one JSON array of the same
    objects).  O(file size).

    ``tools`` are the shared function schemas for conversations whose line has no ``"tools"`` of its own (a
    line's own tools win); pass ``default_tools_for(path)`` to pick up a sibling ``*_tools.json``.
    Conversation ids must be unique within the file; a line without ``"id"`` gets ``"<file stem>:<line_no>"``.

    Raises :class:`ScenarioError` (with path and line) for the first bad line: not UTF-8 or JSON, not an
    object, missing or empty ``messages``, unknown role, non-string content, ``tools`` not a list of objects,
    duplicate id.  With ``skip_invalid=True`` bad lines are collected in ``ScenarioFile.skipped`` instead
    (a line that is not valid UTF-8 or JSON too).  A missing or unreadable file always raises.
    Raises :class:`InvalidArgumentError` if ``tools`` itself is malformed.  ``progress(items, description, total,
    unit)``, when given, wraps the lines as they are read (a tqdm bar).  ``convert``, when given, turns each parsed
    line of another conversation format into this one first (ShareGPT: :mod:`prefixcache.replay.formats`); a
    :class:`ValueError` it raises is that line's error.
    """
    path = Path(path)
    shared_tools: tuple[dict[str, Any], ...] | None = None
    if tools is not None:
        try:
            shared_tools = _parse_tools(tools)
        except ValueError as exc:
            raise InvalidArgumentError(f"bad tools argument: {exc}") from None
    conversations: list[Conversation] = []
    skipped: list[ScenarioError] = []
    first_line_of: dict[str, int] = {}
    lines = iter_json_records(path)
    if progress is not None:
        lines = progress(lines, f"read {path.name}", None, "line")
    for line_no, obj, error in lines:
        try:
            if error is not None:
                raise error
            if convert is not None:
                try:
                    obj = convert(obj)
                except ScenarioError:
                    raise
                except ValueError as exc:
                    raise ScenarioError(str(exc), str(path), line_no) from None
            conversation = _parse_conversation(obj, path, line_no, shared_tools)
            if conversation.id in first_line_of:
                raise ScenarioError(
                    f"duplicate id {conversation.id!r} (first on line {first_line_of[conversation.id]})",
                    str(path),
                    line_no,
                )
        except ScenarioError as exc:
            if not skip_invalid:
                raise
            skipped.append(exc)
            continue
        first_line_of[conversation.id] = line_no
        conversations.append(conversation)
        if not conversation.assistant_turns:
            logger.warning(
                "%s:%d: conversation %r has no assistant message, so it makes no request",
                path,
                line_no,
                conversation.id,
            )
    return ScenarioFile(path=str(path), conversations=tuple(conversations), skipped=tuple(skipped))


def default_tools_for(path: str | Path) -> list[dict[str, Any]] | None:
    """Shared tools for scenario ``path``, read from a sibling ``*_tools.json``, or ``None`` if there is none.

    For ``dir/X.jsonl`` this tries ``dir/X_tools.json``, then ``dir/<P>_tools.json`` where ``<P>`` is ``X`` cut
    at its last underscore: ``tau_bench_airline_gpt4o.jsonl`` -> ``tau_bench_airline_tools.json`` (one tools
    file serves the trajectories of every model).
    Raises :class:`ScenarioError` if the tools file exists but is not a JSON list of objects.
    """
    path = Path(path)
    stem = path.stem
    candidates = [path.with_name(f"{stem}_tools.json")]
    if "_" in stem:
        candidates.append(path.with_name(f"{stem.rsplit('_', 1)[0]}_tools.json"))
    for candidate in candidates:
        if not candidate.is_file():
            continue
        try:
            tools = json.loads(candidate.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ScenarioError(f"cannot read tools: {exc}", str(candidate)) from None
        try:
            validate_tools(tools)
        except TemplateError as exc:
            raise ScenarioError(str(exc), str(candidate)) from None
        return tools
    return None


def expand_paths(paths: Sequence[str | Path]) -> list[Path]:
    """Scenario files from command-line paths: a file as given, a folder as its ``*.jsonl`` files, sorted by name.

    A file named more than once (again, through its folder, or by another spelling of its path) is kept once, where
    first named, with a warning: each file is a scenario of the report, keyed by its path.
    Raises :class:`ScenarioError` for a path that does not exist (``PATH: not found: no such file or folder``), is
    neither a regular file nor a folder, or is a folder with no ``*.jsonl`` file.
    """
    files: dict[Path, Path] = {}
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.glob("*.jsonl") if p.is_file())
            if not found:
                raise ScenarioError("folder has no *.jsonl scenario files", str(path))
        elif path.is_file():
            found = [path]
        elif not path.exists():
            raise ScenarioError(NOT_FOUND, str(path))
        else:
            raise ScenarioError("not a regular file or folder", str(path))
        for file in found:
            first = files.setdefault(file.resolve(), file)
            if first is not file:
                logger.warning("%s: named more than once (again as %s); replayed once", first, file)
    return list(files.values())


def _require_int(obj: dict[str, Any], key: str, minimum: int, where: tuple[str, int]) -> int:
    value = obj.get(key)
    # bool is an int subclass; True as a length is a data error, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ScenarioError(f"'{key}' must be an integer >= {minimum}, got {value!r}", *where)
    return value


def iter_mooncake(
    path: str | Path,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    limit: int | None = None,
    on_error: Callable[[ScenarioError], None] | None = None,
) -> Iterator[TraceRequest]:
    """Yield the requests of a Mooncake trace lazily, first ``limit`` non-blank lines only if given.

    ``block_tokens`` is the trace's block size (512 for the published traces), used both to expand hash ids and
    to check ``len(hash_ids) == ceil(input_length / block_tokens)``.  O(input_length) per request.
    Raises :class:`ScenarioError` (path, line) for a bad line: missing or non-integer fields, ``input_length``
    < 1, wrong number of hash ids, a negative hash id, or one whose token ids would not fit in int32; with
    ``on_error`` the error is handed to it instead and the line skipped.
    Raises :class:`InvalidArgumentError` for ``block_tokens`` < 1 or ``limit`` < 0.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise InvalidArgumentError(f"block_tokens must be a positive integer, got {block_tokens!r}")
    if limit is not None and limit < 0:
        raise InvalidArgumentError(f"limit must be >= 0, got {limit}")
    path = Path(path)
    for line_no, obj, error in itertools.islice(iter_json_records(path), limit):
        try:
            if error is not None:
                raise error
            yield _trace_request(obj, block_tokens, (str(path), line_no))
        except ScenarioError as exc:
            if on_error is None:
                raise
            on_error(exc)


def _trace_request(obj: Any, block_tokens: int, where: tuple[str, int]) -> TraceRequest:
    max_hash_id = (_INT32_MAX + 1) // block_tokens - 1
    if not isinstance(obj, dict):
        raise ScenarioError(f"expected a JSON object, got {type(obj).__name__}", *where)
    timestamp_ms = _require_int(obj, "timestamp", 0, where)
    input_length = _require_int(obj, "input_length", 1, where)
    output_length = _require_int(obj, "output_length", 0, where)
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list):
        raise ScenarioError(f"'hash_ids' must be a list of integers, got {type(hash_ids).__name__}", *where)
    expected_blocks = math.ceil(input_length / block_tokens)
    if len(hash_ids) != expected_blocks:
        raise ScenarioError(
            f"{len(hash_ids)} hash_ids for input_length {input_length}; "
            f"expected ceil({input_length}/{block_tokens}) = {expected_blocks}",
            *where,
        )
    token_ids = array("i")
    for h in hash_ids:
        if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h <= max_hash_id:
            raise ScenarioError(f"hash id {h!r} is not an integer in [0, {max_hash_id}] (int32 token ids)", *where)
        start = h * block_tokens
        token_ids.extend(range(start, start + block_tokens))
    del token_ids[input_length:]
    return TraceRequest(timestamp_ms=timestamp_ms, token_ids=token_ids, output_length=output_length)


def load_mooncake(
    path: str | Path,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    limit: int | None = None,
) -> list[TraceRequest]:
    """All requests of a Mooncake trace as a list; see :func:`iter_mooncake` for arguments and errors.

    Memory is 4 bytes per input token: the full published conversation trace (145 M tokens) takes ~580 MB, so
    prefer :func:`iter_mooncake` or ``limit`` for large traces.
    """
    return list(iter_mooncake(path, block_tokens=block_tokens, limit=limit))
