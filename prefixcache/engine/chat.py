"""Chat completions on a runner: template, tool choice, string stop sequences, streamed text, parsed tool calls.

:func:`chat_stream` is what an OpenAI-style endpoint or an agent-framework adapter needs from one request: it renders
the messages with the tokenizer's chat template, generates through the prefix cache, yields the answer text as it
becomes final (never text a stop string or a tool call later takes back), and returns a :class:`ChatCompletion` with
the content, the OpenAI ``tool_calls`` parsed from ``<tool_call>`` blocks, the finish reason and the usage (cached
tokens included).  A string stop sequence ends the request the way a stop token does, so its prompt and answer are
cached for the next turn.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixcache.chat.stop import StopMatcher, TextStream, check_stop
from prefixcache.chat.tool_calls import TOOL_CALL_OPEN, parse_tool_calls
from prefixcache.engine.sampling import SamplingParams
from prefixcache.errors import InvalidArgumentError

if TYPE_CHECKING:
    from prefixcache.engine.runner import PrefixCachingRunner, Usage

__all__ = ["ChatCompletion", "chat_stream", "check_tool_choice", "complete_chat", "completion_stream"]


@dataclass(frozen=True, slots=True)
class ChatCompletion:
    """The outcome of one chat request.

    ``content`` is the answer text (``None`` when the model only called tools), ``tool_calls`` the OpenAI calls
    (``{"id", "type": "function", "function": {"name", "arguments": JSON string}}``), ``finish_reason`` one of
    ``"stop"``, ``"length"``, ``"tool_calls"``; ``token_ids`` the generated ids (a named ``tool_choice`` includes the
    ids it forced).
    """

    content: str | None
    tool_calls: tuple[dict[str, Any], ...]
    finish_reason: str
    usage: Usage
    token_ids: tuple[int, ...]


def check_tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]] | None) -> str:
    """Validate OpenAI's ``tool_choice`` against ``tools``; returns the text that forces it (appended to the prompt).

    ``None``, ``"auto"`` and ``"none"`` force nothing (``""``); ``"required"`` forces the start of a call,
    ``<tool_call>\\n{"name": "``; ``{"type": "function", "function": {"name": N}}`` forces the call up to its
    arguments, ``<tool_call>\\n{"name": "N", "arguments": ``.  Raises :class:`InvalidArgumentError` for anything
    else, ``"required"`` or a name without tools, or a name that is not a tool's.
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
        return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": '
    raise InvalidArgumentError(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}, "
        f"got {tool_choice!r}"
    )


def _tool_name(tool: Mapping[str, Any]) -> Any:
    function = tool.get("function")
    return (function if isinstance(function, Mapping) else tool).get("name")


class _ToolCallGate:
    """Passes answer text through until ``<tool_call>`` appears, then holds everything for the parser; also holds
    trailing whitespace and any tail that may grow into ``<tool_call>``, since the parsed content drops both."""

    __slots__ = ("_held", "capturing")

    def __init__(self) -> None:
        self._held = ""
        self.capturing = False

    def feed(self, text: str) -> str:
        held = self._held = self._held + text
        if self.capturing:
            return ""
        at = held.find(TOOL_CALL_OPEN)
        if at >= 0:
            self.capturing = True
            cut = len(held[:at].rstrip())
        else:
            cut = len(held)
            for length in range(min(len(TOOL_CALL_OPEN) - 1, len(held)), 0, -1):
                if held.endswith(TOOL_CALL_OPEN[:length]):
                    cut -= length
                    break
            cut = len(held[:cut].rstrip())
        out, self._held = held[:cut], held[cut:]
        return out

    def rest(self) -> str:
        held, self._held = self._held, ""
        return held


def chat_stream(
    runner: PrefixCachingRunner,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    tool_choice: Any = None,
    stop: str | Sequence[str] | None = None,
    namespace: str | None = None,
    request_id: str | None = None,
    **sampling: Any,
) -> Generator[str, None, ChatCompletion]:
    """Generate an answer to ``messages``; yields content text deltas, returns the :class:`ChatCompletion`.

    ``sampling`` are :class:`SamplingParams` fields (the tokenizer's end-of-turn ids stop generation unless
    ``stop_token_ids`` is given).  With ``tools`` and ``tool_choice`` ``None``/``"auto"``, ``<tool_call>`` blocks in
    the output become ``tool_calls`` (malformed ones stay text); ``"none"`` keeps the tools in the prompt (so it
    shares the cached prefix) and returns text only; ``"required"`` and a named function are forced by appending the
    start of a call to the prompt (:func:`check_tool_choice`); ``usage.prompt_tokens`` counts those tokens.  ``stop``
    strings (at most 4) end the answer before them; the turn is cached as with a stop token.  Closing the generator
    early releases the request's blocks and caches nothing of it.

    Raises :class:`TemplateError` (bad messages or tools), :class:`InvalidArgumentError` (no messages, bad ``stop``,
    ``tool_choice`` or sampling), and the errors of :meth:`PrefixCachingRunner.stream`, before yielding anything.
    """
    if isinstance(messages, Sequence) and not isinstance(messages, str) and len(messages) == 0:
        # The template would render a bare generation prompt: an answer to nothing, which the server refuses too.
        raise InvalidArgumentError("messages must be a non-empty list of chat messages")
    stops = check_stop(stop)
    forced_text = check_tool_choice(tool_choice, tools)
    parse_calls = bool(tools) and tool_choice != "none"
    tokenizer = runner.tokenizer
    sampling.setdefault("stop_token_ids", tokenizer.eos_token_ids)
    sampling.setdefault("vocab_limit", tokenizer.vocab_size)
    params = SamplingParams(**sampling)
    prompt = tokenizer.render_chat(messages, tools, add_generation_prompt=True)
    forced_ids = _encode_forced(tokenizer, forced_text)
    steps = runner.stream(prompt + forced_ids, params, namespace=namespace, request_id=request_id)
    return _drive(runner, steps, stops, parse_calls, forced_text, forced_ids, params, request_id)


def _encode_forced(tokenizer: Any, text: str) -> list[int]:
    # Qwen's tokenizer has <tool_call> as one added token, the one its model generates; the byte tokenizer spells it.
    if not text:
        return []
    try:
        opener = [tokenizer.special_token_id(TOOL_CALL_OPEN)]
    except InvalidArgumentError:
        return tokenizer.encode(text)
    return opener + tokenizer.encode(text[len(TOOL_CALL_OPEN) :])


def _drive(runner, steps, stops, parse_calls, forced_text, forced_ids, params, request_id):
    text_stream = TextStream(runner.tokenizer, skip=params.stop_token_ids)
    stopper = StopMatcher(stops)
    gate = _ToolCallGate() if parse_calls else None
    if gate is not None and forced_text:
        gate.feed(forced_text)
    pieces: list[str] = [forced_text]

    def emit(delta: str) -> str:
        text = stopper.feed(delta)
        pieces.append(text)
        return gate.feed(text) if gate is not None else text

    try:
        try:
            token = next(steps)
            while True:
                out = emit(text_stream.push(token))
                if out:
                    yield out
                token = steps.send("stop" if stopper.stopped else None)
        except StopIteration as done:
            result = done.value
    finally:
        steps.close()
    tail = stopper.feed(text_stream.flush())
    tail += stopper.flush()
    pieces.append(tail)
    text = "".join(pieces)
    finish = "stop" if stopper.stopped else result.finish_reason
    parsed = parse_tool_calls(text, id_salt=request_id or uuid.uuid4().hex) if parse_calls else None
    if parsed is not None and parsed.tool_calls:
        content, calls, finish = parsed.content, parsed.tool_calls, "tool_calls"
    else:
        content, calls = text, ()
        rest = (gate.feed(tail) + gate.rest()) if gate is not None else tail
        if rest:
            yield rest
    return ChatCompletion(content, calls, finish, result.usage, tuple(forced_ids) + result.token_ids)


def completion_stream(
    runner: PrefixCachingRunner,
    prompt_ids: Sequence[int],
    *,
    stop: str | Sequence[str] | None = None,
    namespace: str | None = None,
    request_id: str | None = None,
    **sampling: Any,
) -> Generator[str, None, ChatCompletion]:
    """Plain text completion of ``prompt_ids`` (no template, no tool calls), with ``stop`` strings; yields text
    deltas and returns a :class:`ChatCompletion` whose ``content`` is the whole text.  Raises as :func:`chat_stream`."""
    stops = check_stop(stop)
    sampling.setdefault("stop_token_ids", runner.tokenizer.eos_token_ids)
    sampling.setdefault("vocab_limit", runner.tokenizer.vocab_size)
    params = SamplingParams(**sampling)
    steps = runner.stream(list(prompt_ids), params, namespace=namespace, request_id=request_id)
    return _drive(runner, steps, stops, False, "", [], params, request_id)


def complete_chat(
    runner: PrefixCachingRunner,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    **options: Any,
) -> ChatCompletion:
    """:func:`chat_stream` run to the end; same arguments and errors."""
    steps = chat_stream(runner, messages, tools, **options)
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value
    finally:
        steps.close()
