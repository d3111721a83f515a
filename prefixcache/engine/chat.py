"""Chat completions on a runner: template, tool choice, string stop sequences, streamed text, parsed tool calls.

:func:`chat_stream` is what an OpenAI-style endpoint or an agent-framework adapter needs from one request: it renders
the messages with the tokenizer's chat template, generates through the prefix cache, yields the answer text as it
becomes final (never text a stop string or a tool call later takes back), and returns a :class:`ChatCompletion` with
the content, the OpenAI ``tool_calls`` parsed from ``<tool_call>`` blocks, the finish reason and the usage (cached
tokens included).  A string stop sequence ends the request the way a stop token does, so its prompt and answer are
cached for the next turn.

The work is split so that both ways of running a request share it: :func:`prepare_chat` renders the prompt and
builds a :class:`ChatDecoder` (push-based: tokens in, text deltas and "stop here" out, then the completion);
:func:`chat_stream` drives it pull-based through ``runner.stream``, :func:`submit_chat` from the batching engine's
per-token callback, as the server does.  Both run on the one engine core (:mod:`prefixcache.engine.core`); this module
knows them only by what it calls (:class:`StreamingRunner`, :class:`SubmittingEngine`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any, Protocol

from prefixcache.cache.tokens import TokenIds
from prefixcache.chat.stop import StopMatcher, TextStream, check_stop
from prefixcache.chat.template import repeated_name, validate_tools
from prefixcache.chat.tool_calls import TOOL_CALL_OPEN, parse_tool_calls
from prefixcache.engine.grammar import (
    Grammar,
    check_response_format,
    require_structured,
    strict_tools,
    structured_available,
)
from prefixcache.engine.request import RequestHandle
from prefixcache.engine.results import GenerationResult, TokenLogprob, Usage
from prefixcache.engine.sampling import SamplingParams
from prefixcache.errors import InvalidArgumentError

__all__ = [
    "ChatCompletion",
    "ChatDecoder",
    "PreparedChat",
    "chat_stream",
    "check_tool_choice",
    "complete_chat",
    "complete_text",
    "completion_stream",
    "prepare_chat",
    "prepare_completion",
    "submit_chat",
]


@dataclass(frozen=True, slots=True)
class ChatCompletion:
    """The outcome of one chat request.

    ``content`` is the answer text (``None`` when the model only called tools), ``tool_calls`` the OpenAI calls
    (``{"id", "type": "function", "function": {"name", "arguments": JSON string}}``), ``finish_reason`` one of
    ``"stop"``, ``"length"``, ``"tool_calls"``; ``token_ids`` the generated ids (a named ``tool_choice`` includes the
    ids it forced).  ``logprobs`` (None unless the sampling asked for them) has a
    :class:`~prefixcache.engine.results.TokenLogprob` for every generated token that is not a stop token, in order:
    the tokens whose text is the answer, the text a stop string cut and a tool call's included (OpenAI gives the
    logprobs of the content tokens; one entry per token kept, not per character shown, is simpler and says what the
    model produced); the ids a ``tool_choice`` forced are prompt, not generated, and have none.
    """

    content: str | None
    tool_calls: tuple[dict[str, Any], ...]
    finish_reason: str
    usage: Usage
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


def check_tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]] | None) -> str:
    """Validate OpenAI's ``tool_choice`` against ``tools``; returns the text that forces it (appended to the prompt).

    ``None``, ``"auto"`` and ``"none"`` force nothing (``""``); ``"required"`` forces the start of a call,
    ``<tool_call>\\n{"name": "``; ``{"type": "function", "function": {"name": N}}`` forces the call up to its
    arguments, ``<tool_call>\\n{"name": "N", "arguments":``.  Both end where the template's own rendering of the
    finished call has a token boundary (a BPE pre-tokenizer keeps a space with what follows it: Qwen2.5 encodes the
    template's ``"arguments": {"`` as ``":`` and `` {"``; a forced lone space was a token the template never writes),
    so the forced ids are a prefix of the next turn's prompt and that turn hits all of them.
    Raises :class:`InvalidArgumentError` for anything else, ``"required"`` or a name without tools, or a name that is
    not a tool's.  (:func:`prepare_chat` also refuses a forced call where no grammar can constrain the rest of it:
    llguidance, extra ``structured``, missing, or a tokenizer it cannot read.)
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


def _check_tool_names(tools: Sequence[Mapping[str, Any]] | None) -> None:
    # The server refuses such lists too (a 400): in-process callers (LangChain's bind_tools, smolagents) get the same
    # checks.  After validate_tools: every tool is an object.  A function the model could never call (no name) is
    # refused; a tool of another kind (a hosted or custom one, named elsewhere or not at all) is left to the template,
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


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat or completion request ready to run: the prompt ids (a forced tool call included), the sampling and the
    :class:`ChatDecoder` that turns its tokens into text.  Built by :func:`prepare_chat` / :func:`prepare_completion`;
    run it pull-based (:func:`chat_stream`) or on a :class:`~prefixcache.engine.batching.BatchEngine`
    (:func:`submit_chat`)."""

    prompt_ids: list[int]
    sampling: SamplingParams
    decoder: ChatDecoder


class ChatDecoder:
    """Push-based decoding of one request's tokens: :meth:`feed` each generated token, get the text that became final
    (never text a stop string or a tool call later takes back) and whether a stop string ended the answer there;
    :meth:`finish` with the :class:`GenerationResult` gives the held-back tail and the :class:`ChatCompletion`.

    When :attr:`stopped` turns true the caller must end generation before computing that token's K/V (as
    ``runner.stream``'s ``send("stop")`` or the engine's ``on_token`` returning True do), so the turn is cached
    as with a stop token.  Not thread-safe: one request, one thread.  Cost per token: the :class:`TextStream`'s
    decode of a window of at most 16 ids, plus O(held-back text)."""

    __slots__ = (
        "_gate",
        "_hidden",
        "_parse_calls",
        "_pieces",
        "_request_id",
        "_stopper",
        "_text_stream",
        "arguments",
        "forced_ids",
    )

    def __init__(
        self,
        tokenizer: Any,
        stops: tuple[str, ...],
        params: SamplingParams,
        *,
        parse_calls: bool = False,
        forced_text: str = "",
        forced_ids: Sequence[int] = (),
        request_id: str | None = None,
    ) -> None:
        self._text_stream = TextStream(tokenizer, skip=params.stop_token_ids)
        self._hidden = params.stop_token_ids  # no text, and no logprobs entry
        self._stopper = StopMatcher(stops)
        self._gate = _ToolCallGate() if parse_calls else None
        if self._gate is not None and forced_text:
            self._gate.feed(forced_text)
        self._parse_calls = parse_calls
        self._pieces: list[str] = [forced_text]
        self._request_id = request_id
        self.forced_ids = tuple(forced_ids)
        self.arguments = {
            "stops": stops,
            "parse_calls": parse_calls,
            "forced_text": forced_text,
            "forced_ids": self.forced_ids,
            "request_id": request_id,
        }
        """What makes this decoder again over another tokenizer copy (:meth:`from_arguments`; plain data, pickles)."""

    @classmethod
    def from_arguments(cls, tokenizer: Any, params: SamplingParams, arguments: dict[str, Any]) -> ChatDecoder:
        """A fresh decoder equal to the one whose :attr:`arguments` these are (an engine process's copy)."""
        return cls(tokenizer, params=params, **arguments)

    @property
    def stopped(self) -> bool:
        """A stop string was seen: generation must end before the last fed token's K/V are computed."""
        return self._stopper.stopped

    def feed(self, token_id: int) -> str:
        """The text delta that ``token_id`` makes final (may be ``""``)."""
        text = self._stopper.feed(self._text_stream.push(token_id))
        self._pieces.append(text)
        return self._gate.feed(text) if self._gate is not None else text

    def shows_logprob(self, record: TokenLogprob) -> bool:
        """Whether ``record`` is an entry of :attr:`ChatCompletion.logprobs`: its token is not a stop token."""
        return record.token_id not in self._hidden

    def finish(self, result: GenerationResult) -> tuple[str, ChatCompletion]:
        """``(the last text delta, the ChatCompletion)`` once generation ended with ``result``; the tail is ``""``
        when tool calls were parsed (their text is in ``tool_calls``, not in the stream)."""
        stopper = self._stopper
        tail = stopper.feed(self._text_stream.flush())
        tail += stopper.flush()
        self._pieces.append(tail)
        text = "".join(self._pieces)
        # "prefill" (max_new_tokens=0: nothing generated) is the runner's own reason; the budget ended it: "length".
        finish = "stop" if stopper.stopped else "length" if result.finish_reason == "prefill" else result.finish_reason
        salt = self._request_id or uuid.uuid4().hex
        parsed = parse_tool_calls(text, id_salt=salt) if self._parse_calls else None
        if parsed is not None and parsed.tool_calls:
            content, calls, finish, rest = parsed.content, parsed.tool_calls, "tool_calls", ""
        else:
            gate = self._gate
            content, calls = text, ()
            rest = (gate.feed(tail) + gate.rest()) if gate is not None else tail
        logprobs = None if result.logprobs is None else tuple(filter(self.shows_logprob, result.logprobs))
        ids = self.forced_ids + result.token_ids
        return rest, ChatCompletion(content, calls, finish, result.usage, ids, logprobs)


def prepare_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    tool_choice: Any = None,
    stop: str | Sequence[str] | None = None,
    request_id: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    response_format: Mapping[str, Any] | None = None,
    **sampling: Any,
) -> PreparedChat:
    """Render ``messages`` and ``tools`` with ``tokenizer``'s chat template into a :class:`PreparedChat` (arguments as
    :func:`chat_stream`).  Raises TemplateError and InvalidArgumentError as :func:`chat_stream`."""
    if isinstance(messages, Sequence) and not isinstance(messages, str) and len(messages) == 0:
        # The template would render a bare generation prompt: an answer to nothing, which the server refuses too.
        raise InvalidArgumentError("messages must be a non-empty list of chat messages")
    stops = check_stop(stop)
    validate_tools(tools)  # first: the checks below read each tool as an object
    _check_tool_names(tools)
    forced_text = check_tool_choice(tool_choice, tools)
    parse_calls = bool(tools) and tool_choice != "none"
    if forced_text:
        name = None if tool_choice == "required" else tool_choice["function"]["name"]
        # Without a grammar the forced prefix was all there was, and a model could write anything after it: refused
        # as response_format's json_schema is, naming the extra.
        choice = "'required'" if name is None else f"naming function {name!r}"
        require_structured(tokenizer, f"tool_choice {choice} forces a call that follows the function's parameters")
        sampling["grammar"] = Grammar.tool_call(tools, name, tokenizer)
    elif parse_calls and response_format is None and strict_tools(tools) and structured_available(tokenizer):
        sampling["grammar"] = Grammar.tool_calls(tools, tokenizer)
    else:
        _add_response_format(tokenizer, sampling, response_format)
    params = _sampling_params(tokenizer, sampling)
    # Given only when there are some: a tokenizer written before the keyword still renders plain chats.
    variables = {"template_kwargs": template_kwargs} if template_kwargs else {}
    prompt = tokenizer.render_chat(messages, tools, add_generation_prompt=True, **variables)
    forced_ids = _encode_forced(tokenizer, forced_text)
    decoder = ChatDecoder(
        tokenizer,
        stops,
        params,
        parse_calls=parse_calls,
        forced_text=forced_text,
        forced_ids=forced_ids,
        request_id=request_id,
    )
    return PreparedChat(list(prompt) + forced_ids, params, decoder)


class StreamingRunner(Protocol):
    """What the pull-based drivers need of a runner (:class:`~prefixcache.engine.runner.PrefixCachingRunner`)."""

    tokenizer: Any

    def stream(
        self, prompt_ids: TokenIds, sampling: SamplingParams | None = None, **options: Any
    ) -> Generator[int, Any, GenerationResult]: ...


class SubmittingEngine(Protocol):
    """What :func:`submit_chat` needs of an engine (:class:`~prefixcache.engine.batching.BatchEngine`)."""

    def submit(self, prompt_ids: TokenIds, sampling: SamplingParams | None = None, **options: Any) -> RequestHandle: ...


_SAMPLING_FIELDS = frozenset(field.name for field in fields(SamplingParams))


def _sampling_params(tokenizer: Any, sampling: dict[str, Any]) -> SamplingParams:
    # The tokenizer's end-of-turn ids stop generation and its vocabulary bounds sampling unless the caller says else.
    unknown = sorted(set(sampling) - _SAMPLING_FIELDS)
    if unknown:
        raise InvalidArgumentError(
            f"unsupported parameter(s) {', '.join(unknown)}; sampling takes {', '.join(sorted(_SAMPLING_FIELDS))}"
        )
    sampling.setdefault("stop_token_ids", tokenizer.eos_token_ids)
    sampling.setdefault("vocab_limit", tokenizer.vocab_size)
    return SamplingParams(**sampling)


def prepare_completion(
    tokenizer: Any,
    prompt_ids: Sequence[int],
    *,
    stop: str | Sequence[str] | None = None,
    request_id: str | None = None,
    response_format: Mapping[str, Any] | None = None,
    **sampling: Any,
) -> PreparedChat:
    """A plain text completion of ``prompt_ids`` (no template, no tool calls) as a :class:`PreparedChat`.  Raises
    InvalidArgumentError for bad ``stop``, ``response_format`` or sampling."""
    stops = check_stop(stop)
    _add_response_format(tokenizer, sampling, response_format)
    params = _sampling_params(tokenizer, sampling)
    return PreparedChat(list(prompt_ids), params, ChatDecoder(tokenizer, stops, params, request_id=request_id))


def _add_response_format(tokenizer: Any, sampling: dict[str, Any], response_format: Any) -> None:
    checked = check_response_format(response_format)
    if checked is not None:
        kind, source = checked
        sampling["grammar"] = Grammar(source, tokenizer, kind)


def chat_stream(
    runner: StreamingRunner,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    tool_choice: Any = None,
    stop: str | Sequence[str] | None = None,
    namespace: str | None = None,
    request_id: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    **sampling: Any,
) -> Generator[str, None, ChatCompletion]:
    """Generate an answer to ``messages``; yields content text deltas, returns the :class:`ChatCompletion`.

    ``sampling`` are :class:`SamplingParams` fields (the tokenizer's end-of-turn ids stop generation unless
    ``stop_token_ids`` is given).  With ``tools`` and ``tool_choice`` ``None``/``"auto"``, ``<tool_call>`` blocks in
    the output become ``tool_calls`` (malformed ones stay text); ``"none"`` keeps the tools in the prompt (so it
    shares the cached prefix) and returns text only; ``"required"`` and a named function are forced by appending the
    start of a call to the prompt (:func:`check_tool_choice`); ``usage.prompt_tokens`` counts those tokens.  ``stop``
    strings (any number) end the answer before them; the turn is cached as with a stop token.  Closing the generator
    early releases the request's blocks and caches nothing of it.  ``template_kwargs`` are extra chat-template
    variables (``{"enable_thinking": False}`` for Qwen3; a template that does not read one ignores it).
    ``response_format`` (OpenAI's ``json_object`` or ``json_schema``) constrains the answer to it
    (:mod:`prefixcache.engine.grammar`); a forced tool call's arguments follow its function's ``parameters`` (a forced
    call takes precedence over ``response_format``), so forcing one needs llguidance (extra ``structured``) and a
    tokenizer it reads, as ``response_format`` does.  Under
    ``"auto"``, with a function marked ``"strict": true`` (and no ``response_format``), a call the model opens follows
    its function's ``parameters`` where strict, any object where not (nothing is masked before ``<tool_call>``, then
    the call, then text again: :func:`~prefixcache.engine.grammar.tool_calls_grammar`).

    Raises :class:`TemplateError` (bad messages, tools or template variables), :class:`InvalidArgumentError` (no
    messages, two tools of one name, bad ``stop``, ``tool_choice`` or sampling; ``tool_choice`` ``"required"`` or a
    named function, or ``response_format`` ``json_schema`` / ``json_object``, without llguidance), and the errors of
    :meth:`PrefixCachingRunner.stream`, before yielding anything.
    """
    prepared = prepare_chat(
        runner.tokenizer,
        messages,
        tools,
        tool_choice=tool_choice,
        stop=stop,
        request_id=request_id,
        template_kwargs=template_kwargs,
        **sampling,
    )
    steps = runner.stream(prepared.prompt_ids, prepared.sampling, namespace=namespace, request_id=request_id)
    return _drive(steps, prepared.decoder)


def _encode_forced(tokenizer: Any, text: str) -> list[int]:
    # Qwen's tokenizer has <tool_call> as one added token, the one its model generates; the byte tokenizer spells it.
    if not text:
        return []
    try:
        opener = [tokenizer.special_token_id(TOOL_CALL_OPEN)]
    except InvalidArgumentError:
        return tokenizer.encode(text)
    return opener + tokenizer.encode(text[len(TOOL_CALL_OPEN) :])


def _drive(steps: Generator[int, Any, GenerationResult], decoder: ChatDecoder) -> Generator[str, None, ChatCompletion]:
    try:
        try:
            token = next(steps)
            while True:
                out = decoder.feed(token)
                if out:
                    yield out
                token = steps.send("stop" if decoder.stopped else None)
        except StopIteration as done:
            result = done.value
    finally:
        steps.close()
    rest, completion = decoder.finish(result)
    if rest:
        yield rest
    return completion


def submit_chat(
    engine: SubmittingEngine,
    prepared: PreparedChat,
    *,
    namespace: str | None = None,
    request_id: str | None = None,
    on_delta: Callable[[str], None] | None = None,
    on_logprob: Callable[[TokenLogprob], None] | None = None,
) -> tuple[RequestHandle, Future[ChatCompletion]]:
    """Run ``prepared`` on ``engine`` (continuous batching): a stop string ends the request inside the engine as a
    stop token would.  ``on_delta(text)`` gets each text delta on the engine thread (it must not block: the engine
    steps every request); when the sampling asks for logprobs, ``on_logprob(record)`` gets each entry of
    :attr:`ChatCompletion.logprobs` there too, before the delta its token's text is part of (if any).  The future
    holds the :class:`ChatCompletion`, or the request's error (``concurrent.futures.CancelledError`` once
    ``handle.cancel()`` took effect).  Raises as :meth:`BatchEngine.submit`, at once; an engine process returns
    without waiting for its child, whose refusal is then the future's error
    (:meth:`~prefixcache.engine.process.EngineProcess.submit_prepared`)."""
    remote = getattr(engine, "submit_prepared", None)
    if remote is not None:  # an engine process runs the same function on its side (prefixcache.engine.process)
        return remote(prepared, namespace=namespace, request_id=request_id, on_delta=on_delta, on_logprob=on_logprob)
    decoder = prepared.decoder
    completed: Future[ChatCompletion] = Future()

    def on_token(token: int) -> bool:
        delta = decoder.feed(token)
        if delta and on_delta is not None:
            on_delta(delta)
        return decoder.stopped

    def settle(done: Future[GenerationResult]) -> None:
        error = done.exception()
        if error is None:
            try:
                rest, completion = decoder.finish(done.result())
                if rest and on_delta is not None:
                    on_delta(rest)
            except Exception as failure:  # noqa: BLE001 - the request's error, reported through its future
                completed.set_exception(failure)
                return
            completed.set_result(completion)
        else:
            completed.set_exception(error)

    def shown(record: TokenLogprob) -> None:
        if decoder.shows_logprob(record):
            on_logprob(record)

    handle = engine.submit(
        prepared.prompt_ids,
        prepared.sampling,
        namespace=namespace,
        request_id=request_id,
        on_token=on_token,
        on_logprob=None if on_logprob is None else shown,
    )
    handle.future.add_done_callback(settle)
    return handle, completed


def completion_stream(
    runner: StreamingRunner,
    prompt_ids: Sequence[int],
    *,
    stop: str | Sequence[str] | None = None,
    namespace: str | None = None,
    request_id: str | None = None,
    **sampling: Any,
) -> Generator[str, None, ChatCompletion]:
    """Plain text completion of ``prompt_ids`` (no template, no tool calls), with ``stop`` strings; yields text
    deltas and returns a :class:`ChatCompletion` whose ``content`` is the whole text.  Raises as :func:`chat_stream`."""
    prepared = prepare_completion(runner.tokenizer, prompt_ids, stop=stop, request_id=request_id, **sampling)
    steps = runner.stream(prepared.prompt_ids, prepared.sampling, namespace=namespace, request_id=request_id)
    return _drive(steps, prepared.decoder)


def complete_chat(
    runner: StreamingRunner,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    **options: Any,
) -> ChatCompletion:
    """:func:`chat_stream` run to the end; same arguments and errors."""
    return _run_to_end(chat_stream(runner, messages, tools, **options))


def complete_text(runner: StreamingRunner, prompt_ids: Sequence[int], **options: Any) -> ChatCompletion:
    """:func:`completion_stream` run to the end; same arguments and errors."""
    return _run_to_end(completion_stream(runner, prompt_ids, **options))


def _run_to_end(steps: Generator[str, None, ChatCompletion]) -> ChatCompletion:
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value
    finally:
        steps.close()
