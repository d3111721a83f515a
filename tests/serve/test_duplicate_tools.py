"""Two tools with one function name are a 400 naming the later one's field, on every route that takes tools: the
model's call could name either, so the server refuses the list as OpenAI does.  A real server on 127.0.0.1."""

from __future__ import annotations

import httpx
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.serve import start_background
from prefixcache.testing import ScriptedModel, snapshot

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat_tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def responses_tool(name: str) -> dict:
    return {"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}}


CHAT_TOOLS = [chat_tool("weather"), chat_tool("time"), chat_tool("weather")]
ROUTES = {
    "/v1/chat/completions": ({"model": "scripted", "messages": MESSAGES, "tools": CHAT_TOOLS}, "function.name"),
    "/v1/cache/prefill": ({"model": "scripted", "messages": MESSAGES, "tools": CHAT_TOOLS}, "function.name"),
    "/tokenize": ({"model": "scripted", "messages": MESSAGES, "tools": CHAT_TOOLS}, "function.name"),
    "/v1/responses": (
        {
            "model": "scripted",
            "input": "What is the weather in Paris?",
            "tools": [responses_tool("weather"), responses_tool("time"), responses_tool("weather")],
        },
        "name",
    ),
}


@pytest.mark.parametrize("route", ROUTES)
def test_a_tool_name_given_twice_is_a_400_naming_the_later_tool(make_app, route: str) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["Sunny."]), cache_tokens=8192)
    before = snapshot(runner.cache, [runner.namespace_key(None)])
    body, field = ROUTES[route]
    with start_background(make_app(runner), "127.0.0.1", 0) as server:
        refused = httpx.post(server.url + route, json=body, timeout=30)
        after_refusal = snapshot(runner.cache, [runner.namespace_key(None)])
        distinct = {**body, "tools": body["tools"][:2]}
        accepted = httpx.post(server.url + route, json=distinct, timeout=30)

    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", f"tools[2].{field}")
    assert error["message"] == (
        f"tools[2].{field} 'weather' is already the name of tools[0]; each tool needs its own function name"
    )
    assert after_refusal == before
    assert accepted.status_code == 200, accepted.text
