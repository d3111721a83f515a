"""Concurrent requests through the app run batched on its engine and answer exactly what each request answers alone:
the same text, tool calls, finish reason and prompt tokens as ``runner.chat`` serially (greedy), and the cache is
quiescent afterwards."""

from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCachingRunner
from prefixcache.models.llama import build_model
from prefixcache.testing import ScriptedModel, assert_quiescent

CALL = '<tool_call>\n{"name": "search", "arguments": {"q": "kv cache"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
SYSTEM = {"role": "system", "content": "You search flights for the user and answer in one line. " * 6}
SCRIPTS = [
    "Thought: search it\nAction: search\nObservation: found",
    "Searching.\n" + CALL,
    "It is a radix tree. Observation: none",
    "plain answer without any stop",
]


def conversation(turns: int, question: str) -> list[dict]:
    """``turns`` earlier exchanges, then ``question``: the scripted model answers with ``SCRIPTS[turns]``."""
    earlier = []
    for k in range(turns):
        earlier += [{"role": "user", "content": f"q{k}"}, {"role": "assistant", "content": "ok"}]
    return [SYSTEM, *earlier, {"role": "user", "content": question}]


async def streamed(client, options: dict) -> dict:
    """One streamed chat completion, reassembled from its chunks."""
    stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **options)
    content, calls, finish, usage = [], [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            calls += [(c.function.name, json.loads(c.function.arguments)) for c in choice.delta.tool_calls or ()]
            finish = choice.finish_reason or finish
    return {"text": "".join(content), "calls": calls, "finish": finish, "prompt_tokens": usage.prompt_tokens}


def serial(runner: PrefixCachingRunner, options: dict) -> dict:
    options = {k: v for k, v in options.items() if k != "model"}
    messages, tools = options.pop("messages"), options.pop("tools", None)
    options["max_new_tokens"] = options.pop("max_tokens")
    result = runner.chat(messages, tools, **options)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.tool_calls]
    return {
        "text": result.text,
        "calls": calls,
        "finish": result.finish_reason,
        "prompt_tokens": result.usage.prompt_tokens,
    }


def check_concurrent_equals_serial(make_app, asgi_client, make_runner, requests: list[dict]) -> None:
    expected = [serial(make_runner(), request) for request in requests]  # each alone, on a fresh cache
    runner = make_runner()
    app = make_app(runner)

    async def main() -> list[dict]:
        client = asgi_client(app)
        return await asyncio.gather(*(streamed(client, request) for request in requests))

    assert asyncio.run(main()) == expected
    assert app.state.engine.wait_idle(30)
    assert_quiescent(runner.cache)
    runner.cache.check_invariants()
    assert runner.cache.stats().locked_tokens == 0
    app.state.engine.close()


def scripted_runner() -> PrefixCachingRunner:
    return PrefixCachingRunner(ScriptedModel.from_texts(SCRIPTS), cache_tokens=16384, block_size=4)


def test_concurrent_streams_with_shared_prefixes_stops_and_tool_calls_equal_serial(make_app, asgi_client) -> None:
    requests = []
    for i in range(12):
        turns = i % len(SCRIPTS)
        request = {"model": "scripted", "messages": conversation(turns, f"question {i // 4}"), "max_tokens": 100}
        request |= {"tools": TOOLS} if turns == 1 or i % 3 == 0 else {}
        request |= {"stop": ["Observation:", "tree"]} if i % 5 else {}
        requests.append(request)
    expected = [serial(scripted_runner(), r) for r in requests]
    # The set covers what the engine must end or parse itself: stop strings, tool calls, and plain ends.
    assert any(e["calls"] for e in expected) and any("Observation" not in e["text"] for e in expected)
    assert any(e["finish"] == "stop" and e["text"].endswith("\nAction: search\n") for e in expected)
    check_concurrent_equals_serial(make_app, asgi_client, scripted_runner, requests)


def test_concurrent_streams_on_the_tiny_model_equal_serial(make_app, asgi_client) -> None:
    # Real numerics: greedy tokens of batched forwards equal those of one request at a time; each stop string is a
    # piece of that request's own greedy answer, so it ends the request mid-answer.
    model = build_model("tiny", device="cpu")

    def make_runner() -> PrefixCachingRunner:
        return PrefixCachingRunner(model, cache_tokens=8192, block_size=8)

    requests = []
    for i in range(8):
        messages = [SYSTEM, {"role": "user", "content": f"trip {i % 3}"}]
        request = {"model": "scripted", "messages": messages, "max_tokens": 24}
        if i % 3:
            answer = make_runner().chat(messages, max_new_tokens=24).text
            request["stop"] = answer[6 + i : 8 + i]
        requests.append(request)
    expected = [serial(make_runner(), r) for r in requests]
    assert any(e["finish"] == "stop" and len(e["text"]) >= 6 for e in expected)
    check_concurrent_equals_serial(make_app, asgi_client, make_runner, requests)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, len(SCRIPTS) - 1), st.sampled_from("ab"), st.booleans(), st.booleans()),
        min_size=1,
        max_size=8,
    ),
    max_tokens=st.integers(1, 60),
)
def test_any_arrival_set_answers_as_serial(make_app, asgi_client, arrivals, max_tokens: int) -> None:
    requests = [
        {"model": "scripted", "messages": conversation(turns, question), "max_tokens": max_tokens}
        | ({"tools": TOOLS} if with_tools else {})
        | ({"stop": "Observation:"} if with_stop else {})
        for turns, question, with_tools, with_stop in arrivals
    ]
    check_concurrent_equals_serial(make_app, asgi_client, scripted_runner, requests)
