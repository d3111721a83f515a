"""The server's ``/openapi.json``: an OpenAPI 3.1 document whose request bodies are the pydantic models of
:mod:`prefixcache.serve.schemas`, the same ones the handlers validate with.

The routes are plain Starlette routes (each reads its own body, off the event loop when large), so FastAPI has no
typed signature to derive a document from; this module writes the paths from :data:`BODY_MODELS` and the GET routes
instead.  Built once per app, on the first request for it.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from prefixcache.serve.schemas import BODY_MODELS

__all__ = ["openapi_document"]

_GET_ROUTES = {
    "/health": "Liveness: the model served and the requests pending",
    "/metrics": "Prometheus metrics",
    "/v1/models": "The model served (OpenAI's list shape)",
    "/v1/models/{model_id}": "One model by id",
    "/tokenizer_info": "The tokenizer's class, vocabulary size and special tokens (vLLM's)",
    "/v1/responses/{response_id}": "A stored response",
}
_DELETE_ROUTES = {"/v1/responses/{response_id}": "Delete a stored response"}
_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}


def _parameters(path: str) -> list[dict[str, Any]]:
    names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in names]


def openapi_document(title: str, version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the server: every POST body as a component schema (``$ref`` to
    ``#/components/schemas/<Model>``), 400/401/413 in OpenAI's error shape.  O(size of the schemas)."""
    keyed = [(model, "validation") for models in BODY_MODELS.values() for model in models]
    refs, definitions = models_json_schema(keyed, ref_template="#/components/schemas/{model}")
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    errors = {
        status: {"description": what, "content": error}
        for status, what in (("400", "a bad request"), ("401", "no or a wrong API key"), ("413", "body too large"))
    }
    paths: dict[str, Any] = {}
    for path, models in BODY_MODELS.items():
        bodies = [refs[(model, "validation")] for model in models]
        paths[path] = {
            "post": {
                "summary": (models[0].__doc__ or "").strip().split("\n")[0],
                "operationId": path.strip("/").replace("/", "_"),
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": bodies[0] if len(bodies) == 1 else {"anyOf": bodies}}},
                },
                "responses": {"200": {"description": "OpenAI's response object, or an SSE stream"}, **errors},
            }
        }
    for path, summary in _GET_ROUTES.items():
        operation = {"summary": summary, "responses": {"200": {"description": summary}}}
        if _parameters(path):
            operation["parameters"] = _parameters(path)
        paths.setdefault(path, {})["get"] = operation
    for path, summary in _DELETE_ROUTES.items():
        operation = {"summary": summary, "responses": {"200": {"description": "the id, deleted: true"}}}
        paths.setdefault(path, {})["delete"] = {**operation, "parameters": _parameters(path)}
    schemas = {**definitions.get("$defs", {}), "Error": _ERROR}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": schemas},
    }
