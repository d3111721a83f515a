"""Chat completions on a runner: template, tool choice, string stop sequences, streamed text, parsed tool calls.

:func:`chat_stream` is what an OpenAI-style endpoint or an agent-framework adapter needs from one request: it renders
the messages with the tokenizer's chat template, generates through the prefix cache, yields the answer text as it
becomes final (never text a stop string or a tool call later takes back), and returns a :class:`ChatCompletion` with
the content, the OpenAI ``tool_calls`` parsed from ``<tool_call>`` blocks, the finish reason and the usage (cached
tokens included).  A string stop sequence ends the request the way a stop token does, so its prompt and answer are
cached for the next turn.

The work is split so that both ways of running a request share it: :func:`prepare_chat` renders the prompt (a
``tool_choice`` forced as :mod:`prefixcache.engine.tool_choice` says) and builds a
:class:`~prefixcache.engine.chat_decoder.ChatDecoder` (push-based: tokens in, text deltas and "stop here" out, then
the completion); :func:`chat_stream` drives it pull-based through ``runner.stream``, :func:`submit_chat` from the
batching engine's per-token callback, as the server does.  Both run on the one engine core
(:mod:`prefixcache.engine.core`); this module knows them only by what it calls (:class:`StreamingRunner`,
:class:`SubmittingEngine`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any, Protocol

from prefixcache.cache.tokens import TokenIds
from prefixcache.chat.stop import check_stop
from prefixcache.chat.template import validate_tools
from prefixcache.engine.chat_decoder import ChatCompletion, ChatDecoder
from prefixcache.engine.grammar import (
    Grammar,
    check_response_format,
    require_structured,
    strict_tools,
    structured_available,
)
from prefixcache.engine.request import RequestHandle
from prefixcache.engine.results import GenerationResult, TokenLogprob
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.tool_choice import check_tool_choice, check_tool_names, encode_forced
from prefixcache.errors import InvalidArgumentError

__all__ = [
    "PreparedChat",
    "chat_stream",
    "complete_chat",
    "complete_text",
    "completion_stream",
    "prepare_chat",
    "prepare_completion",
    "submit_chat",
]


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat or completion request ready to run: the prompt ids (a forced tool call included), the sampling and the
    :class:`~prefixcache.engine.chat_decoder.ChatDecoder` that turns its tokens into text.  Built by
    :func:`prepare_chat` / :func:`prepare_completion`; run it pull-based (:func:`chat_stream`) or on a
    :class:`~prefixcache.engine.batching.BatchEngine` (:func:`submit_chat`)."""

    prompt_ids: list[int]
    sampling: SamplingParams
    decoder: ChatDecoder


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
    check_tool_names(tools)
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
    forced_ids = encode_forced(tokenizer, forced_text)
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
