"""The OpenAI Responses API wire format: request bodies checked into a typed record, input items turned into chat
messages, and the ``response`` object and its streamed events.  The store that ``previous_response_id`` and
``GET /v1/responses/{id}`` read is :mod:`prefixcache.serve.response_store` (its names are exported here too).

A request runs on the chat layer (:func:`~prefixcache.engine.chat.prepare_chat`): ``instructions`` become a first
system message, ``input`` items become chat messages (``developer`` is ``system``; ``function_call`` items join the
assistant message before them as its ``tool_calls``, ``function_call_output`` items are ``tool`` messages), function
``tools`` the chat layer's tools.  So a conversation resent item by item, or continued with ``previous_response_id``,
renders to the tokens of the turn before and hits the cache.  A stored response keeps the chat messages of its
conversation (instructions excluded: OpenAI does not carry them over), never tensors.

Only what the server really does is accepted; a field that would change the answer unseen (hosted tools, a
``max_tool_calls``, ``top_logprobs``, ``background``, a reasoning summary, images)
is a 400 naming it.  ``store``, ``metadata``, ``user``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``,
``parallel_tool_calls`` and ``truncation`` change nothing here (nothing is truncated: a conversation past the context
fails either way); ``include: ["reasoning.encrypted_content"]`` has nothing to include.  Sampling defaults are the
chat endpoint's: greedy (``temperature`` 0) and :data:`~prefixcache.serve.protocol.DEFAULT_MAX_TOKENS` tokens.
A streamed response always ends with ``response.completed`` (its ``status`` saying ``incomplete`` when
``max_output_tokens`` ended it), as vLLM does and as the ``openai`` client's stream helper waits for; one whose model
work failed ends with ``response.failed``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.chat.template import join_text_parts
from prefixcache.engine.chat_decoder import ChatCompletion
from prefixcache.engine.grammar import check_response_format
from prefixcache.engine.results import Usage
from prefixcache.engine.tool_choice import check_tool_choice
from prefixcache.errors import InvalidArgumentError, TemplateError
from prefixcache.serve.protocol import DEFAULT_MAX_TOKENS, BadRequest, check_unique_tool_names
from prefixcache.serve.response_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore, StoredResponse
from prefixcache.serve.schemas import BodyError, ResponsesBody, validate_body

__all__ = [
    "DEFAULT_MAX_STORED_RESPONSES",
    "ResponseEvents",
    "ResponseStore",
    "ResponsesRequest",
    "StoredResponse",
    "assistant_message",
    "conversation_after",
    "new_id",
    "output_items",
    "parse_responses_request",
    "response_body",
    "response_usage",
]

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_TEXT_FORMAT = {"format": {"type": "text"}}


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A checked ``POST /v1/responses`` body.  ``messages`` are its ``input`` as chat messages (``instructions`` not
    among them), ``tools`` and ``tool_choice`` in the chat layer's format, ``sampling`` the
    :class:`~prefixcache.engine.sampling.SamplingParams` fields; ``echo`` the request fields a ``response`` object
    repeats, as OpenAI shapes them."""

    model: str
    messages: list[dict[str, Any]]
    instructions: str | None
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    stream: bool
    store: bool
    previous_response_id: str | None
    sampling: dict[str, Any]
    template_kwargs: dict[str, Any]
    echo: dict[str, Any]
    response_format: dict[str, Any] | None = None
    """``text.format`` as the chat layer's ``response_format`` (structured outputs); None for plain text."""


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (``input_text``, ``output_text``) joined by newlines
    as the chat endpoint joins its parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of input_text parts", where)
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}: only text parts can be rendered, got a {kind!r} part", where)
        parts.append({"type": "text", "text": part["text"]})
    try:
        return join_text_parts(parts)
    except TemplateError as error:
        raise BadRequest(f"{where}: {error}", where) from None


