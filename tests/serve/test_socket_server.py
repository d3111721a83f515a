"""One real uvicorn server on 127.0.0.1 (a free port), started and stopped by the test, with the sync OpenAI client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai

from prefixcache import PrefixCachingRunner
from prefixcache.serve import start_background
from prefixcache.testing import ScriptedModel, assert_quiescent

CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "prefix caching"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
MESSAGES = [{"role": "system", "content": "You look things up. " * 20}, {"role": "user", "content": "What is it?"}]


def test_openai_client_over_a_real_socket(make_app) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts([CALL, "It reuses KV."]), cache_tokens=8192)
    with start_background(make_app(runner), "127.0.0.1", 0) as server:
        assert server.url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["scripted"]
        first = client.chat.completions.create(model="scripted", messages=MESSAGES, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"q": "prefix caching"})
        follow_up = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True)]
        follow_up.append({"role": "tool", "tool_call_id": call.id, "content": "a radix tree over token ids"})
        stream = client.chat.completions.create(
            model="scripted", messages=follow_up, tools=TOOLS, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "It reuses KV."
        usage = chunks[-1].usage
        assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens
    assert not server.thread.is_alive()
    assert_quiescent(runner.cache)


def test_a_client_disconnecting_mid_stream_frees_its_blocks(make_app) -> None:
    # An answer far longer than the test waits for: the stream is cut after its first chunks.
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["word " * 3000]), cache_tokens=1 << 15)
    app = make_app(runner)
    with start_background(app, "127.0.0.1", 0) as server:
        body = {"model": "scripted", "messages": MESSAGES, "stream": True, "max_tokens": 15000}
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                received = [next(lines) for _ in range(6)]
        assert any('"content": "w' in line or '"content": "word' in line for line in received)
        assert app.state.engine.wait_idle(timeout=30)
        assert app.state.engine.cancelled_requests == 1
        assert_quiescent(runner.cache)
        # Nothing the cancelled request generated was cached, and its own blocks went back to the pool: only its
        # prompt stays, unlocked, in the tree (the engine caches a prompt once prefilled, for requests that share it).
        stats = runner.cache.stats()
        prompt = runner.tokenizer.render_chat(MESSAGES, add_generation_prompt=True)
        assert stats.cached_tokens <= len(prompt)
        assert stats.locked_tokens == 0
        assert stats.free_blocks == stats.num_blocks - runner.pool.blocks_for_tokens(stats.cached_tokens)
        # The server still serves.
        done = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3})
        assert done.json()["choices"][0]["message"]["content"] == "wor"
        time.sleep(0)


def test_a_client_leaving_before_a_non_streamed_answer_cancels_its_request(make_app) -> None:
    # uvicorn does not cancel a handler whose client went away: the server has to notice, or the request runs on to
    # max_tokens, holding a running slot and its blocks for an answer nobody reads.
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["word " * 3000]), cache_tokens=1 << 15)
    app = make_app(runner)
    with start_background(app, "127.0.0.1", 0) as server:
        body = {"model": "scripted", "messages": MESSAGES, "max_tokens": 15000}
        with httpx.Client(base_url=server.url, timeout=httpx.Timeout(30, read=0.5)) as http:
            try:
                http.post("/v1/chat/completions", json=body)
            except httpx.ReadTimeout:
                pass
            else:
                raise AssertionError("the answer came before the client gave up")
        assert app.state.engine.wait_idle(timeout=30)
        assert app.state.engine.cancelled_requests == 1
        assert_quiescent(runner.cache)


def test_a_queued_stream_whose_client_leaves_before_its_first_token_is_cancelled(make_app) -> None:
    from prefixcache.serve import create_app

    runner = PrefixCachingRunner(ScriptedModel.from_texts(["word " * 3000]), cache_tokens=1 << 15)
    app = create_app(runner, model_name="scripted", max_running=1)  # the first stream holds the only slot
    engine = app.state.engine
    timeout = httpx.Timeout(30, read=0.5)
    try:
        with start_background(app, "127.0.0.1", 0) as server:
            body = {"model": "scripted", "messages": MESSAGES, "stream": True, "max_tokens": 15000}
            with httpx.Client(base_url=server.url, timeout=timeout) as http, httpx.Client(timeout=timeout) as other:
                with http.stream("POST", "/v1/chat/completions", json=body) as first:
                    lines = first.iter_lines()  # kept: httpx closes the connection once the iterator is dropped
                    next(lines)
                    try:  # waits behind the first for its first token, then gives up
                        with other.stream("POST", server.url + "/v1/chat/completions", json=body):
                            raise AssertionError("the queued stream answered before its client gave up")
                    except httpx.ReadTimeout:
                        pass
                    deadline = time.monotonic() + 30
                    while engine.cancelled_requests < 1 and time.monotonic() < deadline:
                        time.sleep(0.05)
                    # Cancelled while the first still runs: it never took the slot.
                    assert (engine.cancelled_requests, engine.num_pending) == (1, 1)
            assert engine.wait_idle(timeout=30)
            assert engine.cancelled_requests == 2
            assert_quiescent(runner.cache)
    finally:
        engine.close()


def test_requests_cut_off_by_the_engine_closing_are_answered_as_failed_not_as_finished(make_app) -> None:
    """A stream whose request the engine drops (the engine closes under it) must not end like a finished answer
    (``[DONE]`` with no finish reason reads as a complete, silently truncated reply): it ends with an error event.
    A non-streamed request answers 503 saying why, and both count as failures in /metrics."""
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["word " * 3000]), cache_tokens=1 << 15)
    app = make_app(runner)
    engine = app.state.engine
    plain: list[httpx.Response] = []
    with start_background(app, "127.0.0.1", 0) as server:
        body = {"model": "scripted", "messages": MESSAGES, "max_tokens": 15000}
        waiter = threading.Thread(
            target=lambda: plain.append(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30))
        )
        waiter.start()
        for _ in range(3000):
            if engine.num_pending == 1:
                break
            time.sleep(0.01)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                closer = None
                events = []
                for line in response.iter_lines():
                    if not line:
                        continue
                    events.append(line)
                    if len(events) == 4 and closer is None:
                        closer = threading.Thread(target=engine.close)
                        closer.start()
        closer.join(30)
        waiter.join(30)
        metrics = httpx.get(server.url + "/metrics").text

    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"]["type"] == "server_error" and "shutting down" in last["error"]["message"]
    assert not any('"finish_reason": "' in line for line in events)
    (answer,) = plain
    assert answer.status_code == 503
    assert "shutting down" in answer.json()["error"]["message"]
    assert engine.cancelled_requests == 2
    assert 'prefixcache_requests_total{endpoint="/v1/chat/completions",status="503"} 2.0' in metrics
    assert 'status="ok"' not in metrics
    assert_quiescent(runner.cache)


def test_a_plain_request_still_running_when_the_shutdown_grace_ends_answers_503_in_openai_shape(make_app) -> None:
    """uvicorn cancels the handlers still running when its graceful-shutdown wait ends; a non-streamed request cut
    there answers 503 in OpenAI's error shape (counted as a failure), not uvicorn's plain-text 500."""
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["word " * 3000]), cache_tokens=1 << 15)
    app = make_app(runner)
    engine = app.state.engine
    answers: list[httpx.Response] = []
    server = start_background(app, "127.0.0.1", 0)
    server.server.config.timeout_graceful_shutdown = 0.2
    body = {"model": "scripted", "messages": MESSAGES, "max_tokens": 15000}
    waiter = threading.Thread(
        target=lambda: answers.append(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60))
    )
    waiter.start()
    while engine.num_pending < 1:
        time.sleep(0.01)
    server.stop(30)
    waiter.join(30)
    (answer,) = answers
    assert answer.status_code == 503
    assert answer.json()["error"]["type"] == "server_error"
    assert "shutting down" in answer.json()["error"]["message"]
    assert engine.wait_idle(30)
    assert engine.cancelled_requests == 1
    assert 'endpoint="/v1/chat/completions",status="503"} 1.0' in app.state.metrics.render().decode()
    assert_quiescent(runner.cache)
