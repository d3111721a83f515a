"""The OpenAI-compatible HTTP API (FastAPI): chat completions with tools, completions, responses, models (the list and
one by id), health, metrics, and prefix warming.

Every ``/v1`` request is authenticated first (a 401 touches nothing: no body is parsed, no cache state read or
changed), its namespace taken from its API key, and its model work submitted to one
:class:`~prefixcache.engine.batching.BatchEngine`: concurrent requests run together, one batched forward per step
(continuous batching, chunked prefill, prefix-aware admission), on the engine's one thread, so no two forwards ever
race on the pool.  Text is decoded and stop strings matched on that thread as tokens come out
(:func:`~prefixcache.engine.chat.submit_chat`); the event loop only writes the responses, and parses, checks and
renders a small request (a large one on a worker thread: :mod:`prefixcache.serve.offload`).
Responses always carry ``usage.prompt_tokens_details.cached_tokens``; a streamed response without
``stream_options.include_usage`` carries the usage on its finishing chunk.  A client that disconnects mid-stream
cancels its request, which frees its blocks at the engine's next step.  A request the engine drops itself (it
closes) answers 503, or ends its stream with an error event, never like a finished answer.

``GET /health`` and ``GET /metrics`` stay open with ``--api-keys``, as in vLLM: load balancers and Prometheus probe
them without credentials, and they show only pool-wide aggregates (no prompt, namespace or key).  Every error,
the router's own 404 and 405 included, has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from prefixcache.engine.batching import BatchEngine, RequestHandle
from prefixcache.engine.chat import ChatCompletion, prepare_chat, prepare_completion, submit_chat
from prefixcache.engine.process import EngineProcess
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.errors import CapacityError, EngineDeadError, OutOfBlocksError, PoolBusyError, PrefixCacheError
from prefixcache.serve.auth import ApiKeys, Unauthorized
from prefixcache.serve.delivery import job_events
from prefixcache.serve.echo import echoed_logprobs, echoed_usage, merge_logprobs, prompt_logprobs_job, running_usage
from prefixcache.serve.jobs import (
    DEFAULT_MAX_REQUEST_BYTES,
    closing,
    deliveries,
    ending,
    gone,
    merged_choices,
    sample_request_id,
    sample_seed,
    unless_gone,
)
from prefixcache.serve.logprobs import TokenStrings, chat_logprobs, completion_logprobs
from prefixcache.serve.metrics import CONTENT_TYPE, ServerMetrics
from prefixcache.serve.offload import RequestWork
from prefixcache.serve.openapi import openapi_document
from prefixcache.serve.protocol import (
    BadRequest,
    chat_chunk,
    chat_response,
    completion_response,
    error_body,
    parse_chat_request,
    parse_completion_request,
    parse_prefill_request,
    usage_json,
)
from prefixcache.serve.responses import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from prefixcache.serve.responses_routes import AppHooks, add_response_routes
from prefixcache.serve.samples import first_events, merged_streams
from prefixcache.serve.snapshots import SHUTDOWN_SAVE_TIMEOUT_S, SnapshotKeeper
from prefixcache.serve.tokenize_routes import add_tokenize_routes

__all__ = ["create_app"]

logger = logging.getLogger(__name__)


def _status_of(error: BaseException) -> int:
    # PoolBusyError derives from CapacityError but is transient: running requests hold the pool, a retry can pass.
    if isinstance(error, CapacityError) and not isinstance(error, PoolBusyError):
        return 400
    if isinstance(error, (OutOfBlocksError, EngineDeadError)):
        return 503  # other requests hold the pool right now, or the engine process is gone
    return 400 if isinstance(error, PrefixCacheError) else 500


# The bytes Starlette's JSONResponse renders, from encoders built once rather than per response or SSE chunk.
_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_SSE_JSON = json.JSONEncoder(ensure_ascii=False)


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    # A lone surrogate (JSON's "\ud800" escape, echoed back in an error naming a field) has no UTF-8 form: it is
    # written as that escape again, which is still valid JSON, rather than failing the response with a 500.
    data = _JSON.encode(body).encode("utf-8", "backslashreplace")
    return Response(data, status, headers, media_type="application/json")


def _error_response(error: BaseException) -> Response:
    if isinstance(error, BadRequest):
        kind = "not_found_error" if error.status == 404 else "invalid_request_error"
        body = error_body(str(error), kind=kind, param=error.param, code=error.code)
        return _json(body, error.status)
    status = _status_of(error)
    kind = "invalid_request_error" if status == 400 else "server_error"
    message = str(error) if status != 500 else f"internal error: {type(error).__name__}"
    return _json(error_body(message, kind=kind), status)


Submit = Callable[[Callable[[Any], None] | None], tuple[RequestHandle, Future[Any]]]
"""``submit(on_delta)``: start a request on the engine; its handle (to cancel it) and the future of its outcome."""


_SHUTTING_DOWN = "the server is shutting down: the request was cancelled before it finished"


def _sse(obj: Any) -> str:
    return f"data: {_SSE_JSON.encode(obj)}\n\n"


# FastAPI's native OpenTelemetry (FastAPI >= 0.165) checks the global providers on every request and wraps each in
# its middleware; the server's own /metrics covers what it would record, so it is switched off where it exists.
_NO_TELEMETRY = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


def create_app(
    runner: PrefixCachingRunner | EngineProcess,
    *,
    model_name: str = "prefixcache",
    api_keys: ApiKeys | None = None,
    snapshot_dir: str | os.PathLike[str] | None = None,
    snapshot_every_s: float | None = None,
    max_batch_tokens: int = 512,
    max_running: int = 32,
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The FastAPI app serving ``runner`` as model ``model_name``; ``api_keys`` (default: open) map keys to
    namespaces.  ``app.state.engine`` is the :class:`BatchEngine` stepping every request on its own thread
    (``max_batch_tokens`` and ``max_running`` are its bounds; closed when the app shuts down: call
    ``app.state.engine.close()`` yourself when the app is used without its lifespan, as with httpx's ASGI
    transport) and ``app.state.runner`` the runner.  Given an :class:`~prefixcache.engine.process.EngineProcess`
    instead of a runner, the app serves that engine in its own process (it is ``app.state.engine`` and
    ``app.state.runner``; its own bounds apply, ``max_batch_tokens`` and ``max_running`` are not used; closed with
    the app): the event loop then never holds the engine's GIL (``prefixcache serve``'s default).

    With ``snapshot_dir`` the app's lifespan restores the cache from that snapshot folder at start (cold, saying
    why, when there is none or it is refused), saves it every ``snapshot_every_s`` seconds and on a clean shutdown
    (:class:`~prefixcache.serve.snapshots.SnapshotKeeper`, ``app.state.snapshots``).  The Responses API
    (:mod:`prefixcache.serve.responses_routes`) keeps the last ``max_stored_responses`` responses of each API key's
    namespace, within a byte bound (``app.state.responses``: :mod:`prefixcache.serve.response_store`).  A request
    body over ``max_request_bytes`` (``app.state.max_request_bytes``) is a 413 in OpenAI's error shape, read no
    further; prompts are rendered and tokenized on a worker thread, and a body over 64 KiB is parsed and checked there
    too (:class:`~prefixcache.serve.offload.RequestWork`), so the event loop goes on serving streams and ``/health``
    meanwhile.  Raises InvalidArgumentError for a ``max_request_bytes`` below 1."""
    work = RequestWork(max_request_bytes)
    keys = api_keys if api_keys is not None else ApiKeys.open()
    engine: BatchEngine | EngineProcess = (
        runner
        if isinstance(runner, EngineProcess)
        else BatchEngine(runner, max_batch_tokens=max_batch_tokens, max_running=max_running)
    )
    metrics = ServerMetrics(engine)
    strings = TokenStrings(runner.tokenizer)  # the logprobs' token strings
    snapshots = None if snapshot_dir is None else SnapshotKeeper(engine, snapshot_dir, snapshot_every_s)
    engine.start()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if snapshots is None:
            yield
            engine.close()
            work.close()
            return
        await snapshots.restore()
        periodic = asyncio.create_task(snapshots.run_periodic())
        try:
            yield
        finally:
            periodic.cancel()
            await snapshots.save(timeout_s=SHUTDOWN_SAVE_TIMEOUT_S)
            engine.close()
            work.close()

    # Every handler reads its own body (to answer a bad one with OpenAI's error shape) and builds its own response,
    # so the routes are plain Starlette routes (app.add_route): FastAPI's per-request dependency solving and
    # response serialization would cost ~0.1 ms a request for nothing.  The bodies' schemas are declared once
    # (prefixcache.serve.schemas): the handlers validate with them and /openapi.json publishes them.
    app = FastAPI(title="prefixcache", lifespan=lifespan, openapi_url=None, **_NO_TELEMETRY)
    app.state.runner = runner
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.snapshots = snapshots
    app.state.max_request_bytes = max_request_bytes

    def run_job(submit: Submit, request: Request) -> AsyncIterator[tuple[str, Any]]:
        return job_events(work, submit, request)  # the engine thread only posts; the loop frames (serve.delivery)

    async def finish_samples(start: Callable[..., Any], request: Request, n: int) -> list[tuple[str, Any]]:
        """The ends (:func:`finish_job`) of ``n`` samples, ``start(on_delta, sample=i)`` submitted together and
        awaited in order; those still running when the handler stops are cancelled."""
        tasks = [asyncio.ensure_future(finish_job(functools.partial(start, sample=i), request)) for i in range(n)]
        try:
            return [await task for task in tasks]
        finally:
            for task in tasks:
                task.cancel()

    async def finish_job(submit: Submit, request: Request) -> tuple[str, Any]:
        """A request's end only: one future and one wake-up of the event loop, where a stream needs a queue.  A
        client that disconnects first, or a handler cancelled while waiting, cancels the engine request (``("gone",
        None)``).  ``submit`` runs on the worker thread (:meth:`RequestWork.submit`)."""
        try:
            handle, future = await work.submit(submit, None)
        except asyncio.CancelledError:
            return "cancelled", None
        except Exception as error:  # noqa: BLE001
            return "error", error
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[tuple[str, Any]] = loop.create_future()

        def settle(outcome: tuple[str, Any]) -> None:
            if not ended.done():  # the request may have been cancelled (client gone) before it ended
                ended.set_result(outcome)

        def on_done(done: Future[Any]) -> None:
            try:
                loop.call_soon_threadsafe(settle, ending(done))
            except RuntimeError:
                pass

        future.add_done_callback(on_done)
        try:
            answered, result = await unless_gone(request, ended)
            return result if answered else ("gone", None)
        except asyncio.CancelledError:
            # uvicorn cancels the handlers still running when its graceful shutdown times out (it never cancels
            # one whose client left): answered as a request the closing engine dropped, not as its plain 500.
            return "cancelled", None
        finally:
            handle.cancel()

    def authenticate(request: Request) -> str | None:
        return keys.namespace_for(request.headers.get("authorization"))

    read_json = work.read_json
    off_loop = work.call

    def check_model(name: str) -> None:
        if name != model_name:
            raise BadRequest(
                f"the model {name!r} does not exist; this server serves {model_name!r}", "model", 404, "model_not_found"
            )

    def route(path: str, method: str) -> Callable[[Callable[[Request], Any]], Callable[[Request], Any]]:
        def add(endpoint: Callable[[Request], Any]) -> Callable[[Request], Any]:
            app.add_route(path, endpoint, methods=[method])
            return endpoint

        return add

    @app.exception_handler(Unauthorized)
    async def unauthorized(request: Request, error: Unauthorized) -> Response:
        body = error_body(str(error), param=None, code="invalid_api_key")
        return _json(body, 401, {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(ClientDisconnect)
    async def client_disconnected(request: Request, error: ClientDisconnect) -> Response:
        # An upload cut off mid-body is the client's doing and nobody reads the answer: one line, not a traceback.
        logger.info("client disconnected before sending its whole body: %s %s", request.method, request.url.path)
        return gone()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        # The router's own 404 (no such path) and 405 (wrong method), in the error shape every OpenAI client parses.
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = f"{error.detail}: {request.method} {request.url.path}"
        body = error_body(message, kind=kind, code=str(error.detail).lower().replace(" ", "_"))
        return _json(body, error.status_code, error.headers)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError) -> Response:
        # /health, /metrics and the other reads of an engine process that is gone: unavailable, not a traceback.
        logger.error("%s %s: %s", request.method, request.url.path, error)
        return _json(error_body(str(error), kind="server_error"), 503)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest) -> Response:
        metrics.failed(request.url.path, error.status)
        return _error_response(error)

    # On the loop: num_pending is O(1) under a lock held briefly, an engine process's without a round trip, so /health
    # answers whatever the engine does (503 once an engine process is gone or stopped answering).
    @route("/health", "GET")
    async def health(request: Request) -> Response:
        return _json({"status": "ok", "model": model_name, "pending_requests": engine.num_pending})

    # The engine's figures are a round trip to an engine process: read on one worker thread and awaited for at most
    # metrics.figures_timeout_s, so a silent engine gets prefixcache_engine_up 0 at once (serve.metrics).
    @route("/metrics", "GET")
    async def scrape(request: Request) -> Response:
        return Response(await metrics.scrape(), media_type=CONTENT_TYPE)

    document: list[dict[str, Any]] = []

    @route("/openapi.json", "GET")
    async def openapi(request: Request) -> Response:
        if not document:
            document.append(openapi_document(app.title, app.version))
        return _json(document[0])

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "prefixcache"}

    @route("/v1/models", "GET")
    async def models(request: Request) -> Response:
        authenticate(request)
        return _json({"object": "list", "data": [card]})

    @route("/v1/models/{model_id:path}", "GET")
    async def model(request: Request) -> Response:
        # ":path": an id may hold a slash ("org/name"), which the openai client sends escaped and uvicorn unescapes.
        authenticate(request)
        try:
            check_model(request.path_params["model_id"])
        except BadRequest as unknown:
            # Answered here, not raised to the handler that counts failures by path: this path holds any id.
            return _error_response(unknown)
        return _json(card)

    def outcome(kind: str, value: Any, endpoint: str) -> ChatCompletion | Response:
        """A job's end: the finished completion, or the error response (either counted in metrics; a client that
        left is not)."""
        if kind == "gone":
            return gone()
        if kind == "cancelled":
            metrics.failed(endpoint, 503)
            return _json(error_body(_SHUTTING_DOWN, kind="server_error"), 503)
        if kind != "done":
            metrics.failed(endpoint, _status_of(value))
            return _error_response(value)
        metrics.observe(endpoint, value.usage)
        return value

    def stream_failure(kind: str, value: Any, endpoint: str) -> str:
        """The SSE error event that ends a stream whose request failed or was dropped by the engine (closing) after
        its response began, counted as a failure; a stream that ends without it reads as a finished answer."""
        if kind == "cancelled":
            metrics.failed(endpoint, 503)
            return _sse(error_body(_SHUTTING_DOWN, kind="server_error"))
        metrics.failed(endpoint, _status_of(value))
        return _sse(error_body(str(value), kind="server_error"))

    @route("/v1/chat/completions", "POST")
    async def chat_completions(request: Request) -> Response:
        namespace = authenticate(request)
        chat = await off_loop(request, parse_chat_request, await read_json(request), runner.tokenizer.vocab_size)
        check_model(chat.model)
        request_id = "chatcmpl-" + uuid.uuid4().hex
        prompt_tokens = [0]  # the prompt's length once rendered, for continuous usage

        def start(on_delta: Callable[[Any], None] | None, sample: int = 0) -> tuple[RequestHandle, Future[Any]]:
            prepared = prepare_chat(
                runner.tokenizer,
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
            return submit_chat(engine, prepared, namespace=namespace, request_id=sample_id, **callbacks)

        def logprobs_of(records: Any) -> dict[str, Any] | None:
            return None if chat.logprobs is None else chat_logprobs(records, strings)

        def counted(chunk: dict[str, Any], tokens: int) -> dict[str, Any]:
            if chat.continuous_usage:
                chunk["usage"] = running_usage(prompt_tokens[0], tokens)
            return chunk

        if not chat.stream:  # n samples, each its own request (prefix-aware admission prefills the prompt once)
            bodies = []
            for end in await finish_samples(start, request, chat.n):
                done = outcome(*end, "/v1/chat/completions")
                if isinstance(done, Response):
                    return done
                bodies.append(chat_response(request_id, model_name, done, logprobs_of(done.logprobs)))
            return _json(merged_choices(bodies))
        jobs = [run_job(functools.partial(start, sample=i), request) for i in range(chat.n)]
        answered, heads = await unless_gone(request, first_events(jobs))  # a queued request waits for its first token
        if not answered:
            return gone()
        refused = next((head for head in heads if head[0] == "error"), None)
        if refused is not None:
            for events in jobs:
                await events.aclose()
            return outcome(*refused, "/v1/chat/completions")

        async def chat_sse(kind_: str, value: Any, events: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[str]:
            sent = 0  # logprob entries streamed so far
            yield _sse(counted(chat_chunk(request_id, model_name, {"role": "assistant", "content": ""}), 0))
            while kind_ == "delta":
                text, records = value
                sent += len(records)
                chunk = chat_chunk(request_id, model_name, {"content": text}, logprobs=logprobs_of(records))
                yield _sse(counted(chunk, sent))
                kind_, value = await anext(events)
            if kind_ in ("error", "cancelled"):
                yield stream_failure(kind_, value, "/v1/chat/completions")
            elif kind_ == "done":
                done: ChatCompletion = value
                metrics.observe("/v1/chat/completions", done.usage)
                if done.tool_calls:
                    calls = [{"index": i, **call} for i, call in enumerate(done.tool_calls)]
                    chunk = chat_chunk(request_id, model_name, {"tool_calls": calls})
                    yield _sse(counted(chunk, done.usage.generated_tokens))
                usage = None if chat.include_usage and not chat.continuous_usage else done.usage
                rest = logprobs_of(done.logprobs[sent:]) if done.logprobs and done.logprobs[sent:] else None
                yield _sse(chat_chunk(request_id, model_name, {}, done.finish_reason, usage, rest))
                if chat.include_usage:
                    yield _sse(chat_chunk(request_id, model_name, None, usage=done.usage))
            yield "data: [DONE]\n\n"

        streams = [closing(chat_sse(*head, events), events) for head, events in zip(heads, jobs, strict=True)]
        lines = streams[0] if chat.n == 1 else merged_streams(streams, continuous_usage=chat.continuous_usage)
        return StreamingResponse(lines, media_type="text/event-stream")

    @route("/v1/completions", "POST")
    async def completions(request: Request) -> Response:
        namespace = authenticate(request)
        body = await off_loop(request, parse_completion_request, await read_json(request), runner.tokenizer.vocab_size)
        check_model(body.model)
        request_id = "cmpl-" + uuid.uuid4().hex

        def tokenized() -> tuple[Any, str]:  # the prompt's ids, and its text when echoed
            if isinstance(body.prompt, str):
                return runner.tokenizer.encode(body.prompt), body.prompt
            return body.prompt, runner.tokenizer.decode(body.prompt) if body.echo else ""

        ids, prompt_text = await work.tokenizing(tokenized)
        vocab_limit = runner.tokenizer.vocab_size

        def start(on_delta: Callable[[Any], None] | None, sample: int = 0) -> tuple[RequestHandle, Future[Any]]:
            prepared = prepare_completion(
                runner.tokenizer,
                ids,
                stop=body.stop,
                request_id=request_id,
                response_format=body.response_format,
                **{**body.sampling, "seed": sample_seed(body.sampling.get("seed"), sample)},
            )
            callbacks = deliveries(on_delta, body.sampling.get("logprobs"))
            sample_id = sample_request_id(request_id, sample)
            return submit_chat(engine, prepared, namespace=namespace, request_id=sample_id, **callbacks)

        def logprobs_of(records: Any, offset: int) -> tuple[dict[str, Any] | None, int]:
            return (None, offset) if body.logprobs is None else completion_logprobs(records, strings, offset)

        # echo: the prompt first; with logprobs, from a prefill that recomputes it (cached positions keep no logits).
        echo_text, echo_logprobs, echo_offset, prefill = prompt_text if body.echo else "", None, 0, None
        if body.echo and body.logprobs is not None:
            first = outcome(
                *await finish_job(
                    lambda _: prompt_logprobs_job(engine, ids, namespace, vocab_limit, body.logprobs), request
                ),
                "/v1/completions",
            )
            if isinstance(first, Response):
                return first
            prefill = first.usage
            echoed = await off_loop(request, echoed_logprobs, first, ids, strings)
            echo_logprobs, echo_offset = echoed

        if not body.stream:
            bodies = []
            for end in await finish_samples(start, request, body.n):
                done = outcome(*end, "/v1/completions")
                if isinstance(done, Response):
                    return done
                text = echo_text + (done.content or "")
                logprobs = merge_logprobs(echo_logprobs, logprobs_of(done.logprobs, echo_offset)[0])
                usage = echoed_usage(prefill, done.usage)
                bodies.append(completion_response(request_id, model_name, text, done.finish_reason, usage, logprobs))
            return _json(merged_choices(bodies))
        jobs = [run_job(functools.partial(start, sample=i), request) for i in range(body.n)]
        answered, heads = await unless_gone(request, first_events(jobs))  # a queued request waits for its first token
        if not answered:
            return gone()
        refused = next((head for head in heads if head[0] == "error"), None)
        if refused is not None:
            for events in jobs:
                await events.aclose()
            return outcome(*refused, "/v1/completions")

        def counted(chunk: dict[str, Any], tokens: int) -> dict[str, Any]:
            if body.continuous_usage:
                chunk["usage"] = running_usage(len(ids), tokens)
            return chunk

        async def completion_sse(kind_: str, value: Any, events: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[str]:
            sent, offset = 0, echo_offset  # logprob entries streamed so far, and where the next one's text starts
            if body.echo:
                yield _sse(
                    counted(completion_response(request_id, model_name, echo_text, None, None, echo_logprobs), 0)
                )
            while kind_ == "delta":
                text, records = value
                sent += len(records)
                logprobs, offset = logprobs_of(records, offset)
                yield _sse(counted(completion_response(request_id, model_name, text, None, None, logprobs), sent))
                kind_, value = await anext(events)
            if kind_ in ("error", "cancelled"):
                yield stream_failure(kind_, value, "/v1/completions")
            elif kind_ == "done":
                metrics.observe("/v1/completions", value.usage)
                full_usage = echoed_usage(prefill, value.usage)
                usage = None if body.include_usage and not body.continuous_usage else full_usage
                rest = (
                    logprobs_of(value.logprobs[sent:], offset)[0] if value.logprobs and value.logprobs[sent:] else None
                )
                yield _sse(completion_response(request_id, model_name, "", value.finish_reason, usage, rest))
                if body.include_usage:
                    chunk = completion_response(request_id, model_name, "", None, full_usage)
                    chunk["choices"] = []
                    yield _sse(chunk)
            yield "data: [DONE]\n\n"

        streams = [closing(completion_sse(*head, events), events) for head, events in zip(heads, jobs, strict=True)]
        lines = streams[0] if body.n == 1 else merged_streams(streams, continuous_usage=body.continuous_usage)
        return StreamingResponse(lines, media_type="text/event-stream")

    @route("/v1/cache/prefill", "POST")
    async def prefill(request: Request) -> Response:
        namespace = authenticate(request)
        body = await off_loop(request, parse_prefill_request, await read_json(request), runner.tokenizer.vocab_size)
        if body.model is not None:
            check_model(body.model)

        def start(on_delta: Callable[[str], None] | None) -> tuple[RequestHandle, Future[Any]]:
            if body.messages is not None:
                ids = runner.tokenizer.render_chat(body.messages, body.tools, add_generation_prompt=False)
            elif isinstance(body.prompt, str):
                ids = runner.tokenizer.encode(body.prompt)
            else:
                ids = body.prompt
            params = SamplingParams(max_new_tokens=0)
            handle = engine.submit(ids, params, namespace=namespace, priority=body.priority, retain_s=body.retain_s)
            return handle, handle.future

        done = outcome(*await finish_job(start, request), "/v1/cache/prefill")
        if isinstance(done, Response):
            return done
        return _json({"object": "cache.prefill", "usage": usage_json(done.usage)})

    app.state.responses = ResponseStore(max_stored_responses, namespaces=set(keys.namespaces.values()) or {None})
    hooks = AppHooks(
        route=route,
        authenticate=authenticate,
        read_json=read_json,
        off_loop=off_loop,
        tokenizing=work.tokenizing,
        check_model=check_model,
        run_job=run_job,
        finish_job=finish_job,
        outcome=outcome,
        unless_gone=unless_gone,
    )
    add_response_routes(hooks, runner, engine, app.state.responses)
    add_tokenize_routes(hooks, runner)
    return app
