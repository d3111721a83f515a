"""The Responses API (``/v1/responses``) through the real ``openai`` client, in-process and over a socket."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.serve import ApiKeys, create_app, start_background
from prefixcache.serve.responses import ResponseStore, StoredResponse, conversation_after
from prefixcache.testing import ScriptedModel, assert_quiescent, snapshot

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 18 degrees in Paris."
INSTRUCTIONS = "You are a weather assistant. Answer briefly and use the tools when asked about weather. " * 8
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def scripted(*texts: str) -> PrefixCachingRunner:
    return PrefixCachingRunner(ScriptedModel.from_texts(texts), cache_tokens=16384)


def run(coroutine):
    return asyncio.run(coroutine)


def cached(response) -> int:
    return response.usage.input_tokens_details.cached_tokens


def test_plain_text_answer_has_openai_shape_and_usage(make_app, asgi_client) -> None:
    app = make_app(scripted("Sunny, 18 degrees."))

    async def main():
        return await asgi_client(app).responses.create(model="scripted", input="Weather in Paris?")

    response = run(main())
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed" and response.incomplete_details is None
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text"
    assert response.output_text == "Sunny, 18 degrees."
    usage = response.usage
    assert usage.output_tokens == len("Sunny, 18 degrees.") + 1  # the bytes and the end token
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.tool_choice == "auto" and response.tools == [] and response.parallel_tool_calls
    assert_quiescent(app.state.runner.cache)


def test_instructions_are_a_first_system_message(make_app, asgi_client) -> None:
    runner = scripted("Sunny.")
    app = make_app(runner)
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Weather?"}]
    expected = len(runner.tokenizer.render_chat(messages, None, add_generation_prompt=True))

    async def main():
        client = asgi_client(app)
        first = await client.responses.create(model="scripted", instructions=INSTRUCTIONS, input="Weather?")
        # The same prompt given as a developer item renders to the same tokens: all but the last are cached.
        items = [{"role": "developer", "content": INSTRUCTIONS}, {"role": "user", "content": "Weather?"}]
        second = await client.responses.create(model="scripted", input=items)
        return first, second

    first, second = run(main())
    assert first.instructions == INSTRUCTIONS
    assert first.usage.input_tokens == expected == second.usage.input_tokens
    assert cached(second) == expected - 1


def test_max_output_tokens_makes_an_incomplete_response(make_app, asgi_client) -> None:
    app = make_app(scripted("Sunny, 18 degrees, light wind."))

    async def main():
        return await asgi_client(app).responses.create(model="scripted", input="Weather?", max_output_tokens=5)

    response = run(main())
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.output_text == "Sunny" and response.usage.output_tokens == 5


TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
TEXT_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_streamed_events_come_in_openai_order_and_add_up_to_the_answer(make_app, asgi_client) -> None:
    app = make_app(scripted("Sunny, 18 degrees."))

    async def main():
        client = asgi_client(app)
        stream = await client.responses.create(model="scripted", input="Weather?", stream=True)
        events = [event async for event in stream]
        async with client.responses.stream(model="scripted", input="Weather?") as helper:
            helped = [event async for event in helper]
            final = await helper.get_final_response()
        return events, helped, final

    events, helped, final = run(main())
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert kinds == TEXT_EVENTS + ["response.output_text.delta"] * len(deltas) + TEXT_DONE + ["response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    completed = events[-1].response
    assert "".join(deltas) == "Sunny, 18 degrees." == completed.output_text
    assert events[-4].text == completed.output_text
    assert len({event.response.id for event in events if hasattr(event, "response")}) == 1
    assert completed.output[0].id == events[2].item.id
    assert completed.usage.output_tokens == len("Sunny, 18 degrees.") + 1
    assert [event.type for event in helped] == kinds
    assert final.output_text == "Sunny, 18 degrees." and cached(final) > 0
    assert_quiescent(app.state.runner.cache)


def test_function_call_round_trip_with_function_call_output(make_app, asgi_client) -> None:
    app = make_app(scripted(CALL, ANSWER))

    async def main():
        client = asgi_client(app)
        first = await client.responses.create(
            model="scripted", instructions=INSTRUCTIONS, input="Weather in Paris?", tools=TOOLS
        )
        [call] = first.output
        # Resent item by item, as the Agents SDK and LangChain do: the input, the call, its output.
        items = [
            {"role": "user", "content": "Weather in Paris?"},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'},
        ]
        second = await client.responses.create(model="scripted", instructions=INSTRUCTIONS, input=items, tools=TOOLS)
        return first, second

    first, second = run(main())
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert first.status == "completed" and first.output_text == ""
    assert second.output_text == ANSWER
    # The call re-renders to the tokens the model generated: the whole first turn is cached.
    assert cached(second) >= first.usage.input_tokens + first.usage.output_tokens - 1
    assert_quiescent(app.state.runner.cache)


def test_streamed_function_call_has_argument_events(make_app, asgi_client) -> None:
    app = make_app(scripted(CALL))

    async def main():
        stream = await asgi_client(app).responses.create(model="scripted", input="Paris?", tools=TOOLS, stream=True)
        return [event async for event in stream]

    events = run(main())
    assert [event.type for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert json.loads(events[4].arguments) == {"city": "Paris"} == json.loads(events[3].delta)
    [call] = events[-1].response.output
    assert call.id == events[2].item.id == events[5].item.id and call.name == "get_weather"


def test_previous_response_id_continues_the_conversation_and_hits_the_cache(make_app, asgi_client) -> None:
    app = make_app(scripted(CALL, ANSWER, "You are welcome."))

    async def main():
        client = asgi_client(app)
        first = await client.responses.create(
            model="scripted", instructions=INSTRUCTIONS, input="Weather in Paris?", tools=TOOLS
        )
        output = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": '{"temp_c": 18}'}
        second = await client.responses.create(
            model="scripted", instructions=INSTRUCTIONS, input=[output], tools=TOOLS, previous_response_id=first.id
        )
        third = await client.responses.create(
            model="scripted", instructions=INSTRUCTIONS, input="Thanks!", tools=TOOLS, previous_response_id=second.id
        )
        fetched = await client.responses.retrieve(second.id)
        return first, second, third, fetched

    first, second, third, fetched = run(main())
    assert second.output_text == ANSWER and third.output_text == "You are welcome."
    assert second.previous_response_id == first.id
    assert cached(second) >= first.usage.input_tokens + first.usage.output_tokens - 1
    assert cached(third) >= second.usage.input_tokens + second.usage.output_tokens - 1
    assert cached(first) < cached(second) < cached(third)
    assert fetched.id == second.id and fetched.output_text == ANSWER
    assert_quiescent(app.state.runner.cache)


def test_unknown_or_unstored_previous_response_is_not_found(make_app, asgi_client) -> None:
    app = make_app(scripted("Sunny."))

    async def main():
        client = asgi_client(app)
        unstored = await client.responses.create(model="scripted", input="Hi", store=False)
        for previous in ("resp_nope", unstored.id):
            with pytest.raises(openai.NotFoundError) as error:
                await client.responses.create(model="scripted", input="Hi", previous_response_id=previous)
            assert error.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)

    run(main())
    assert len(app.state.responses) == 0


def test_deleted_responses_are_gone(make_app, asgi_client) -> None:
    app = make_app(scripted("Sunny."))

    async def main():
        client = asgi_client(app)
        response = await client.responses.create(model="scripted", input="Hi")
        await client.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(response.id)

    run(main())


REFUSED = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 1}}}, "text.format"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": ""}, "input"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"stream": "yes"}, "stream"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"conversation": "conv_1"}, "conversation"),
]


def test_bad_or_unsupported_fields_are_400s_naming_the_field_and_touch_nothing(make_app) -> None:
    runner = scripted("Sunny.")
    app = make_app(runner)
    before = snapshot(runner.cache, [runner.namespace_key(None)])

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            for extra, param in REFUSED:
                answer = await http.post("/v1/responses", json={"model": "scripted", "input": "Hi", **extra})
                assert answer.status_code == 400, (extra, answer.text)
                error = answer.json()["error"]
                assert (error["type"], error["param"]) == ("invalid_request_error", param), extra

    run(main())
    assert snapshot(runner.cache, [runner.namespace_key(None)]) == before
    assert len(app.state.responses) == 0
    assert_quiescent(runner.cache)


def test_the_store_keeps_the_last_n_responses_per_namespace() -> None:
    store = ResponseStore(max_responses=2, namespaces={"team", "other"})
    for name in ("a", "b", "c"):
        store.put(name, StoredResponse("team", {"id": name}, ()))
    assert store.get("a", "team") is None and len(store) == 2
    assert store.get("b", "other") is None
    assert store.get("b", "team").body == {"id": "b"}
    store.put("d", StoredResponse("team", {"id": "d"}, ()))  # "c" was used least recently
    assert store.get("c", "team") is None and store.get("b", "team") is not None


def test_responses_over_a_real_socket_with_the_sync_client() -> None:
    app = create_app(scripted(CALL, ANSWER), model_name="scripted")
    with start_background(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        first = client.responses.create(model="scripted", input="Weather in Paris?", tools=TOOLS)
        output = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "18"}
        with client.responses.stream(
            model="scripted", input=[output], tools=TOOLS, previous_response_id=first.id
        ) as stream:
            text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
            final = stream.get_final_response()
    assert text == ANSWER == final.output_text
    assert cached(final) >= first.usage.input_tokens + first.usage.output_tokens - 1
    assert_quiescent(app.state.runner.cache)


def test_a_stream_left_early_cancels_and_one_cut_by_shutdown_ends_failed(make_app) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["word " * 3000]), cache_tokens=1 << 15)
    app = make_app(runner)
    engine = app.state.engine
    with start_background(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        body = {"model": "scripted", "input": "Talk.", "max_output_tokens": 15000, "stream": True}
        with client.responses.create(**body) as stream:
            for event in stream:
                if event.type == "response.output_text.delta":
                    break
        assert engine.wait_idle(timeout=30) and engine.cancelled_requests == 1
        kinds = []
        with client.responses.create(**body) as stream:
            for event in stream:
                kinds.append(event.type)
                if len(kinds) == 6:
                    closer = threading.Thread(target=engine.close)
                    closer.start()
        closer.join(30)
    assert kinds[-1] == "response.failed" and "response.completed" not in kinds
    assert event.response.status == "failed" and "shutting down" in event.response.error.message
    assert [k for k in kinds if not k.endswith(".delta")][:4] == TEXT_EVENTS
    assert len(app.state.responses) == 0
    assert_quiescent(runner.cache)


def test_a_function_call_joins_the_assistant_text_before_it_without_editing_the_stored_turn() -> None:
    stored = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Let me look."})
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    new = [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": "1"}]
    joined = conversation_after(stored, new)
    assert joined[1] == {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}
    assert [m["role"] for m in joined] == ["user", "assistant", "tool"]
    assert stored[1] == {"role": "assistant", "content": "Let me look."}


def test_a_stored_response_is_seen_only_with_the_api_key_namespace_that_made_it(make_app, asgi_client) -> None:
    app = make_app(scripted("Sunny.", "Still sunny."), api_keys=ApiKeys({"key-a": "team-a", "key-b": "team-b"}))

    async def main():
        mine, theirs = asgi_client(app, api_key="key-a"), asgi_client(app, api_key="key-b")
        response = await mine.responses.create(model="scripted", input="Hi")
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.create(model="scripted", input="And?", previous_response_id=response.id)
        with pytest.raises(openai.AuthenticationError):
            await asgi_client(app, api_key="wrong").responses.retrieve(response.id)
        follow_up = await mine.responses.create(model="scripted", input="And?", previous_response_id=response.id)
        return (await mine.responses.retrieve(response.id)), follow_up

    fetched, follow_up = run(main())
    assert fetched.output_text == "Sunny." and follow_up.output_text == "Still sunny."


def test_one_key_storing_past_the_bound_leaves_another_keys_responses_readable(asgi_client) -> None:
    keys = ApiKeys({"key-a": "team-a", "key-b": "team-b"})
    app = create_app(scripted(*["Sunny."] * 7), model_name="scripted", api_keys=keys, max_stored_responses=3)
    try:

        async def main():
            mine, theirs = asgi_client(app, api_key="key-a"), asgi_client(app, api_key="key-b")
            kept = await theirs.responses.create(model="scripted", input="Hi")
            flood = [await mine.responses.create(model="scripted", input=f"Hi {i}") for i in range(5)]
            fetched = await theirs.responses.retrieve(kept.id)
            follow_up = await theirs.responses.create(model="scripted", input="And?", previous_response_id=kept.id)
            with pytest.raises(openai.NotFoundError):
                await mine.responses.retrieve(flood[0].id)
            return fetched, follow_up, [await mine.responses.retrieve(r.id) for r in flood[2:]]

        fetched, follow_up, recent = run(main())
    finally:
        app.state.engine.close()
    assert fetched.output_text == "Sunny." and follow_up.previous_response_id == fetched.id
    assert len(recent) == 3 and len(app.state.responses) == 5  # team-a's last 3, team-b's 2
    app.state.responses.check_invariants()


def test_a_response_too_large_to_store_is_answered_with_store_false_and_not_kept(make_app, asgi_client) -> None:
    app = make_app(scripted("Sunny.", "Sunny."))
    metadata = {f"key{i}": "m" * 100_000 for i in range(16)}  # 1.6 MB: over the 1 MiB a response may keep

    async def main():
        client = asgi_client(app)
        plain = await client.responses.create(model="scripted", input="Hi", metadata=metadata)
        async with await client.responses.create(
            model="scripted", input="Hi", metadata=metadata, stream=True
        ) as stream:
            events = [event async for event in stream]
        for response_id in (plain.id, events[-1].response.id):
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(response_id)
        return plain, events

    plain, events = run(main())
    assert plain.output_text == "Sunny." and plain.store is False and plain.metadata == metadata
    assert events[0].response.store is True  # announced before the answer was known
    assert events[-1].type == "response.completed" and events[-1].response.store is False
    assert len(app.state.responses) == 0
