"""The OpenAI-compatible HTTP API (FastAPI): chat completions with tools, completions, models, health, metrics, and
prefix warming.

Every ``/v1`` request is authenticated first (a 401 touches nothing: no body is parsed, no cache state read or
changed), its namespace taken from its API key, and its model work handed to the one :class:`ModelWorker` thread.
Responses always carry ``usage.prompt_tokens_details.cached_tokens``; a streamed response without
``stream_options.include_usage`` carries the usage on its finishing chunk.  A client that disconnects mid-stream
cancels its job, which closes its generator and frees its blocks.

``GET /health`` and ``GET /metrics`` stay open with ``--api-keys``, as in vLLM: load balancers and Prometheus probe
them without credentials, and they show only pool-wide aggregates (no prompt, namespace or key).  Every error,
the router's own 404 and 405 included, has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Callable, Generator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from prefixcache.engine.chat import ChatCompletion, chat_stream, completion_stream
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.errors import CapacityError, OutOfBlocksError, PrefixCacheError
from prefixcache.serve.auth import ApiKeys, Unauthorized
from prefixcache.serve.metrics import CONTENT_TYPE, ServerMetrics
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
from prefixcache.serve.snapshots import SnapshotKeeper
from prefixcache.serve.worker import ModelWorker

__all__ = ["create_app"]


def _status_of(error: BaseException) -> int:
    if isinstance(error, CapacityError):
        return 400
    if isinstance(error, OutOfBlocksError):
        return 503  # other requests hold the pool right now; a retry may succeed
    return 400 if isinstance(error, PrefixCacheError) else 500


def _error_response(error: BaseException) -> JSONResponse:
    if isinstance(error, BadRequest):
        kind = "not_found_error" if error.status == 404 else "invalid_request_error"
        body = error_body(str(error), kind=kind, param=error.param, code=error.code)
        return JSONResponse(body, status_code=error.status)
    status = _status_of(error)
    kind = "invalid_request_error" if status == 400 else "server_error"
    message = str(error) if status != 500 else f"internal error: {type(error).__name__}"
    return JSONResponse(error_body(message, kind=kind), status_code=status)


async def _closing(lines: AsyncIterator[str], events: Any) -> AsyncIterator[str]:
    """``lines``, then close the job's ``events`` however the response ends (finished, failed, or the client gone),
    which cancels the job and frees its blocks."""
    try:
        async for line in lines:
            yield line
    finally:
        await events.aclose()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(
    runner: PrefixCachingRunner,
    *,
    model_name: str = "prefixcache",
    api_keys: ApiKeys | None = None,
    snapshot_dir: str | os.PathLike[str] | None = None,
    snapshot_every_s: float | None = None,
) -> FastAPI:
    """The FastAPI app serving ``runner`` as model ``model_name``; ``api_keys`` (default: open) map keys to
    namespaces.  ``app.state.worker`` is the model thread (closed when the app shuts down; call
    ``app.state.worker.close()`` yourself when the app is used without its lifespan, as with httpx's ASGI
    transport) and ``app.state.runner`` the runner.

    With ``snapshot_dir`` the app's lifespan restores the cache from that snapshot folder at start (cold, saying
    why, when there is none or it is refused), saves it every ``snapshot_every_s`` seconds and on a clean shutdown
    (:class:`~prefixcache.serve.snapshots.SnapshotKeeper`, ``app.state.snapshots``)."""
    keys = api_keys if api_keys is not None else ApiKeys.open()
    worker = ModelWorker()
    metrics = ServerMetrics(runner.cache)
    try:
        snapshots = None if snapshot_dir is None else SnapshotKeeper(runner, worker, snapshot_dir, snapshot_every_s)
    except BaseException:
        worker.close()
        raise

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if snapshots is None:
            yield
            worker.close()
            return
        await snapshots.restore()
        periodic = asyncio.create_task(snapshots.run_periodic())
        try:
            yield
        finally:
            periodic.cancel()
            await snapshots.save()
            worker.close()

    app = FastAPI(title="prefixcache", lifespan=lifespan)
    app.state.runner = runner
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.snapshots = snapshots

    async def run_job(
        start: Callable[[], Generator[Any, None, Any]], deltas: bool = True
    ) -> AsyncIterator[tuple[str, Any]]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def sink(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))

        job = worker.submit(start, sink, deltas=deltas)
        try:
            while True:
                kind, value = await events.get()
                yield kind, value
                if kind != "delta":
                    return
        finally:
            job.cancel()

    def authenticate(request: Request) -> str | None:
        return keys.namespace_for(request.headers.get("authorization"))

    async def read_json(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (ValueError, RecursionError):
            raise BadRequest("the request body is not valid JSON") from None

    def check_model(name: str) -> None:
        if name != model_name:
            raise BadRequest(
                f"the model {name!r} does not exist; this server serves {model_name!r}", "model", 404, "model_not_found"
            )

    @app.exception_handler(Unauthorized)
    async def unauthorized(request: Request, error: Unauthorized) -> JSONResponse:
        body = error_body(str(error), param=None, code="invalid_api_key")
        return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        # The router's own 404 (no such path) and 405 (wrong method), in the error shape every OpenAI client parses.
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = f"{error.detail}: {request.method} {request.url.path}"
        body = error_body(message, kind=kind, code=str(error.detail).lower().replace(" ", "_"))
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest) -> JSONResponse:
        metrics.failed(request.url.path, error.status)
        return _error_response(error)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "pending_requests": worker.num_active}

    @app.get("/metrics")
    async def scrape() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authenticate(request)
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "prefixcache"}
        return {"object": "list", "data": [card]}

    async def _collect(events: Any, kind: str, value: Any, endpoint: str) -> ChatCompletion | Response:
        """Drain a job's events to its end: the finished completion, or the error response (counted in metrics)."""
        try:
            while kind == "delta":
                kind, value = await anext(events)
        finally:
            await events.aclose()
        if kind != "done":
            error = value if kind == "error" else RuntimeError("the server is shutting down")
            metrics.failed(endpoint, _status_of(error))
            return _error_response(error)
        metrics.observe(endpoint, value.usage)
        return value

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        namespace = authenticate(request)
        chat = parse_chat_request(await read_json(request))
        check_model(chat.model)
        request_id = "chatcmpl-" + uuid.uuid4().hex

        def start() -> Generator[str, None, ChatCompletion]:
            return chat_stream(
                runner,
                chat.messages,
                chat.tools,
                tool_choice=chat.tool_choice,
                stop=chat.stop,
                namespace=namespace,
                request_id=request_id,
                **chat.sampling,
            )

        events = run_job(start, deltas=chat.stream)
        kind, first = await anext(events)
        if not chat.stream or kind == "error":
            done = await _collect(events, kind, first, "/v1/chat/completions")
            if isinstance(done, Response):
                return done
            return JSONResponse(chat_response(request_id, model_name, done))

        async def chat_sse() -> AsyncIterator[str]:
            kind_, value = kind, first
            yield _sse(chat_chunk(request_id, model_name, {"role": "assistant", "content": ""}))
            while kind_ == "delta":
                yield _sse(chat_chunk(request_id, model_name, {"content": value}))
                kind_, value = await anext(events)
            if kind_ == "error":
                yield _sse(error_body(str(value), kind="server_error"))
            elif kind_ == "done":
                done: ChatCompletion = value
                metrics.observe("/v1/chat/completions", done.usage)
                if done.tool_calls:
                    calls = [{"index": i, **call} for i, call in enumerate(done.tool_calls)]
                    yield _sse(chat_chunk(request_id, model_name, {"tool_calls": calls}))
                usage = None if chat.include_usage else done.usage
                yield _sse(chat_chunk(request_id, model_name, {}, done.finish_reason, usage))
                if chat.include_usage:
                    yield _sse(chat_chunk(request_id, model_name, None, usage=done.usage))
            yield "data: [DONE]\n\n"

        return StreamingResponse(_closing(chat_sse(), events), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        namespace = authenticate(request)
        body = parse_completion_request(await read_json(request), runner.tokenizer.vocab_size)
        check_model(body.model)
        request_id = "cmpl-" + uuid.uuid4().hex

        def start() -> Generator[str, None, ChatCompletion]:
            ids = runner.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
            return completion_stream(
                runner, ids, stop=body.stop, namespace=namespace, request_id=request_id, **body.sampling
            )

        events = run_job(start, deltas=body.stream)
        kind, first = await anext(events)
        if not body.stream or kind == "error":
            done = await _collect(events, kind, first, "/v1/completions")
            if isinstance(done, Response):
                return done
            return JSONResponse(
                completion_response(request_id, model_name, done.content or "", done.finish_reason, done.usage)
            )

        async def completion_sse() -> AsyncIterator[str]:
            kind_, value = kind, first
            while kind_ == "delta":
                yield _sse(completion_response(request_id, model_name, value, None, None))
                kind_, value = await anext(events)
            if kind_ == "error":
                yield _sse(error_body(str(value), kind="server_error"))
            elif kind_ == "done":
                metrics.observe("/v1/completions", value.usage)
                usage = None if body.include_usage else value.usage
                yield _sse(completion_response(request_id, model_name, "", value.finish_reason, usage))
                if body.include_usage:
                    chunk = completion_response(request_id, model_name, "", None, value.usage)
                    chunk["choices"] = []
                    yield _sse(chunk)
            yield "data: [DONE]\n\n"

        return StreamingResponse(_closing(completion_sse(), events), media_type="text/event-stream")

    @app.post("/v1/cache/prefill")
    async def prefill(request: Request) -> Response:
        namespace = authenticate(request)
        body = parse_prefill_request(await read_json(request), runner.tokenizer.vocab_size)
        if body.model is not None:
            check_model(body.model)

        def start() -> Generator[int, None, Any]:
            if body.messages is not None:
                ids = runner.tokenizer.render_chat(body.messages, body.tools, add_generation_prompt=False)
            elif isinstance(body.prompt, str):
                ids = runner.tokenizer.encode(body.prompt)
            else:
                ids = body.prompt
            params = SamplingParams(max_new_tokens=0)
            return runner.stream(ids, params, namespace=namespace, priority=body.priority, retain_s=body.retain_s)

        async for kind, value in run_job(start, deltas=False):
            if kind == "error":
                metrics.failed("/v1/cache/prefill", _status_of(value))
                return _error_response(value)
            if kind == "done":
                metrics.observe("/v1/cache/prefill", value.usage)
                return JSONResponse({"object": "cache.prefill", "usage": usage_json(value.usage)})
        return _error_response(RuntimeError("the server is shutting down"))

    return app
