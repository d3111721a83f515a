"""Replay input formats: what each one is, how a file's format is told from its first record, and the readers of
request logs, OpenAI Batch input files and ShareGPT files (chat transcripts and Mooncake traces are read by
:mod:`prefixcache.replay.scenarios`).

Every format is JSON Lines, or one JSON array of the same objects (:mod:`prefixcache.replay.lines`):

=========  ==================================================================  ====================================
name       one record                                                          replayed as
=========  ==================================================================  ====================================
chat       ``{"id", "messages", "tools"}``: a whole conversation                a request per assistant turn, the
                                                                                recorded answer teacher forced
requests   an OpenAI chat-completions body, ``{"model", "messages", "tools",   one request: its messages are the
           ...}`` (``timestamp``, ``user``, sampling fields read past), or a   prompt, as sent; nothing generated
           completions body ``{"model", "prompt"}``                            is appended
batch      OpenAI Batch input: ``{"custom_id", "method": "POST", "url":        as ``requests``, one per body (per
           "/v1/chat/completions" | "/v1/completions", "body": {...}}``        prompt of a completions list)
sharegpt   ``{"id", "conversations": [{"from": "human" | "gpt" | "system",    as ``chat``
           "value": str}, ...]}`` (optional ``"system"``, ``"tools"``)
mooncake   ``{"timestamp", "input_length", "output_length", "hash_ids"}``     one request of synthetic token ids
=========  ==================================================================  ====================================

Detection (:func:`detect_format`) looks at the first record: ``hash_ids`` is Mooncake, ``custom_id`` with ``body`` is
Batch, ``conversations`` is ShareGPT; ``messages`` is a request when the record also has a chat-completions field
(:data:`REQUEST_FIELDS`: ``model``, ``timestamp``, ``user``, ``max_tokens``, ...) and its last message is not the
assistant's, and a transcript otherwise (every transcript written so far, the shared data included); ``prompt``
with ``model`` is a completions request.  A file of one format is not mixed with another.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixcache.chat.template import check_template_kwargs, join_text_parts, validate_messages, validate_tools
from prefixcache.errors import InvalidArgumentError, ScenarioError, TemplateError
from prefixcache.replay.lines import Record, iter_json_records
from prefixcache.replay.scenarios import MESSAGE_KEYS, ScenarioFile, load_scenario

__all__ = [
    "ACCEPTED_FORMATS",
    "BATCH_URLS",
    "FILE_FORMATS",
    "REQUEST_FIELDS",
    "SHAREGPT_ROLES",
    "LoggedRequest",
    "RequestLog",
    "detect_format",
    "input_format",
    "input_lines",
    "load_request_log",
    "load_sharegpt",
    "sharegpt_to_chat",
]

logger = logging.getLogger(__name__)

FILE_FORMATS: Mapping[str, str] = {
    "chat": "chat transcripts (a conversation per line, a request per assistant turn)",
    "requests": "request log (an OpenAI chat-completions body per line, each one request as sent)",
    "batch": "OpenAI Batch input (a request per line, each one request as sent)",
    "sharegpt": "ShareGPT conversations (a request per gpt turn)",
    "mooncake": "Mooncake trace (a request per line, 512 token ids per hash id)",
}
"""Each format's ``--format`` name and what the replay says it read."""

ACCEPTED_FORMATS = (
    '\n  chat transcripts {"messages": [...]}'
    '\n  request logs, an OpenAI chat-completions body per line {"model", "messages"}'
    '\n  OpenAI Batch input {"custom_id", "method", "url", "body"}'
    '\n  ShareGPT {"conversations": [{"from", "value"}]}'
    '\n  Mooncake traces {"hash_ids"}'
    "\n(JSON Lines or one JSON array; --format forces one)"
)
"""The formats a replay reads, for error messages."""

REQUEST_FIELDS = frozenset(
    {
        "model",
        "timestamp",
        "user",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "n",
        "stream",
        "stream_options",
        "stop",
        "seed",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "metadata",
        "store",
        "reasoning_effort",
        "chat_template_kwargs",
        "prompt_cache_key",
        "service_tier",
    }
)
"""Fields of a chat-completions body (and the ``timestamp`` a gateway log adds) that no transcript has."""

BATCH_URLS: Mapping[str, str] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
"""The Batch API endpoints a replay sends: the body's kind for each ``url``."""

