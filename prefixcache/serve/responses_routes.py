"""The Responses API routes: ``POST /v1/responses`` (plain and streamed), ``GET`` and ``DELETE /v1/responses/{id}``.

They run on the app's own machinery, handed in by :func:`~prefixcache.serve.app.create_app` as :class:`AppHooks`
(authentication, the model check, the engine's jobs and how their ends are answered and counted), so a response is
submitted, cancelled when its client leaves, and metered exactly as a chat completion is; the wire format is
:mod:`prefixcache.serve.responses`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from prefixcache.engine.chat import ChatCompletion, prepare_chat, submit_chat
from prefixcache.serve.protocol import BadRequest, error_body
from prefixcache.serve.responses import (
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
    assistant_message,
    conversation_after,
    new_id,
    output_items,
    parse_responses_request,
    response_body,
)

__all__ = ["AppHooks", "add_response_routes"]

ENDPOINT = "/v1/responses"


@dataclass(frozen=True, slots=True)
class AppHooks:
    """What the routes use of the app (see :func:`~prefixcache.serve.app.create_app` for each one's contract)."""

    route: Callable[[str, str], Callable[[Callable[[Request], Any]], Any]]
    authenticate: Callable[[Request], str | None]
    read_json: Callable[[Request], Awaitable[Any]]
    off_loop: Callable[..., Awaitable[Any]]
    tokenizing: Callable[..., Awaitable[Any]]
    check_model: Callable[[str], None]
    run_job: Callable[[Any, Request], AsyncIterator[tuple[str, Any]]]
    finish_job: Callable[[Any, Request], Awaitable[tuple[str, Any]]]
    outcome: Callable[[str, Any, str], ChatCompletion | Response]
    unless_gone: Callable[[Request, Awaitable[Any]], Awaitable[tuple[bool, Any]]]


def _json(body: Any, status: int = 200) -> Response:
    # A lone surrogate has no UTF-8 form: written as its JSON escape, as the app's own responses write it.
    data = json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")
    return Response(data, status, media_type="application/json")


def _not_found(response_id: str) -> Response:
    message = f"no stored response with id {response_id!r}"
    return _json(error_body(message, kind="not_found_error", param="response_id", code="response_not_found"), 404)


def _error_message(failure: Response) -> str:
    return json.loads(bytes(failure.body))["error"]["message"]


def add_response_routes(hooks: AppHooks, runner: Any, engine: Any, store: ResponseStore) -> None:
    """Add the routes to the app ``hooks.route`` adds to; responses run on ``engine`` with ``runner``'s tokenizer and
    are kept in ``store`` (unless the request says ``store: false``; one the store refuses is answered with ``store``
    false: :mod:`prefixcache.serve.response_store`)."""
    route = hooks.route

    def keep(
        request: ResponsesRequest,
        namespace: str | None,
        body: dict[str, Any],
        messages: list[dict[str, Any]],
        done: ChatCompletion,
    ) -> None:
        # The conversation through this answer, for a next turn's previous_response_id; the store keeps each of its
        # messages once per namespace (by its JSON), so a chain of n turns keeps O(n) references per response.
        # One the store cannot keep (too large) says so: store false, as OpenAI's field for "retrievable later".
        if request.store:
            conversation = (*messages, assistant_message(done))
            if not store.put(body["id"], StoredResponse(namespace, body, conversation)):
                body["store"] = False

    @route(ENDPOINT, "POST")
    async def create(request: Request) -> Response:
        namespace = hooks.authenticate(request)
        body = await hooks.off_loop(request, parse_responses_request, await hooks.read_json(request))
        hooks.check_model(body.model)
        prior: tuple[dict[str, Any], ...] = ()
        if body.previous_response_id is not None:
            stored = store.get(body.previous_response_id, namespace)
            if stored is None:
                message = f"previous response with id {body.previous_response_id!r} not found"
                raise BadRequest(message, "previous_response_id", 404, "previous_response_not_found")
            prior = stored.messages
        conversation = await hooks.off_loop(request, conversation_after, prior, body.messages)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        response_id, created_at = new_id("resp"), int(time.time())

        def start(on_delta: Callable[[Any], None] | None) -> Any:
            prepared = prepare_chat(
                runner.tokenizer,
                system + conversation,
                body.tools,
                tool_choice=body.tool_choice,
                request_id=response_id,
                template_kwargs=body.template_kwargs,
                response_format=body.response_format,
                **body.sampling,
            )
            return submit_chat(engine, prepared, namespace=namespace, request_id=response_id, on_delta=on_delta)

        if not body.stream:
            done = hooks.outcome(*await hooks.finish_job(start, request), ENDPOINT)
            if isinstance(done, Response):
                return done
            answer = response_body(body, response_id, created_at, output_items(done, new_id("msg")), done)
            keep(body, namespace, answer, conversation, done)
            return _json(answer)

        events = hooks.run_job(start, request)
        answered, head = await hooks.unless_gone(request, anext(events))  # a queued request waits here
        if not answered:
            return Response(status_code=499)
        if head[0] == "error":
            await events.aclose()
            return hooks.outcome(*head, ENDPOINT)
        stream = ResponseEvents(body, response_id, created_at)

        async def sse() -> AsyncIterator[bytes]:
            try:
                for line in stream.start():
                    yield line.encode("utf-8", "backslashreplace")
                kind, value = head
                while kind == "delta":
                    for line in stream.text(value):
                        yield line.encode("utf-8", "backslashreplace")
                    kind, value = await anext(events)
                done = hooks.outcome(kind, value, ENDPOINT)
                if isinstance(done, Response):
                    yield stream.failed(_error_message(done)).encode("utf-8", "backslashreplace")
                    return
                answer = stream.final_body(done)
                keep(body, namespace, answer, conversation, done)
                for line in stream.finish(done, answer):
                    yield line.encode("utf-8", "backslashreplace")
            finally:
                await events.aclose()  # however the stream ends: cancels the request if it still runs

        return StreamingResponse(sse(), media_type="text/event-stream")

    # Answered here, not raised to the app's handler that counts failures by path: these paths hold any id.
    @route(ENDPOINT + "/{response_id}", "GET")
    async def retrieve(request: Request) -> Response:
        namespace = hooks.authenticate(request)
        response_id = request.path_params["response_id"]
        stored = store.get(response_id, namespace)
        return _not_found(response_id) if stored is None else _json(stored.body)

    @route(ENDPOINT + "/{response_id}", "DELETE")
    async def delete(request: Request) -> Response:
        namespace = hooks.authenticate(request)
        response_id = request.path_params["response_id"]
        if not store.delete(response_id, namespace):
            return _not_found(response_id)
        return _json({"id": response_id, "object": "response", "deleted": True})
