"""/openapi.json publishes the request schemas the handlers validate with (prefixcache.serve.schemas)."""

from __future__ import annotations

import asyncio

import httpx
import jsonschema
import pytest
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from prefixcache import PrefixCachingRunner
from prefixcache.serve import create_app
from prefixcache.serve.schemas import BODY_MODELS, BodyError, ChatCompletionBody, CompletionBody, validate_body

MESSAGES = [{"role": "user", "content": "Hi"}]

CHAT_BODIES = [
    ({"model": "m", "messages": MESSAGES}, True),
    ({"model": "m", "messages": MESSAGES, "temperature": 0.5, "top_k": 5, "logit_bias": {"3": -1}}, True),
    ({"model": "m", "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, True),
    ({"model": "m", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}, True),
    ({"model": "m", "messages": MESSAGES, "reasoning_effort": "low", "verbosity": "high"}, True),
    ({"model": "m", "messages": MESSAGES, "colour": "red"}, False),
    ({"model": "m", "messages": []}, False),
    ({"messages": MESSAGES}, False),
    ({"model": "", "messages": MESSAGES}, False),
    ({"model": "m", "messages": MESSAGES, "temperature": 2.5}, False),
    ({"model": "m", "messages": MESSAGES, "temperature": "0.5"}, False),
    ({"model": "m", "messages": MESSAGES, "n": 17}, False),
    ({"model": "m", "messages": MESSAGES, "stream": "yes"}, False),
    ({"model": "m", "messages": MESSAGES, "stream_options": {"include_usage": True, "x": 1}}, False),
    ({"model": "m", "messages": MESSAGES, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, False),
    ({"model": "m", "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": ""}}]}, False),
    ({"model": "m", "messages": MESSAGES, "verbosity": "loud"}, False),
    ({"model": "m", "messages": MESSAGES, "seed": 2**63}, False),
]
COMPLETION_BODIES = [
    ({"model": "m", "prompt": "Once"}, True),
    ({"model": "m", "prompt": [1, 2, 3], "echo": True, "logprobs": 2, "max_tokens": 0}, True),
    ({"model": "m", "prompt": ["Once"]}, True),
    ({"model": "m", "prompt": 7}, False),
    ({"model": "m", "prompt": "x", "logprobs": 21}, False),
    ({"model": "m", "prompt": "x", "suffix": "y"}, False),
]


@pytest.fixture(scope="module")
def document(tiny_model) -> dict:
    app = create_app(PrefixCachingRunner(tiny_model, cache_tokens=256), model_name="tiny")

    async def fetch() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
            return await http.get("/openapi.json")

    try:
        response = asyncio.run(fetch())
    finally:
        app.state.engine.close()
    assert response.status_code == 200
    return response.json()


def _validator(document: dict, name: str) -> jsonschema.Draft202012Validator:
    registry = Registry().with_resource("urn:openapi", DRAFT202012.create_resource(document))
    schema = {"$ref": f"urn:openapi#/components/schemas/{name}"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


def test_the_document_names_every_post_route_with_its_body_schema(document: dict) -> None:
    assert document["openapi"] == "3.1.0"
    for path, models in BODY_MODELS.items():
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        refs = [{"$ref": f"#/components/schemas/{model.__name__}"} for model in models]
        assert body == (refs[0] if len(refs) == 1 else {"anyOf": refs})
        for model in models:
            jsonschema.Draft202012Validator.check_schema(document["components"]["schemas"][model.__name__])
    assert set(BODY_MODELS) >= {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"}
    chat = document["components"]["schemas"]["ChatCompletionBody"]
    assert set(chat["required"]) == {"model", "messages"}
    assert chat["additionalProperties"] is False
    assert "get" in document["paths"]["/health"]


@pytest.mark.parametrize(
    ("model", "body", "valid"),
    [(ChatCompletionBody, b, v) for b, v in CHAT_BODIES] + [(CompletionBody, b, v) for b, v in COMPLETION_BODIES],
)
def test_the_published_schema_and_the_server_accept_the_same_bodies(document: dict, model, body, valid) -> None:
    published = _validator(document, model.__name__).is_valid(body)
    try:
        validate_body(model, body)
        served = True
    except BodyError:
        served = False
    assert (published, served) == (valid, valid)


def test_every_route_of_the_app_is_in_the_document(document: dict, tiny_model) -> None:
    # DELETE /v1/responses/{response_id} was once served but not published.
    app = create_app(PrefixCachingRunner(tiny_model, cache_tokens=256), model_name="tiny")
    app.state.engine.close()
    served = {
        (route.path.replace(":path}", "}"), method.lower())
        for route in app.routes
        for method in getattr(route, "methods", None) or ()
        if method != "HEAD" and route.path != "/openapi.json"
    }
    published = {(path, method) for path, operations in document["paths"].items() for method in operations}
    assert served == published
