"""The OpenAI wire format: request bodies checked into typed records, and the response and chunk objects.

Each body is first validated by its schema (:mod:`prefixcache.serve.schemas`: fields, types, documented values and
ranges, declared once and published at ``/openapi.json``); this module adds the checks that join fields or need the
model, and builds the records.  Only what the server really does is accepted.  A field it cannot honour (chat's
``echo``, any unknown field) is a 400 in OpenAI's error shape naming the parameter, never silently ignored; fields that
change nothing here (``user``, ``metadata``, ``store``, ``parallel_tool_calls``) pass.  The sampling fields are
OpenAI's (``temperature``, ``top_p``, ``seed``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias`` with string keys of token ids) and vLLM's extra ones (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``: the ``openai`` client sends them in ``extra_body``), each checked by
:class:`~prefixcache.engine.sampling.SamplingParams`, the one definition of their ranges.  Log-probabilities are asked
for OpenAI's two ways: ``logprobs: true`` with ``top_logprobs: k`` on chat (``top_logprobs`` needs ``logprobs``),
``logprobs: k`` on completions, ``k`` in 0 .. 20 (OpenAI's bound on chat, vLLM's default ``max_logprobs``; OpenAI's
legacy completions stop at 5); :mod:`prefixcache.serve.logprobs` builds their objects. Message content may be a string
or a list of ``{"type": "text", "text": ...}`` parts (joined), as LangChain and smolagents send it.

Chat fields that change no answer here are checked for their OpenAI shape and dropped: ``prompt_cache_key`` (a
routing hint; one server is one cache, and the exact-prefix routers route on the prompt's own tokens),
``safety_identifier``, ``verbosity``, ``modalities`` (``["text"]`` only) and ``prediction`` (a predicted output only
speeds decoding up, never changes it).  ``reasoning_effort`` and vLLM's ``chat_template_kwargs`` reach the chat
template as variables (``reasoning_effort`` for gpt-oss, ``enable_thinking`` for Qwen3; a template that does not
read one renders as without it).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from prefixcache.chat.stop import check_stop
from prefixcache.chat.template import RESERVED_TEMPLATE_VARIABLES, check_json_depth, join_text_parts, repeated_name
from prefixcache.engine.chat_decoder import ChatCompletion
from prefixcache.engine.grammar import check_response_format
from prefixcache.engine.results import Usage
from prefixcache.engine.sampling import SamplingParams
from prefixcache.errors import InvalidArgumentError, TemplateError
from prefixcache.serve.schemas import (
    BodyError,
    ChatCompletionBody,
    CompletionBody,
    PrefillBody,
    validate_body,
)

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "BadRequest",
    "ChatRequest",
    "CompletionRequest",
    "PrefillRequest",
    "chat_chunk",
    "chat_response",
    "check_unique_tool_names",
    "completion_response",
    "error_body",
    "parse_chat_request",
    "parse_completion_request",
    "parse_prefill_request",
    "usage_json",
]

DEFAULT_MAX_TOKENS = 256
"""Tokens generated when a request gives neither ``max_tokens`` nor ``max_completion_tokens``."""

_TOKEN_ID = re.compile(r"[0-9]{1,10}")
# Passed to SamplingParams as given (``logit_bias`` apart: its JSON keys are strings).
_SAMPLING_OPTIONS = (
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
)


class BadRequest(Exception):
    """A request the server rejects: ``status`` (400, 404), the message, and the offending ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def check_unique_tool_names(names: Sequence[Any], param: str) -> None:
    """Refuse a tool list that names one function twice: the model's call names one of them, and which is left to
    chance (OpenAI refuses it too).  ``names`` are the tools' function names in order, ``param`` the field path with
    ``{}`` for the index (``"tools[{}].function.name"``).  O(len(names)).

    Raises:
        BadRequest: naming the later duplicate's field, and the index of the tool that has the name first.
    """
    repeat = repeated_name(names)
    if repeat is not None:
        index, first = repeat
        raise BadRequest(
            f"{param.format(index)} {names[index]!r} is already the name of tools[{first}]; each tool needs its own "
            "function name",
            param.format(index),
        )


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True, slots=True)
class _Common:
    model: str
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    sampling: dict[str, Any]
    continuous_usage: bool = False
    n: int = 1


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A checked ``POST /v1/chat/completions`` body; ``logprobs`` is None (not asked) or ``top_logprobs`` (0 without
    it), also in ``sampling``."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    sampling: dict[str, Any] = field(default_factory=dict)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra chat-template variables: ``reasoning_effort``, then ``chat_template_kwargs`` over it."""
    logprobs: int | None = None
    continuous_usage: bool = False
    """``stream_options.continuous_usage_stats``: every chunk carries the usage so far (vLLM's extension)."""
    response_format: dict[str, Any] | None = None
    """OpenAI's ``json_object`` or ``json_schema`` format, checked; None for text."""
    n: int = 1
    """Samples of the prompt (choices), each its own engine request (:mod:`prefixcache.serve.jobs`)."""


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A checked ``POST /v1/completions`` body; ``prompt`` is text or token ids, ``logprobs`` None (not asked) or the
    number of alternatives asked for (also in ``sampling``); ``echo`` returns the prompt before the completion (with
    its tokens' logprobs when ``logprobs`` is asked: :mod:`prefixcache.serve.echo`)."""

    model: str
    prompt: str | list[int]
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    sampling: dict[str, Any] = field(default_factory=dict)
    logprobs: int | None = None
    echo: bool = False
    continuous_usage: bool = False
    response_format: dict[str, Any] | None = None
    n: int = 1


def _response_format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """``response_format``, checked (its schema compiled); None for text.  Raises :class:`BadRequest` naming it."""
    value = body.get("response_format")
    try:
        return None if check_response_format(value) is None else dict(value)
    except InvalidArgumentError as error:
        raise BadRequest(str(error), "response_format") from None


ModelT = TypeVar("ModelT", bound=BaseModel)


def _checked(model: type[ModelT], body: Any) -> ModelT:
    """``body`` validated by its schema (:mod:`prefixcache.serve.schemas`); raises :class:`BadRequest` naming the
    field."""
    try:
        return validate_body(model, body)
    except BodyError as error:
        raise BadRequest(str(error), error.param) from None


def _common(body: Mapping[str, Any], checked: Any, max_tokens: int | None, vocab_size: int | None) -> _Common:
    """What chat and completions share, from a validated body (``checked``) and its raw JSON (``body``), with
    ``max_tokens`` the given limit (None: the endpoint's default, already filled in)."""
    stream = bool(checked.stream)
    options = checked.stream_options
    if options is not None and not stream:
        # As OpenAI and vLLM answer: the options describe a stream, and a plain response would silently drop them.
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
    try:
        stop = check_stop(checked.stop)
    except InvalidArgumentError as error:
        raise BadRequest(str(error), "stop") from None
    temperature = 0.0 if checked.temperature is None else float(checked.temperature)
    top_p = 1.0 if checked.top_p is None else float(checked.top_p)
    sampling = {"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": checked.seed}
    sampling.update(_sampling_options(body, max_tokens, vocab_size))
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    return _Common(checked.model, stream, include_usage, stop, sampling, continuous, checked.n or 1)


def _sampling_options(body: Mapping[str, Any], max_tokens: int, vocab_size: int | None) -> dict[str, Any]:
    """The penalty, filter and stop fields given (not null), as SamplingParams arguments; a value SamplingParams
    refuses is a BadRequest naming its field.  ``logit_bias`` keys are token ids written as decimal strings (JSON
    object keys), below ``vocab_size`` when given."""
    options = {name: body[name] for name in _SAMPLING_OPTIONS if body.get(name) is not None}
    bias = body.get("logit_bias")
    if bias is not None:
        for key in bias:
            if not _TOKEN_ID.fullmatch(key):
                raise BadRequest(f"logit_bias keys must be token ids (decimal strings), got {key!r}", "logit_bias")
            if vocab_size is not None and int(key) >= vocab_size:
                message = f"logit_bias: token id {key} is outside the vocabulary [0, {vocab_size})"
                raise BadRequest(message, "logit_bias")
        options["logit_bias"] = {int(key): value for key, value in bias.items()}
    for name, value in options.items():
        try:
            SamplingParams(max_new_tokens=max_tokens, **{name: value})
        except InvalidArgumentError as error:
            raise BadRequest(str(error), name) from None
    return options


def _check_prediction(checked: ChatCompletionBody) -> None:
    """``modalities`` is ``["text"]`` and a ``prediction`` is text (both change no answer here: see the module's
    docstring), so a value the client got wrong is not silently dropped.  Raises :class:`BadRequest`."""
    if checked.modalities is not None and checked.modalities != ["text"]:
        raise BadRequest(f"only modalities ['text'] is supported, got {checked.modalities!r}", "modalities")
    if checked.prediction is not None:
        try:
            content = join_text_parts(checked.prediction.content)
        except TemplateError as error:
            raise BadRequest(f"prediction: {error}", "prediction") from None
        if not isinstance(content, str):
            raise BadRequest("prediction.content must be a string or a list of text parts", "prediction")


def _template_kwargs(checked: ChatCompletionBody) -> dict[str, Any]:
    """The chat-template variables of a body: ``reasoning_effort``, then vLLM's ``chat_template_kwargs`` (names the
    renderer sets itself are refused) over it, as vLLM merges them.  Raises :class:`BadRequest` naming the field."""
    variables: dict[str, Any] = {}
    if checked.reasoning_effort is not None:
        variables["reasoning_effort"] = checked.reasoning_effort
    extra = checked.chat_template_kwargs
    if extra is not None:
        for name in extra:
            if not name or name in RESERVED_TEMPLATE_VARIABLES:
                message = f"chat_template_kwargs cannot set {name!r}: the server sets it, or it is no variable name"
                raise BadRequest(message, "chat_template_kwargs")
        variables.update(extra)
    return variables


def _chat_logprobs(checked: ChatCompletionBody) -> int | None:
    """``top_logprobs`` (0 when not given) if ``logprobs`` is true, else None.  ``top_logprobs`` above 0 without
    ``logprobs: true`` is refused, as OpenAI and vLLM refuse it; 0 asks for nothing and is accepted, as vLLM accepts
    it (clients send ``logprobs: false, top_logprobs: 0`` as their defaults)."""
    if checked.top_logprobs and not checked.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return (checked.top_logprobs or 0) if checked.logprobs else None


def _with_logprobs(sampling: dict[str, Any], logprobs: int | None) -> dict[str, Any]:
    return sampling if logprobs is None else {**sampling, "logprobs": logprobs}


def _content_text(index: int, content: Any) -> Any:
    try:
        return join_text_parts(content)
    except TemplateError as error:
        raise BadRequest(f"message {index}: {error}", f"messages[{index}].content") from None


def parse_chat_request(body: Any, vocab_size: int | None = None) -> ChatRequest:
    """Check a chat completions body (:class:`~prefixcache.serve.schemas.ChatCompletionBody`; ``logit_bias`` ids
    below ``vocab_size`` when given).  Raises :class:`BadRequest` naming the parameter.  O(size of the body).

    Message contents are validated by the chat template later (a :class:`TemplateError` is a 400 too).
    """
    checked = _checked(ChatCompletionBody, body)
    _check_prediction(checked)
    max_tokens = next((v for v in (checked.max_completion_tokens, checked.max_tokens) if v is not None), None)
    common = _common(body, checked, DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens, vocab_size)
    messages = []
    for index, message in enumerate(checked.messages):
        message = dict(message)
        if "content" in message:
            try:
                message["content"] = join_text_parts(message["content"])
            except TemplateError as error:
                raise BadRequest(f"message {index}: {error}", f"messages[{index}].content") from None
        if message.get("role") == "developer":
            message["role"] = "system"
        messages.append(message)
    tools = body.get("tools") or None
    for index, tool in enumerate(tools or ()):
        try:
            check_json_depth(tool, f"tools[{index}]")
        except TemplateError as error:
            raise BadRequest(str(error), f"tools[{index}]") from None
    check_unique_tool_names([tool.function.name for tool in checked.tools or ()], "tools[{}].function.name")
    logprobs = _chat_logprobs(checked)
    return ChatRequest(
        model=common.model,
        messages=messages,
        tools=tools,
        tool_choice=checked.tool_choice,
        stream=common.stream,
        include_usage=common.include_usage,
        stop=common.stop,
        sampling=_with_logprobs(common.sampling, _counted(logprobs, common.continuous_usage)),
        template_kwargs=_template_kwargs(checked),
        logprobs=logprobs,
        continuous_usage=common.continuous_usage,
        response_format=_response_format(body),
        n=common.n,
    )


def _counted(logprobs: int | None, continuous_usage: bool) -> int | None:
    """The ``logprobs`` the engine records: as asked, or 0 (one record a token, nothing shown) so that a stream with
    ``continuous_usage_stats`` counts the tokens of each chunk."""
    return 0 if logprobs is None and continuous_usage else logprobs


def _prompt(prompt: Any, vocab_size: int) -> str | list[int]:
    """One prompt: text, or token ids below ``vocab_size`` (a list of one such is unwrapped)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
            raise BadRequest(f"prompt token ids must be a non-empty list of integers in [0, {vocab_size})", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string or a list of token ids (one prompt only)", "prompt")
    return prompt


def parse_completion_request(body: Any, vocab_size: int) -> CompletionRequest:
    """Check a completions body (:class:`~prefixcache.serve.schemas.CompletionBody`): ``prompt`` is a string, a list
    of token ids below ``vocab_size``, or a list of one such (``logit_bias`` ids below it too).  Raises
    :class:`BadRequest`.  O(size of the body)."""
    checked = _checked(CompletionBody, body)
    common = _common(body, checked, 16 if checked.max_tokens is None else checked.max_tokens, vocab_size)
    prompt = _prompt(checked.prompt, vocab_size)
    logprobs = None if checked.logprobs is None or checked.logprobs is False else checked.logprobs
    sampling = _with_logprobs(common.sampling, _counted(logprobs, common.continuous_usage))
    fields = (common.model, prompt, common.stream, common.include_usage, common.stop, sampling, logprobs)
    return CompletionRequest(
        *fields,
        echo=bool(checked.echo),
        continuous_usage=common.continuous_usage,
        response_format=_response_format(body),
        n=common.n,
    )


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """A checked ``POST /v1/cache/prefill`` body: ``messages`` (with ``tools``) or ``prompt``, and the retention of
    :meth:`RadixCache.retain` (``priority`` ``None``: not retained)."""

    model: str | None
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    priority: int | None
    retain_s: float | None


def parse_prefill_request(body: Any, vocab_size: int) -> PrefillRequest:
    """Check a prefill body (:class:`~prefixcache.serve.schemas.PrefillBody`): exactly one of ``messages`` (+
    ``tools``) or ``prompt`` (text or token ids below ``vocab_size``); ``retain_s`` needs ``priority``.  Raises
    :class:`BadRequest` naming the parameter."""
    checked = _checked(PrefillBody, body)
    if (checked.messages is None) == (checked.prompt is None):
        raise BadRequest("give exactly one of messages or prompt", "messages")
    messages, tools, prompt = None, None, None
    if checked.messages is not None:
        chat = parse_chat_request({"model": checked.model or "-", "messages": body["messages"], "tools": checked.tools})
        messages, tools = chat.messages, chat.tools
    elif checked.tools is not None:
        raise BadRequest("tools go with messages, not with prompt", "tools")
    else:
        prompt = _prompt(checked.prompt, vocab_size)
    if checked.retain_s is not None and checked.priority is None:
        raise BadRequest("retain_s needs a priority", "retain_s")
    retain_s = None if checked.retain_s is None else float(checked.retain_s)
    return PrefillRequest(checked.model, messages, tools, prompt, checked.priority, retain_s)


def usage_json(usage: Usage) -> dict[str, Any]:
    """OpenAI usage with ``prompt_tokens_details.cached_tokens`` always present, plus our prefill counts."""
    return usage.to_openai()


def chat_response(
    request_id: str, model: str, done: ChatCompletion, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A ``chat.completion`` object for a finished request (``logprobs``: the choice's, or None when not asked)."""
    message: dict[str, Any] = {"role": "assistant", "content": done.content}
    if done.tool_calls:
        message["tool_calls"] = [dict(call) for call in done.tool_calls]
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": done.finish_reason, "logprobs": logprobs}],
        "usage": usage_json(done.usage),
    }


def chat_chunk(
    request_id: str,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage: Usage | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk``; ``delta=None`` makes the usage-only chunk (no choices) of ``include_usage``;
    ``logprobs`` are the entries of the tokens since the previous chunk (None when not asked)."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}],
    }
    if usage is not None:
        chunk["usage"] = usage_json(usage)
    return chunk


def completion_response(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: Usage | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``text_completion`` object (also each streamed chunk, with the text so far's delta and its tokens'
    ``logprobs``; None when not asked)."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}],
    }
    if usage is not None:
        body["usage"] = usage_json(usage)
    return body
