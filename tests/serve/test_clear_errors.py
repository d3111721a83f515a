"""Errors a client can understand: a tool schema nested too deep is a 400 in OpenAI's shape (a TemplateError
in-process), a non-ASCII API key from the keys file authenticates, and an upload cut off mid-body is one line at
INFO, not a traceback."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.chat.template import MAX_JSON_DEPTH, render_text
from prefixcache.errors import TemplateError
from prefixcache.serve import ApiKeys
from prefixcache.testing import ScriptedModel

MESSAGES = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> dict:
    schema: dict = {}
    inner = schema
    for _ in range(depth):
        inner["a"] = {}
        inner = inner["a"]
    return schema


def deep_tool(depth: int = 2000) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": nested(depth)}}


def runner() -> PrefixCachingRunner:
    return PrefixCachingRunner(ScriptedModel.from_texts(["Hello."]), cache_tokens=4096, block_size=16)


def send(app, method: str, path: str, body: object = None, headers: dict | None = None) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            if isinstance(body, bytes):
                return await http.request(method, path, content=body, headers=headers)
            return await http.request(method, path, json=body, headers=headers)

    return asyncio.run(main())


@pytest.mark.parametrize("depth", [960, 5000])
def test_a_tool_schema_nested_too_deep_is_a_template_error_in_process(depth: int) -> None:
    with pytest.raises(TemplateError, match=f"more than {MAX_JSON_DEPTH} levels"):
        render_text(MESSAGES, [deep_tool(depth)])


def test_tool_call_arguments_nested_too_deep_are_a_template_error() -> None:
    call = {"function": {"name": "f", "arguments": nested(2000)}}
    with pytest.raises(TemplateError, match="arguments nests"):
        render_text([*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}])


def test_a_schema_at_the_depth_limit_still_renders() -> None:
    assert "<tools>" in render_text(MESSAGES, [deep_tool(MAX_JSON_DEPTH - 3)])


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 50, 960])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/cache/prefill"])
def test_a_deeply_nested_tool_schema_is_a_400_in_openai_shape(make_app, path: str, depth: int) -> None:
    app = make_app(runner())
    # Written by hand: json.dumps cannot encode it at that depth inside the test's own stack.
    schema = '{"a":' * depth + "{}" + "}" * depth
    tool = '{"type": "function", "function": {"name": "f", "parameters": ' + schema + "}}"
    body = '{"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "tools": [' + tool + "]}"
    response = send(app, "POST", path, body.encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "deep" in error["message"]
    if depth < 900:  # deeper still, the JSON parser itself gives up first (how deep depends on the stack)
        assert error["param"] == "tools[0]" and f"more than {MAX_JSON_DEPTH} levels" in error["message"]
    ok = send(app, "POST", "/v1/chat/completions", {"model": "scripted", "messages": MESSAGES})
    assert ok.status_code == 200


def test_a_non_ascii_api_key_from_the_keys_file_authenticates(make_app, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("clé-à-ключ tenant\n", encoding="utf-8")
    app = make_app(runner(), api_keys=ApiKeys.from_file(keys))
    good = {"Authorization": "Bearer clé-à-ключ".encode()}
    assert send(app, "GET", "/v1/models", headers=good).status_code == 200
    bad = {"Authorization": "Bearer clé-à-ключX".encode()}
    assert send(app, "GET", "/v1/models", headers=bad).status_code == 401
    latin1 = {"Authorization": "Bearer clé-à".encode("latin-1")}  # other bytes for some of the same text
    assert send(app, "GET", "/v1/models", headers=latin1).status_code == 401


def test_an_upload_cut_off_mid_body_is_one_line_at_info(make_app, caplog) -> None:
    app = make_app(runner())
    messages = iter(
        [
            {"type": "http.request", "body": b'{"model": "scripted", "mess', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )
    sent: list[dict] = []

    async def receive() -> dict:
        return next(messages, {"type": "http.disconnect"})

    async def record(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100000")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    with caplog.at_level(logging.DEBUG):
        asyncio.run(app(scope, receive, record))  # raises nothing: no 500 and no traceback for the server to log
    assert sent[0]["status"] == 499
    records = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert [(r.levelno, r.exc_info) for r in records] == [(logging.INFO, None)]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_repetition_penalty_beyond_int64_is_answered_not_a_500(make_app, path: str) -> None:
    # The schema accepts any number; an int too big for torch once failed on the engine thread (a 500).
    app = make_app(runner())
    body = {"model": "scripted", "max_tokens": 2, "messages": MESSAGES, "prompt": "hi"}
    body.pop("prompt" if path.endswith("chat/completions") else "messages")
    assert send(app, "POST", path, {**body, "repetition_penalty": 2**70}).status_code == 200
    refused = send(app, "POST", path, {**body, "repetition_penalty": 10**400})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "repetition_penalty"