SHAREGPT_ROLES: Mapping[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
}
"""ShareGPT ``from`` values and the chat role each becomes (the original dump has ``chatgpt``, ``bing``, ``bard``)."""


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    """One request of a request log or Batch file, as it was sent: chat ``messages`` (with ``tools`` and the chat
    template's extra variables, ``template_kwargs``) or a completions ``prompt`` (text, or token ids), exactly one of
    the two.  ``id`` is ``line<N>`` in a request log, the ``custom_id`` in a Batch file (``[k]`` appended for the
    k-th prompt of a list); ``line_no`` is 1-based."""

    id: str
    line_no: int
    model: str | None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    template_kwargs: dict[str, Any] | None = None
    prompt: str | tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class RequestLog:
    """A loaded request log or Batch file: its requests in file order and, with ``skip_invalid``, the bad lines."""

    path: str
    file_format: str
    requests: tuple[LoggedRequest, ...]
    skipped: tuple[ScenarioError, ...]


def _format_of(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return None
    if "hash_ids" in obj:
        return "mooncake"
    if "custom_id" in obj and "body" in obj:
        return "batch"
    if "conversations" in obj:
        return "sharegpt"
    if "messages" in obj:
        messages = obj["messages"]
        last = messages[-1] if isinstance(messages, list) and messages else None
        ends_answered = isinstance(last, dict) and last.get("role") == "assistant"
        return "requests" if not ends_answered and not REQUEST_FIELDS.isdisjoint(obj) else "chat"
    if "prompt" in obj and "model" in obj:
        return "requests"
    return None


EMPTY_FILE = "empty file: no conversations or requests"
"""What an input file without a record is told (after its name), whatever the format or mode."""


def input_lines(path: str | Path) -> Iterator[Record]:
    """The records of one replay input file (:func:`~prefixcache.replay.lines.iter_json_records`), the first read at
    once: the one place a replay, ``--sweep`` and ``--endpoint`` meet a file, so that a file none can use fails here,
    in one line naming it, whatever the format (told or forced).  O(first record; an array file is parsed whole), the
    rest as iterated.

    Raises :class:`ScenarioError` naming the file: it does not exist
    (:data:`~prefixcache.replay.lines.NOT_FOUND`), cannot be opened, or holds no record (:data:`EMPTY_FILE`: empty,
    only blank lines, or ``[]``).
    """
    path = Path(path)
    records = iter_json_records(path)
    first = next(records, None)
    if first is None:
        raise ScenarioError(EMPTY_FILE, str(path))
    return itertools.chain((first,), records)


def input_format(path: str | Path, file_format: str = "auto", *, skip_invalid: bool = False) -> str:
    """The format ``path`` is read as: ``file_format`` when forced, else told by :func:`detect_format`; either way
    after :func:`input_lines`' checks, so a forced format refuses a missing or empty file as detection does.
    O(first record).

    Raises :class:`ScenarioError` as :func:`input_lines` and :func:`detect_format`.
    """
    records = input_lines(path)
    if file_format != "auto":
        return file_format
    return detect_format(path, skip_invalid=skip_invalid, records=records)


def detect_format(path: str | Path, *, skip_invalid: bool = False, records: Iterable[Record] | None = None) -> str:
    """The format of ``path`` (a key of :data:`FILE_FORMATS`), told from its first record (rules in the module
    docstring).  Reads only up to that record (an array file is parsed whole), from ``records`` when given (its
    :func:`input_lines`).  With ``skip_invalid`` the first record of a known format decides, and the records before it
    are skipped and reported by the loader.

    Raises :class:`ScenarioError` naming the file, the line and the formats accepted if that record is not JSON or
    of no known format; naming the file if it has no (usable) record, or cannot be read.
    """
    path = Path(path)
    for line_no, obj, error in input_lines(path) if records is None else records:
        found = _format_of(obj)
        if found is not None:
            return found
        if skip_invalid:
            continue
        if error is not None:
            reason = str(error).removeprefix(f"{path}:{line_no}: ")
            raise ScenarioError(f"{reason}; replay reads:{ACCEPTED_FORMATS}", str(path), line_no)
        if isinstance(obj, dict):
            keys = ", ".join(repr(key) for key in list(obj)[:8]) or "no keys"
            what = f"an object with {keys}"
        else:
            what = f"a JSON {type(obj).__name__}"
        raise ScenarioError(f"cannot tell the format: {what}; expected one of:{ACCEPTED_FORMATS}", str(path), line_no)
    if skip_invalid:
        raise ScenarioError("no usable line: no conversations or requests", str(path))
    raise ScenarioError(EMPTY_FILE, str(path))


def sharegpt_to_chat(obj: Any) -> dict[str, Any]:
    """One ShareGPT record as a chat transcript record ``{"id", "messages", "tools"}``: ``from`` mapped by
    :data:`SHAREGPT_ROLES`, ``value`` as the content, a top-level ``system`` string first, ``tools`` a list (or a
    JSON string of one, as LLaMA-Factory writes it); an integer ``id`` becomes a string.  O(len(conversations)).

    Raises :class:`ValueError` saying what is wrong (the loader adds the file and line).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    turns = obj.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise ValueError("'conversations' must be a non-empty list of {from, value} objects")
    messages = []
    system = obj.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"'system' must be a string, got {type(system).__name__}")
    if system:
        messages.append({"role": "system", "content": system})
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"conversations[{index}] must be an object with 'from' and 'value'")
        source = turn.get("from")
        role = SHAREGPT_ROLES.get(source) if isinstance(source, str) else None
        if role is None:
            accepted = ", ".join(SHAREGPT_ROLES)
            raise ValueError(f"conversations[{index}] has 'from': {source!r}; accepted: {accepted}")
        value = turn.get("value")
        if not isinstance(value, str):
            raise ValueError(
                f"conversations[{index}] ({source}) has a 'value' of type {type(value).__name__}; it must be a string"
            )
        messages.append({"role": role, "content": value})
    out: dict[str, Any] = {"messages": messages}
    if "id" in obj:
        record_id = obj["id"]
        out["id"] = str(record_id) if isinstance(record_id, int) and not isinstance(record_id, bool) else record_id
    tools = obj.get("tools")
    if isinstance(tools, str) and tools.strip():
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise ValueError(f"'tools' is a string but not JSON: {exc.msg} at column {exc.colno}") from None
    if tools:
        out["tools"] = tools
    return out


def load_sharegpt(
    path: str | Path,
    *,
    skip_invalid: bool = False,
    progress: Callable[[Iterable[Any], str, int | None, str], Iterable[Any]] | None = None,
) -> ScenarioFile:
    """Load a ShareGPT file (JSON Lines or one JSON array) as chat transcripts: see :func:`sharegpt_to_chat` and
    :func:`~prefixcache.replay.scenarios.load_scenario`, whose arguments, errors and ids (unique, or
    ``<file stem>:<line>``) these are.  O(file size)."""
    return load_scenario(path, skip_invalid=skip_invalid, progress=progress, convert=sharegpt_to_chat)


def load_request_log(
    path: str | Path,
    *,
    file_format: str = "requests",
    limit: int | None = None,
    skip_invalid: bool = False,
    progress: Callable[[Iterable[Any], str, int | None, str], Iterable[Any]] | None = None,
) -> RequestLog:
    """Load a request log (``file_format="requests"``) or an OpenAI Batch input file (``"batch"``): every request as
    sent, in file order, the first ``limit`` records only if given.  O(file size).  A log naming several models gets
    a warning: one replay puts them all in one cache, where no server shares K/V between models.

    Raises :class:`ScenarioError` (path, line) for the first bad record: not an object; a body without a non-empty
    ``messages`` list (or, for completions, a ``prompt`` that is not text, token ids, or a list of either); a
    message of an unknown role or non-text content; malformed ``tools`` or template variables; in a Batch file a
    ``custom_id`` missing or seen before, a ``method`` other than POST, a ``url`` not in :data:`BATCH_URLS`.  With
    ``skip_invalid`` bad records are collected in ``skipped`` instead.  Raises :class:`InvalidArgumentError` for
    another ``file_format`` or a negative ``limit``.
    """
    if file_format not in ("requests", "batch"):
        raise InvalidArgumentError(f"load_request_log reads requests or batch files, not {file_format!r}")
    if limit is not None and limit < 0:
        raise InvalidArgumentError(f"limit must be >= 0, got {limit}")
    path = Path(path)
    records: Iterable[Any] = itertools.islice(iter_json_records(path), limit)
    if progress is not None:
        records = progress(records, f"read {path.name}", limit, "line")
    requests: list[LoggedRequest] = []
    skipped: list[ScenarioError] = []
    first_line_of: dict[str, int] = {}
    for line_no, obj, error in records:
        try:
            if error is not None:
                raise error
            try:
                if file_format == "batch":
                    found = _batch_record(obj, line_no, first_line_of)
                else:
                    found = _body_requests(obj, None, f"line{line_no}", line_no)
            except (ValueError, TemplateError) as exc:
                raise ScenarioError(str(exc), str(path), line_no) from None
        except ScenarioError as exc:
            if not skip_invalid:
                raise
            skipped.append(exc)
            continue
        requests.extend(found)
    models = Counter(request.model for request in requests if request.model is not None)
    if len(models) > 1:
        named = ", ".join(f"{model} ({count:,})" for model, count in models.most_common(5))
        logger.warning(
            "%s: requests to %d models: %s; the replay puts them in one cache, where no server shares K/V "
            "between models (replay one file per model for figures per model)",
            path,
            len(models),
            named,
        )
    return RequestLog(str(path), file_format, tuple(requests), tuple(skipped))


def _batch_record(obj: Any, line_no: int, first_line_of: dict[str, int]) -> list[LoggedRequest]:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"'custom_id' must be a non-empty string, got {custom_id!r}")
    if custom_id in first_line_of:
        raise ValueError(f"duplicate custom_id {custom_id!r} (first on line {first_line_of[custom_id]})")
    method = obj.get("method", "POST")
    if method != "POST":
        raise ValueError(f"'method' must be \"POST\", got {method!r}")
    url = obj.get("url")
    kind = BATCH_URLS.get(url) if isinstance(url, str) else None
    if kind is None:
        raise ValueError(f"'url' {url!r} is not replayed; accepted: {', '.join(BATCH_URLS)}")
    found = _body_requests(obj.get("body"), kind, custom_id, line_no)
    first_line_of[custom_id] = line_no
    return found


def _body_requests(body: Any, kind: str | None, request_id: str, line_no: int) -> list[LoggedRequest]:
    """The requests of one chat-completions (``kind="chat"``) or completions body; ``kind=None`` tells them by
    ``messages`` / ``prompt``.  Raises ValueError or TemplateError."""
    what = "'body'" if kind is not None else "the line"
    if not isinstance(body, dict):
        raise ValueError(f"{what} must be a JSON object (a request body), got {type(body).__name__}")
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"'model' must be a non-empty string, got {model!r}")
    if kind is None:
        kind = "completions" if "prompt" in body and "messages" not in body else "chat"
    if kind == "completions":
        return [
            LoggedRequest(f"{request_id}[{k}]" if many else request_id, line_no, model, prompt=prompt)
            for k, prompt, many in _prompts(body.get("prompt"))
        ]
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {index} must be an object with role and content, got {type(message).__name__}")
        message = {key: message[key] for key in MESSAGE_KEYS if key in message}
        try:
            message["content"] = join_text_parts(message.get("content"))
        except TemplateError as exc:
            raise ValueError(f"message {index}: {exc}") from None
        if message.get("role") == "developer":  # OpenAI's system role for reasoning models
            message["role"] = "system"
        checked.append(message)
    validate_messages(checked)
    tools = body.get("tools") or None
    if tools is not None:
        try:
            validate_tools(tools)
        except TemplateError as exc:
            raise ValueError(f"bad 'tools': {exc}") from None
    # What the server hands the chat template (vLLM's chat_template_kwargs, gpt-oss's reasoning_effort) changes the
    # prompt, so the replay renders with it too.
    variables = body.get("chat_template_kwargs")
    if body.get("reasoning_effort") is not None:
        if variables is not None and not isinstance(variables, dict):
            raise ValueError(f"'chat_template_kwargs' must be an object, got {type(variables).__name__}")
        variables = {**(variables or {}), "reasoning_effort": body["reasoning_effort"]}
    template_kwargs = check_template_kwargs(variables) or None
    return [
        LoggedRequest(
            request_id,
            line_no,
            model,
            messages=tuple(checked),
            tools=tuple(dict(tool) for tool in tools) if tools is not None else None,
            template_kwargs=template_kwargs,
        )
    ]


def _prompts(prompt: Any) -> list[tuple[int, str | tuple[int, ...], bool]]:
    """``(index, prompt, one of several)`` for a completions ``prompt``: text, token ids, or a list of either."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise ValueError(
            "'prompt' must be a string, a list of token ids (integers >= 0), or a non-empty list of either"
        )
    for index, one in enumerate(prompts):
        if not one:
            raise ValueError(f"prompt {index} is empty")
    return [(k, p if isinstance(p, str) else tuple(p), len(prompts) > 1) for k, p in enumerate(prompts)]


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )
