"""The Responses API routes: ``POST /v1/responses`` (plain and streamed), ``GET`` and ``DELETE /v1/responses/{id}``.

They run on the machinery every model route shares (:mod:`prefixcache.serve.dispatch`: the engine's jobs and how
their ends are answered and counted), so a response is submitted, cancelled when its client leaves, and metered
exactly as a chat completion is; the wire format is :mod:`prefixcache.serve.responses`.  Each API key's namespace
keeps its own responses (``app.state.responses``: :mod:`prefixcache.serve.response_store`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from prefixcache.engine.chat import prepare_chat, submit_chat
from prefixcache.engine.chat_decoder import ChatCompletion
from prefixcache.serve.dispatch import finish_job, outcome, run_job
from prefixcache.serve.jobs import gone, unless_gone
from prefixcache.serve.protocol import BadRequest, error_body
from prefixcache.serve.replies import json_response
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
from prefixcache.serve.state import server_state

__all__ = ["add_response_routes", "create_response", "delete_response", "retrieve_response"]

ENDPOINT = "/v1/responses"


def _not_found(response_id: str) -> Response:
    message = f"no stored response with id {response_id!r}"
    body = error_body(message, kind="not_found_error", param="response_id", code="response_not_found")
    return json_response(body, 404)


def _error_message(failure: Response) -> str:
    return json.loads(bytes(failure.body))["error"]["message"]


def _keep(
    store: ResponseStore,
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


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``: a response to ``input`` (after ``previous_response_id``'s conversation, a 404 when
    that one is not stored in the caller's namespace), as one JSON body or Responses SSE events; kept in the store
    unless the request says ``store: false`` (one the store refuses is answered with ``store`` false)."""
    state = server_state(request)
    store = state.responses
    namespace = state.authenticate(request)
    body = await state.work.call(request, parse_responses_request, await state.work.read_json(request))
    state.check_model(body.model)
    prior: tuple[dict[str, Any], ...] = ()
    if body.previous_response_id is not None:
        stored = store.get(body.previous_response_id, namespace)
        if stored is None:
            message = f"previous response with id {body.previous_response_id!r} not found"
            raise BadRequest(message, "previous_response_id", 404, "previous_response_not_found")
        prior = stored.messages
    conversation = await state.work.call(request, conversation_after, prior, body.messages)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    response_id, created_at = new_id("resp"), int(time.time())

    def start(on_delta: Callable[[Any], None] | None) -> Any:
        prepared = prepare_chat(
            state.tokenizer,
            system + conversation,
            body.tools,
            tool_choice=body.tool_choice,
            request_id=response_id,
            template_kwargs=body.template_kwargs,
            response_format=body.response_format,
            **body.sampling,
        )
        return submit_chat(state.engine, prepared, namespace=namespace, request_id=response_id, on_delta=on_delta)

    if not body.stream:
        done = outcome(state, *await finish_job(state, start, request), ENDPOINT)
        if isinstance(done, Response):
            return done
        answer = response_body(body, response_id, created_at, output_items(done, new_id("msg")), done)
        _keep(store, body, namespace, answer, conversation, done)
        return json_response(answer)

    events = run_job(state, start, request)
    answered, head = await unless_gone(request, anext(events))  # a queued request waits here
    if not answered:
        return gone()
    if head[0] == "error":
        await events.aclose()
        return outcome(state, *head, ENDPOINT)
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
            done = outcome(state, kind, value, ENDPOINT)
            if isinstance(done, Response):
                yield stream.failed(_error_message(done)).encode("utf-8", "backslashreplace")
                return
            answer = stream.final_body(done)
            _keep(store, body, namespace, answer, conversation, done)
            for line in stream.finish(done, answer):
                yield line.encode("utf-8", "backslashreplace")
        finally:
            await events.aclose()  # however the stream ends: cancels the request if it still runs

    return StreamingResponse(sse(), media_type="text/event-stream")


# The two below answer a missing id here, not raised to the app's handler that counts failures by path: these paths
# hold any id.
async def retrieve_response(request: Request) -> Response:
    """``GET /v1/responses/{response_id}``: a stored response of the caller's namespace, else 404."""
    state = server_state(request)
    namespace = state.authenticate(request)
    response_id = request.path_params["response_id"]
    stored = state.responses.get(response_id, namespace)
    return _not_found(response_id) if stored is None else json_response(stored.body)


async def delete_response(request: Request) -> Response:
    """``DELETE /v1/responses/{response_id}``: a stored response of the caller's namespace deleted, else 404."""
    state = server_state(request)
    namespace = state.authenticate(request)
    response_id = request.path_params["response_id"]
    if not state.responses.delete(response_id, namespace):
        return _not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def add_response_routes(app: FastAPI) -> None:
    """Add the three Responses API routes to ``app``."""
    app.add_route(ENDPOINT, create_response, methods=["POST"])
    app.add_route(ENDPOINT + "/{response_id}", retrieve_response, methods=["GET"])
    app.add_route(ENDPOINT + "/{response_id}", delete_response, methods=["DELETE"])
