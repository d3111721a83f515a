"""The OpenAI wire format: request bodies checked into typed records, and the response and chunk objects.

Only what the server really does is accepted.  A field it cannot honour (chat's ``echo``, any unknown field) is a 400
in OpenAI's error shape naming the parameter, never silently ignored; fields that change nothing here (``user``,
``metadata``, ``store``, ``parallel_tool_calls``) pass.  The sampling fields are OpenAI's (``temperature``, ``top_p``,
``seed``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``
with string keys of token ids) and vLLM's extra ones (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``: the ``openai`` client sends them in ``extra_body``), each checked by
:class:`~prefixcache.engine.sampling.SamplingParams`, the one definition of their ranges.  Log-probabilities are
asked for OpenAI's two ways: ``logprobs: true`` with ``top_logprobs: k`` on chat (``top_logprobs`` needs
``logprobs``), ``logprobs: k`` on completions, ``k`` in 0 .. 20 (OpenAI's bound on chat, vLLM's default
``max_logprobs``; OpenAI's legacy completions stop at 5); :mod:`prefixcache.serve.logprobs` builds their objects.
Message content may be a string or a list of ``{"type": "text", "text": ...}`` parts (joined), as LangChain and
smolagents send it.

Chat fields that change no answer here are checked for their OpenAI shape and dropped: ``prompt_cache_key`` (a
routing hint; one server is one cache, and the exact-prefix routers route on the prompt's own tokens),
``safety_identifier``, ``verbosity``, ``modalities`` (``["text"]`` only) and ``prediction`` (a predicted output only
speeds decoding up, never changes it).  ``reasoning_effort`` and vLLM's ``chat_template_kwargs`` reach the chat
template as variables (``reasoning_effort`` for gpt-oss, ``enable_thinking`` for Qwen3; a template that does not
read one renders as without it).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prefixcache.chat.stop import check_stop
from prefixcache.chat.template import RESERVED_TEMPLATE_VARIABLES, check_json_depth, join_text_parts
from prefixcache.engine.chat import ChatCompletion
from prefixcache.engine.grammar import check_response_format
from prefixcache.engine.results import Usage
from prefixcache.engine.sampling import MAX_LOGPROBS, SamplingParams
from prefixcache.errors import InvalidArgumentError, TemplateError

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "BadRequest",
    "ChatRequest",
    "CompletionRequest",
    "PrefillRequest",
    "chat_chunk",
    "chat_response",
    "completion_response",
    "error_body",
    "parse_chat_request",
    "parse_completion_request",
    "parse_prefill_request",
    "usage_json",
]

MAX_CHOICES = 16
"""The most samples (``n``) one request may ask for: each is an engine request of its own."""

DEFAULT_MAX_TOKENS = 256
"""Tokens generated when a request gives neither ``max_tokens`` nor ``max_completion_tokens``."""

_IGNORED = frozenset({"user", "metadata", "store", "parallel_tool_calls", "service_tier"})
_NEUTRAL = {"echo": False}
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
_COMMON = (
    frozenset(
        {"model", "stream", "stream_options", "stop", "temperature", "top_p", "seed", "n", "max_tokens", "logit_bias"}
    )
    | frozenset(_SAMPLING_OPTIONS)
    | {"logprobs"}
)
_TOKEN_ID = re.compile(r"[0-9]{1,10}")
_CHAT = _COMMON | {"messages", "tools", "tool_choice", "max_completion_tokens", "response_format", "top_logprobs"}
_COMPLETION = _COMMON | {"prompt", "echo", "response_format"}
_PREFILL = frozenset({"model", "messages", "tools", "prompt", "priority", "retain_s"})


class BadRequest(Exception):
    """A request the server rejects: ``status`` (400, 404), the message, and the offending ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


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


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}", name)
    return float(value)