def _string(item: Mapping[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (not value and name != "arguments"):
        raise BadRequest(f"{where}.{name} must be a non-empty string", f"{where}.{name}")
    return value


def _input_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages.  O(number of items)."""
    if isinstance(items, str):
        if not items:
            raise BadRequest("input must be a non-empty string or a non-empty list of items", "input")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input must be a non-empty string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise BadRequest(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise BadRequest(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role")
            messages.append({"role": _ROLES[role], "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            function = {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}
            call = {"id": _string(item, "call_id", where), "type": "function", "function": function}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
        else:
            raise BadRequest(f"{where}: input items of type {kind!r} are not supported", f"{where}.type")
    return messages


def conversation_after(prior: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``prior`` then ``new`` messages, each ``function_call`` message joined to the assistant message before it (the
    text and calls one turn made render as one message, as the model wrote them).  Copies what it joins: neither
    input is changed, so a stored conversation is never edited.  O(len(prior) + len(new))."""
    out = list(prior)
    for message in new:
        last = out[-1] if out else None
        if message.get("tool_calls") and message.get("content") is None and last and last["role"] == "assistant":
            out[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or ()), *message["tool_calls"]]}
        else:
            out.append(message)
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Function tools (``{"type": "function", "name", "description", "parameters", "strict"}``) in the chat layer's
    format, ``strict`` kept: a strict function's calls follow its ``parameters``, as on the chat endpoint."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, Mapping) for tool in tools):
        raise BadRequest("tools must be a list of objects", "tools")
    out = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function":
            message = f"tools[{index}]: only function tools are supported, got type {tool.get('type')!r}"
            raise BadRequest(message, f"tools[{index}].type")
        name, parameters = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"tools[{index}].name must be a non-empty string", f"tools[{index}].name")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise BadRequest(f"tools[{index}].parameters must be a JSON Schema object", f"tools[{index}].parameters")
        function = {"name": name, "parameters": dict(parameters or {"type": "object", "properties": {}})}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if tool.get("strict") is True:
            function["strict"] = True
        out.append({"type": "function", "function": function})
    check_unique_tool_names([tool["function"]["name"] for tool in out], "tools[{}].name")
    return out


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> Any:
    """OpenAI's Responses ``tool_choice`` (``{"type": "function", "name": N}`` for a named one) in the chat layer's
    form, checked against ``tools``."""
    if isinstance(choice, Mapping):
        if choice.get("type") != "function" or set(choice) - {"type", "name"}:
            raise BadRequest("tool_choice must be 'auto', 'none', 'required' or a function", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    try:
        check_tool_choice(choice, tools)
    except InvalidArgumentError as error:
        raise BadRequest(str(error), "tool_choice") from None
    return choice


def _response_format(text_format: Any) -> dict[str, Any] | None:
    """``text.format`` (``text``, ``json_object``, or ``json_schema`` with its ``name``, ``schema`` and ``strict`` at
    the top level, as the Responses API puts them) as the chat endpoint's ``response_format``, checked (its schema
    compiled: :func:`~prefixcache.engine.grammar.check_response_format`); None for text.  Raises BadRequest naming
    ``text.format``."""
    if not isinstance(text_format, Mapping):
        raise BadRequest(f"text.format must be an object, got {text_format!r}", "text.format")
    kind = text_format.get("type")
    if kind == "json_schema":
        schema = {key: text_format[key] for key in ("name", "schema", "strict", "description") if key in text_format}
        chat_format: dict[str, Any] = {"type": "json_schema", "json_schema": schema}
    else:
        chat_format = {"type": kind}
    try:
        return None if check_response_format(chat_format) is None else chat_format
    except InvalidArgumentError as error:
        raise BadRequest(str(error), "text.format") from None


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Check a ``POST /v1/responses`` body (:class:`~prefixcache.serve.schemas.ResponsesBody`).  Raises
    :class:`BadRequest` naming the parameter.  O(size of the body)."""
    try:
        checked = validate_body(ResponsesBody, body)
    except BodyError as error:
        raise BadRequest(str(error), error.param) from None
    if checked.stream_options is not None:
        if not checked.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        if set(checked.stream_options) - {"include_obfuscation"}:
            raise BadRequest("stream_options supports only include_obfuscation", "stream_options")
    effort = checked.reasoning.effort if checked.reasoning else None
    template_kwargs = {} if effort is None else {"reasoning_effort": effort}
    text_format = (checked.text.format if checked.text else None) or _TEXT_FORMAT["format"]
    response_format = _response_format(text_format)
    max_tokens = DEFAULT_MAX_TOKENS if checked.max_output_tokens is None else checked.max_output_tokens
    temperature = 0.0 if checked.temperature is None else float(checked.temperature)
    top_p = 1.0 if checked.top_p is None else float(checked.top_p)
    tools = _tools(checked.tools)
    tool_choice = _tool_choice(checked.tool_choice, tools)
    store = checked.store is not False
    echo = {
        "instructions": checked.instructions,
        "max_output_tokens": max_tokens,
        "metadata": dict(checked.metadata or {}),
        "parallel_tool_calls": checked.parallel_tool_calls is not False,
        "previous_response_id": checked.previous_response_id,
        "reasoning": {"effort": effort, "summary": None},
        "store": store,
        "temperature": temperature,
        "text": {"format": dict(text_format)},
        "tool_choice": checked.tool_choice or "auto",
        "tools": [dict(tool) for tool in checked.tools or ()],
        "top_p": top_p,
        "truncation": checked.truncation or "disabled",
        "user": checked.user,
    }
    return ResponsesRequest(
        model=checked.model,
        messages=_input_messages(checked.input),
        instructions=checked.instructions or None,
        tools=tools,
        tool_choice=tool_choice,
        stream=bool(checked.stream),
        store=store,
        previous_response_id=checked.previous_response_id,
        sampling={"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p},
        template_kwargs=template_kwargs,
        response_format=response_format,
        echo=echo,
    )


def new_id(prefix: str) -> str:
    """A fresh id: ``resp_``, ``msg_``, ``fc_`` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(usage: Usage) -> dict[str, Any]:
    """OpenAI's Responses usage.  ``cache_write_tokens`` are the prompt tokens computed here, which the cache keeps
    for the next request; nothing is a reasoning token (no reasoning items are produced)."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": usage.prefilled_tokens},
        "output_tokens": usage.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.generated_tokens,
    }


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_item(call: Mapping[str, Any], item_id: str, arguments: str | None = None) -> dict[str, Any]:
    function = call["function"]
    done = arguments is None
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if done else arguments,
        "status": "completed" if done else "in_progress",
    }


def output_items(done: ChatCompletion, message_id: str, call_ids: Sequence[str] = ()) -> list[dict[str, Any]]:
    """A finished answer's output: a ``message`` item (``message_id``) with its text, unless the model only called
    tools, then one ``function_call`` item per call (item ids ``call_ids``, fresh ones where not given)."""
    status = "incomplete" if done.finish_reason == "length" else "completed"
    items = [_message_item(message_id, done.content or "", status)] if done.content or not done.tool_calls else []
    ids = list(call_ids) + [new_id("fc") for _ in done.tool_calls[len(call_ids) :]]
    return items + [_call_item(call, item_id) for call, item_id in zip(done.tool_calls, ids, strict=True)]


def response_body(
    request: ResponsesRequest,
    response_id: str,
    created_at: int,
    output: list[dict[str, Any]],
    done: ChatCompletion | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """A ``response`` object: ``in_progress`` (no ``done`` yet), ``completed`` or ``incomplete`` (``done`` ended by
    ``max_output_tokens``), or ``failed`` with the ``error`` message."""
    incomplete = done is not None and done.finish_reason == "length"
    status = "failed" if error else "in_progress" if done is None else "incomplete" if incomplete else "completed"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": int(time.time()) if done is not None else None,
        "status": status,
        "error": {"code": "server_error", "message": error} if error else None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": request.model,
        "output": output,
        "usage": None if done is None else response_usage(done.usage),
        **request.echo,
    }


def assistant_message(done: ChatCompletion) -> dict[str, Any]:
    """The chat message a finished answer is in the conversation kept for ``previous_response_id``: rendered again,
    its tokens are the ones the model produced, so the next turn hits them."""
    message: dict[str, Any] = {"role": "assistant", "content": done.content}
    if done.tool_calls:
        message["tool_calls"] = [dict(call) for call in done.tool_calls]
    return message


class ResponseEvents:
    """The server-sent events of one streamed response, in OpenAI's order, numbered from 0: ``response.created`` and
    ``response.in_progress``; the message's ``output_item.added``, ``content_part.added`` and ``output_text.delta``
    events as text comes; at the end ``output_text.done``, ``content_part.done``, ``output_item.done``, then per tool
    call ``output_item.added``, ``function_call_arguments.delta`` and ``.done``, ``output_item.done``; last
    ``response.completed`` (or ``response.failed``).  Each method returns the SSE lines to write."""

    __slots__ = ("_message_open", "_request", "_sequence", "created_at", "message_id", "response_id")

    def __init__(self, request: ResponsesRequest, response_id: str, created_at: int) -> None:
        self._request = request
        self._sequence = 0
        self._message_open = False
        self.response_id = response_id
        self.created_at = created_at
        self.message_id = new_id("msg")

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def _body(self, output: list[dict[str, Any]], done: ChatCompletion | None = None, error: str | None = None):
        return response_body(self._request, self.response_id, self.created_at, output, done, error)

    def start(self) -> list[str]:
        body = self._body([])
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def _open_message(self) -> list[str]:
        self._message_open = True
        empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = _message_item(self.message_id, None, "in_progress")
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", part=empty, **self._where()),
        ]

    def text(self, delta: str) -> list[str]:
        lines = [] if self._message_open else self._open_message()
        lines.append(self._event("response.output_text.delta", delta=delta, logprobs=[], **self._where()))
        return lines

    def final_body(self, done: ChatCompletion) -> dict[str, Any]:
        """The final ``response`` object of a finished answer (as stored)."""
        return self._body(output_items(done, self.message_id), done)

    def finish(self, done: ChatCompletion, body: dict[str, Any]) -> list[str]:
        """The closing events of a finished answer whose final ``response`` object is ``body`` (:meth:`final_body`,
        its ``store`` false when the store could not keep it)."""
        output = body["output"]
        lines: list[str] = []
        calls = output
        if output and output[0]["type"] == "message":
            message, calls = output[0], output[1:]
            if not self._message_open:
                lines += self._open_message()
            part = message["content"][0]
            lines.append(self._event("response.output_text.done", text=part["text"], logprobs=[], **self._where()))
            lines.append(self._event("response.content_part.done", part=part, **self._where()))
            lines.append(self._event("response.output_item.done", output_index=0, item=message))
        for index, (item, call) in enumerate(zip(calls, done.tool_calls, strict=True), len(output) - len(calls)):
            where = {"item_id": item["id"], "output_index": index}
            added = _call_item(call, item["id"], arguments="")
            lines.append(self._event("response.output_item.added", output_index=index, item=added))
            lines.append(self._event("response.function_call_arguments.delta", delta=item["arguments"], **where))
            lines.append(self._event("response.function_call_arguments.done", arguments=item["arguments"], **where))
            lines.append(self._event("response.output_item.done", output_index=index, item=item))
        lines.append(self._event("response.completed", response=body))
        return lines

    def failed(self, message: str) -> str:
        return self._event("response.failed", response=self._body([], error=message))
