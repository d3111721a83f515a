"""The completion routes: ``POST /v1/chat/completions`` (with tools) and ``POST /v1/completions``, plain or streamed.

Text is decoded and stop strings matched on the engine's thread as tokens come out
(:func:`~prefixcache.engine.chat.submit_chat`); the event loop only writes the responses.  ``n`` samples are each
their own engine request (prefix-aware admission prefills the shared prompt once: :mod:`prefixcache.serve.jobs`).
Responses always carry ``usage.prompt_tokens_details.cached_tokens``; a streamed response without
``stream_options.include_usage`` carries the usage on its finishing chunk.  A client that disconnects mid-stream
cancels its request, which frees its blocks at the engine's next step.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from prefixcache.engine.batching import RequestHandle
from prefixcache.engine.chat import prepare_chat, prepare_completion, submit_chat
from prefixcache.engine.chat_decoder import ChatCompletion
from prefixcache.serve.dispatch import finish_job, finish_samples, outcome, start_streams, stream_failure
from prefixcache.serve.echo import echoed_logprobs, echoed_usage, merge_logprobs, prompt_logprobs_job, running_usage
from prefixcache.serve.jobs import closing, deliveries, merged_choices, sample_request_id, sample_seed
from prefixcache.serve.logprobs import chat_logprobs, completion_logprobs
from prefixcache.serve.protocol import (
    chat_chunk,
    chat_response,
    completion_response,
    parse_chat_request,
    parse_completion_request,
)
from prefixcache.serve.replies import json_response, sse
from prefixcache.serve.samples import merged_streams
from prefixcache.serve.state import server_state

__all__ = ["add_completion_routes", "chat_completions", "completions"]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
_DONE = "data: [DONE]\n\n"


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``: ``n`` choices for the rendered messages, as one JSON body or an SSE stream."""
    state = server_state(request)
    namespace = state.authenticate(request)
    body = await state.work.read_json(request)
    chat = await state.work.call(request, parse_chat_request, body, state.tokenizer.vocab_size)
    state.check_model(chat.model)
    model_name, strings = state.model_name, state.strings
    request_id = "chatcmpl-" + uuid.uuid4().hex
    prompt_tokens = [0]  # the prompt's length once rendered, for continuous usage

    def start(on_delta: Callable[[Any], None] | None, sample: int = 0) -> tuple[RequestHandle, Future[Any]]:
        prepared = prepare_chat(
            state.tokenizer,
            chat.messages,
            chat.tools,
            tool_choice=chat.tool_choice,
            stop=chat.stop,
            request_id=request_id,
            template_kwargs=chat.template_kwargs,
            response_format=chat.response_format,
            **{**chat.sampling, "seed": sample_seed(chat.sampling.get("seed"), sample)},
        )
        prompt_tokens[0] = len(prepared.prompt_ids)
        callbacks = deliveries(on_delta, chat.sampling.get("logprobs"))
        sample_id = sample_request_id(request_id, sample)
        return submit_chat(state.engine, prepared, namespace=namespace, request_id=sample_id, **callbacks)

    def logprobs_of(records: Any) -> dict[str, Any] | None:
        return None if chat.logprobs is None else chat_logprobs(records, strings)

    def counted(chunk: dict[str, Any], tokens: int) -> dict[str, Any]:
        if chat.continuous_usage:
            chunk["usage"] = running_usage(prompt_tokens[0], tokens)
        return chunk

    if not chat.stream:  # n samples, each its own request (prefix-aware admission prefills the prompt once)
        bodies = []
        for end in await finish_samples(state, start, request, chat.n):
            done = outcome(state, *end, CHAT)
            if isinstance(done, Response):
                return done
            bodies.append(chat_response(request_id, model_name, done, logprobs_of(done.logprobs)))
        return json_response(merged_choices(bodies))
    started = await start_streams(state, start, request, chat.n, CHAT)
    if isinstance(started, Response):
        return started

    async def chat_sse(kind: str, value: Any, events: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[str]:
        sent = 0  # logprob entries streamed so far
        yield sse(counted(chat_chunk(request_id, model_name, {"role": "assistant", "content": ""}), 0))
        while kind == "delta":
            text, records = value
            sent += len(records)
            chunk = chat_chunk(request_id, model_name, {"content": text}, logprobs=logprobs_of(records))
            yield sse(counted(chunk, sent))
            kind, value = await anext(events)
        if kind in ("error", "cancelled"):
            yield stream_failure(state, kind, value, CHAT)
        elif kind == "done":
            done: ChatCompletion = value
            state.metrics.observe(CHAT, done.usage)
            if done.tool_calls:
                calls = [{"index": i, **call} for i, call in enumerate(done.tool_calls)]
                chunk = chat_chunk(request_id, model_name, {"tool_calls": calls})
                yield sse(counted(chunk, done.usage.generated_tokens))
            usage = None if chat.include_usage and not chat.continuous_usage else done.usage
            rest = logprobs_of(done.logprobs[sent:]) if done.logprobs and done.logprobs[sent:] else None
            yield sse(chat_chunk(request_id, model_name, {}, done.finish_reason, usage, rest))
            if chat.include_usage:
                yield sse(chat_chunk(request_id, model_name, None, usage=done.usage))
        yield _DONE

    heads, jobs = started
    streams = [closing(chat_sse(*head, events), events) for head, events in zip(heads, jobs, strict=True)]
    lines = streams[0] if chat.n == 1 else merged_streams(streams, continuous_usage=chat.continuous_usage)
    return StreamingResponse(lines, media_type="text/event-stream")


async def completions(request: Request) -> Response:
    """``POST /v1/completions``: ``n`` choices continuing a prompt (text or token ids), the prompt echoed first when
    asked (with its logprobs, from a prefill that recomputes it), as one JSON body or an SSE stream."""
    state = server_state(request)
    namespace = state.authenticate(request)
    raw = await state.work.read_json(request)
    body = await state.work.call(request, parse_completion_request, raw, state.tokenizer.vocab_size)
    state.check_model(body.model)
    model_name, strings, tokenizer = state.model_name, state.strings, state.tokenizer
    request_id = "cmpl-" + uuid.uuid4().hex

    def tokenized() -> tuple[Any, str]:  # the prompt's ids, and its text when echoed
        if isinstance(body.prompt, str):
            return tokenizer.encode(body.prompt), body.prompt
        return body.prompt, tokenizer.decode(body.prompt) if body.echo else ""

    ids, prompt_text = await state.work.tokenizing(tokenized)
    vocab_limit = tokenizer.vocab_size

    def start(on_delta: Callable[[Any], None] | None, sample: int = 0) -> tuple[RequestHandle, Future[Any]]:
        prepared = prepare_completion(
            tokenizer,
            ids,
            stop=body.stop,
            request_id=request_id,
            response_format=body.response_format,
            **{**body.sampling, "seed": sample_seed(body.sampling.get("seed"), sample)},
        )
        callbacks = deliveries(on_delta, body.sampling.get("logprobs"))
        sample_id = sample_request_id(request_id, sample)
        return submit_chat(state.engine, prepared, namespace=namespace, request_id=sample_id, **callbacks)

    def logprobs_of(records: Any, offset: int) -> tuple[dict[str, Any] | None, int]:
        return (None, offset) if body.logprobs is None else completion_logprobs(records, strings, offset)

    # echo: the prompt first; with logprobs, from a prefill that recomputes it (cached positions keep no logits).
    echo_text, echo_logprobs, echo_offset, prefill = prompt_text if body.echo else "", None, 0, None
    if body.echo and body.logprobs is not None:

        def prompt_job(_: Any) -> tuple[RequestHandle, Future[Any]]:
            return prompt_logprobs_job(state.engine, ids, namespace, vocab_limit, body.logprobs)

        first = outcome(state, *await finish_job(state, prompt_job, request), COMPLETIONS)
        if isinstance(first, Response):
            return first
        prefill = first.usage
        echo_logprobs, echo_offset = await state.work.call(request, echoed_logprobs, first, ids, strings)

    if not body.stream:
        bodies = []
        for end in await finish_samples(state, start, request, body.n):
            done = outcome(state, *end, COMPLETIONS)
            if isinstance(done, Response):
                return done
            text = echo_text + (done.content or "")
            logprobs = merge_logprobs(echo_logprobs, logprobs_of(done.logprobs, echo_offset)[0])
            usage = echoed_usage(prefill, done.usage)
            bodies.append(completion_response(request_id, model_name, text, done.finish_reason, usage, logprobs))
        return json_response(merged_choices(bodies))
    started = await start_streams(state, start, request, body.n, COMPLETIONS)
    if isinstance(started, Response):
        return started

    def counted(chunk: dict[str, Any], tokens: int) -> dict[str, Any]:
        if body.continuous_usage:
            chunk["usage"] = running_usage(len(ids), tokens)
        return chunk

    async def completion_sse(kind: str, value: Any, events: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[str]:
        sent, offset = 0, echo_offset  # logprob entries streamed so far, and where the next one's text starts
        if body.echo:
            yield sse(counted(completion_response(request_id, model_name, echo_text, None, None, echo_logprobs), 0))
        while kind == "delta":
            text, records = value
            sent += len(records)
            logprobs, offset = logprobs_of(records, offset)
            yield sse(counted(completion_response(request_id, model_name, text, None, None, logprobs), sent))
            kind, value = await anext(events)
        if kind in ("error", "cancelled"):
            yield stream_failure(state, kind, value, COMPLETIONS)
        elif kind == "done":
            state.metrics.observe(COMPLETIONS, value.usage)
            full_usage = echoed_usage(prefill, value.usage)
            usage = None if body.include_usage and not body.continuous_usage else full_usage
            rest = logprobs_of(value.logprobs[sent:], offset)[0] if value.logprobs and value.logprobs[sent:] else None
            yield sse(completion_response(request_id, model_name, "", value.finish_reason, usage, rest))
            if body.include_usage:
                chunk = completion_response(request_id, model_name, "", None, full_usage)
                chunk["choices"] = []
                yield sse(chunk)
        yield _DONE

    heads, jobs = started
    streams = [closing(completion_sse(*head, events), events) for head, events in zip(heads, jobs, strict=True)]
    lines = streams[0] if body.n == 1 else merged_streams(streams, continuous_usage=body.continuous_usage)
    return StreamingResponse(lines, media_type="text/event-stream")


def add_completion_routes(app: FastAPI) -> None:
    """Add the chat completion and completion routes to ``app``."""
    app.add_route(CHAT, chat_completions, methods=["POST"])
    app.add_route(COMPLETIONS, completions, methods=["POST"])