def _common(
    body: Any,
    allowed: frozenset[str],
    default_max_tokens: int,
    max_tokens_names: tuple[str, ...],
    vocab_size: int | None = None,
) -> _Common:
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    for name in body:
        if name in allowed or name in _IGNORED:
            continue
        if name in _NEUTRAL and body[name] in (None, _NEUTRAL[name]):
            continue
        raise BadRequest(f"unsupported parameter: {name}", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model must be a non-empty string", "model")
    n = body.get("n")
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", "n")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest("stream_options supports include_usage and continuous_usage_stats", "stream_options")
    for option in ("include_usage", "continuous_usage_stats"):
        if not isinstance(options.get(option, False), (bool, type(None))):
            raise BadRequest(f"stream_options.{option} must be a boolean", "stream_options")
    if body.get("stream_options") is not None and not stream:
        # As OpenAI and vLLM answer: the options describe a stream, and a plain response would silently drop them.
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
    try:
        stop = check_stop(body.get("stop"))
    except InvalidArgumentError as error:
        raise BadRequest(str(error), "stop") from None
    given = next((n for n in max_tokens_names if body.get(n) is not None), None)
    max_tokens = body[given] if given else default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise BadRequest(f"{given} must be a non-negative integer, got {max_tokens!r}", given)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise BadRequest(f"seed must be an integer in 0 .. 2**63 - 1, got {seed!r}", "seed")
    temperature = _number(body, "temperature", 0.0)
    if not 0 <= temperature <= 2:
        raise BadRequest(f"temperature must be in [0, 2], got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    sampling = {"max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
    sampling.update(_sampling_options(body, max_tokens, vocab_size))
    continuous = bool(options.get("continuous_usage_stats"))
    return _Common(model, stream, bool(options.get("include_usage")), stop, sampling, continuous, n)


def _sampling_options(body: Mapping[str, Any], max_tokens: int, vocab_size: int | None) -> dict[str, Any]:
    """The penalty, filter and stop fields given (not null), as SamplingParams arguments; a value SamplingParams
    refuses is a BadRequest naming its field.  ``logit_bias`` keys are token ids written as decimal strings (JSON
    object keys), below ``vocab_size`` when given."""
    options = {name: body[name] for name in _SAMPLING_OPTIONS if body.get(name) is not None}
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise BadRequest("logit_bias must be an object mapping token ids to biases", "logit_bias")
        for key in bias:
            if not isinstance(key, str) or not _TOKEN_ID.fullmatch(key):
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


_CHAT_HINTS = frozenset({"prompt_cache_key", "safety_identifier", "verbosity", "modalities", "prediction"})
_CHAT_TEMPLATE = frozenset({"reasoning_effort", "chat_template_kwargs"})
_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_VERBOSITIES = ("low", "medium", "high")
_CHAT_ACCEPTED = _CHAT | _CHAT_HINTS | _CHAT_TEMPLATE


def _check_hints(body: Mapping[str, Any]) -> None:
    """Check the chat fields that change no answer here (see the module's docstring) for OpenAI's shapes; raises
    :class:`BadRequest` naming the field, so a value the client got wrong is not silently dropped."""
    for name in ("prompt_cache_key", "safety_identifier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise BadRequest(f"{name} must be a string", name)
    verbosity = body.get("verbosity")
    if verbosity is not None and verbosity not in _VERBOSITIES:
        raise BadRequest(f"verbosity must be one of {', '.join(_VERBOSITIES)}, got {verbosity!r}", "verbosity")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise BadRequest(f"only modalities ['text'] is supported, got {modalities!r}", "modalities")
    prediction = body.get("prediction")
    if prediction is not None:
        if (
            not isinstance(prediction, Mapping)
            or prediction.get("type") != "content"
            or set(prediction) - {"type", "content"}
        ):
            raise BadRequest("prediction must be {'type': 'content', 'content': ...}", "prediction")
        try:
            content = join_text_parts(prediction.get("content"))
        except TemplateError as error:
            raise BadRequest(f"prediction: {error}", "prediction") from None
        if not isinstance(content, str):
            raise BadRequest("prediction.content must be a string or a list of text parts", "prediction")


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-template variables of a body: ``reasoning_effort`` (one of OpenAI's values), then vLLM's
    ``chat_template_kwargs`` (an object; names the renderer sets itself are refused) over it, as vLLM merges them.
    Raises :class:`BadRequest` naming the field."""
    variables: dict[str, Any] = {}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in _REASONING_EFFORTS:
            message = f"reasoning_effort must be one of {', '.join(_REASONING_EFFORTS)}, got {effort!r}"
            raise BadRequest(message, "reasoning_effort")
        variables["reasoning_effort"] = effort
    extra = body.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise BadRequest("chat_template_kwargs must be an object of template variables", "chat_template_kwargs")
        for name in extra:
            if not name or name in RESERVED_TEMPLATE_VARIABLES:
                message = f"chat_template_kwargs cannot set {name!r}: the server sets it, or it is no variable name"
                raise BadRequest(message, "chat_template_kwargs")
        variables.update(extra)
    return variables


def _alternatives(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be an integer in 0 .. {MAX_LOGPROBS}, got {value!r}", name)
    return value


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """``top_logprobs`` (0 when not given) if ``logprobs`` is true, else None.  ``top_logprobs`` without
    ``logprobs: true`` is refused, as OpenAI and vLLM refuse it."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequest(f"logprobs must be a boolean, got {wanted!r}", "logprobs")
    if top is not None:
        _alternatives(top, "top_logprobs")
        if not wanted:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """The legacy ``logprobs: k`` (null or false: not asked)."""
    value = body.get("logprobs")
    return None if value is None or value is False else _alternatives(value, "logprobs")


def _with_logprobs(sampling: dict[str, Any], logprobs: int | None) -> dict[str, Any]:
    return sampling if logprobs is None else {**sampling, "logprobs": logprobs}


def _content_text(index: int, content: Any) -> Any:
    try:
        return join_text_parts(content)
    except TemplateError as error:
        raise BadRequest(f"message {index}: {error}", f"messages[{index}].content") from None


def parse_chat_request(body: Any, vocab_size: int | None = None) -> ChatRequest:
    """Check a chat completions body (``logit_bias`` ids below ``vocab_size`` when given).  Raises
    :class:`BadRequest` naming the parameter.

    Message contents are validated by the chat template later (a :class:`TemplateError` is a 400 too).
    """
    common = _common(body, _CHAT_ACCEPTED, DEFAULT_MAX_TOKENS, ("max_completion_tokens", "max_tokens"), vocab_size)
    _check_hints(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise BadRequest(f"message {index} must be an object", f"messages[{index}]")
        message = dict(message)
        if "content" in message:
            message["content"] = _content_text(index, message["content"])
        if message.get("role") == "developer":
            message["role"] = "system"
        checked.append(message)
    tools = body.get("tools") or None
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
            raise BadRequest("tools must be a list of objects", "tools")
        if any(t.get("type", "function") != "function" for t in tools):
            raise BadRequest("only function tools are supported", "tools")
        for index, tool in enumerate(tools):
            function = tool.get("function")
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
                raise BadRequest(f"tools[{index}] needs a function object with a non-empty name", f"tools[{index}]")
            if not isinstance(function.get("parameters", {}), Mapping):
                raise BadRequest(f"tools[{index}].function.parameters must be a JSON Schema object", f"tools[{index}]")
            try:
                check_json_depth(tool, f"tools[{index}]")
            except TemplateError as error:
                raise BadRequest(str(error), f"tools[{index}]") from None
    response_format = _response_format(body)
    logprobs = _chat_logprobs(body)
    return ChatRequest(
        model=common.model,
        messages=checked,
        tools=tools,
        tool_choice=body.get("tool_choice"),
        stream=common.stream,
        include_usage=common.include_usage,
        stop=common.stop,
        sampling=_with_logprobs(common.sampling, _counted(logprobs, common.continuous_usage)),
        template_kwargs=_template_kwargs(body),
        logprobs=logprobs,
        continuous_usage=common.continuous_usage,
        response_format=response_format,
        n=common.n,
    )


def _counted(logprobs: int | None, continuous_usage: bool) -> int | None:
    """The ``logprobs`` the engine records: as asked, or 0 (one record a token, nothing shown) so that a stream with
    ``continuous_usage_stats`` counts the tokens of each chunk."""
    return 0 if logprobs is None and continuous_usage else logprobs


def parse_completion_request(body: Any, vocab_size: int) -> CompletionRequest:
    """Check a completions body: ``prompt`` is a string, a list of token ids below ``vocab_size``, or a list of one
    such (``logit_bias`` ids below it too).  Raises :class:`BadRequest`."""
    common = _common(body, _COMPLETION, 16, ("max_tokens",), vocab_size)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt):
            raise BadRequest(f"prompt token ids must be a non-empty list of integers in [0, {vocab_size})", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string or a list of token ids (one prompt only)", "prompt")
    logprobs = _completion_logprobs(body)
    sampling = _with_logprobs(common.sampling, _counted(logprobs, common.continuous_usage))
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise BadRequest("echo must be a boolean", "echo")
    fields = (common.model, prompt, common.stream, common.include_usage, common.stop, sampling, logprobs)
    return CompletionRequest(
        *fields,
        echo=echo,
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
    """Check a prefill body: exactly one of ``messages`` (+ ``tools``) or ``prompt`` (text or token ids below
    ``vocab_size``); ``priority`` a positive integer, ``retain_s`` (needs ``priority``) a positive finite number of
    seconds.  Raises :class:`BadRequest` naming the parameter."""
    if not isinstance(body, Mapping):
        raise BadRequest("the request body must be a JSON object")
    for name in body:
        if name not in _PREFILL:
            raise BadRequest(f"unsupported parameter: {name}; prefill takes {', '.join(sorted(_PREFILL))}", name)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise BadRequest("model must be a non-empty string", "model")
    if ("messages" in body) == ("prompt" in body):
        raise BadRequest("give exactly one of messages or prompt", "messages")
    messages, tools, prompt = None, None, None
    if "messages" in body:
        chat = parse_chat_request({"model": model or "-", "messages": body["messages"], "tools": body.get("tools")})
        messages, tools = chat.messages, chat.tools
    elif "tools" in body:
        raise BadRequest("tools go with messages, not with prompt", "tools")
    else:
        prompt = parse_completion_request({"model": "-", "prompt": body["prompt"]}, vocab_size).prompt
    priority, retain_s = body.get("priority"), body.get("retain_s")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int) or priority < 1):
        raise BadRequest(f"priority must be a positive integer, got {priority!r}", "priority")
    if retain_s is not None:
        if priority is None:
            raise BadRequest("retain_s needs a priority", "retain_s")
        if isinstance(retain_s, bool) or not isinstance(retain_s, (int, float)) or not 0 < retain_s < math.inf:
            raise BadRequest(f"retain_s must be a positive finite number of seconds, got {retain_s!r}", "retain_s")
        retain_s = float(retain_s)
    return PrefillRequest(model, messages, tools, prompt, priority, retain_s)


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
