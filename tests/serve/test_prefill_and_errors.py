"""Prefix warming with retention, the router's own errors in OpenAI's shape, open probes, and empty conversations."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.errors import InvalidArgumentError
from prefixcache.serve import ApiKeys
from prefixcache.testing import ScriptedModel, assert_quiescent, snapshot

BLOCK = 16


def scripted(cache_tokens: int) -> PrefixCachingRunner:
    return PrefixCachingRunner(ScriptedModel.from_texts(["Hello."]), cache_tokens=cache_tokens, block_size=BLOCK)


def post_all(app, requests: list[tuple[str, str, object]], headers: dict | None = None) -> list[httpx.Response]:
    """Send ``(method, path, json body or raw bytes)`` one after another through the ASGI transport."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver", headers=headers) as http:
            out = []
            for method, path, body in requests:
                if isinstance(body, bytes):
                    out.append(await http.request(method, path, content=body))
                else:
                    out.append(await http.request(method, path, json=body))
            return out

    return asyncio.run(main())


def prompt_of(first: int, num_blocks: int) -> list[int]:
    # Distinct first tokens: the prompts share nothing in the tree.
    return [first] + [65 + i % 26 for i in range(num_blocks * BLOCK - 1)]


def cached_after_warming(app, prompt: list[int]) -> int:
    (response,) = post_all(app, [("POST", "/v1/cache/prefill", {"prompt": prompt})])
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("retain", [True, False])
def test_a_retained_prefix_survives_pressure_that_evicts_an_unretained_one(make_app, retain: bool) -> None:
    runner = scripted(16 * BLOCK)
    app = make_app(runner)
    kept, other, pressure = prompt_of(1, 4), prompt_of(2, 4), prompt_of(3, 10)
    # ``kept`` goes in first, so plain LRU would evict it before ``other``.
    extra = {"priority": 2, "retain_s": 600} if retain else {}
    responses = post_all(
        app,
        [
            ("POST", "/v1/cache/prefill", {"prompt": kept, **extra}),
            ("POST", "/v1/cache/prefill", {"prompt": other}),
            ("POST", "/v1/cache/prefill", {"prompt": pressure}),
        ],
    )
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert runner.cache.stats().evictions > 0
    # Warming again reports what survived: all but the last token (always recomputed) of a prompt still cached.
    full = len(kept) - 1
    if retain:
        assert cached_after_warming(app, kept) == full
        assert cached_after_warming(app, other) < full
    else:
        assert cached_after_warming(app, kept) < full
    assert_quiescent(runner.cache)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "warm me", "priority": 0}, "priority"),
        ({"prompt": "warm me", "priority": -3}, "priority"),
        ({"prompt": "warm me", "priority": True}, "priority"),
        ({"prompt": "warm me", "priority": "1"}, "priority"),
        ({"prompt": "warm me", "priority": 1.5}, "priority"),
        ({"prompt": "warm me", "retain_s": 30}, "retain_s"),
        ({"prompt": "warm me", "priority": 1, "retain_s": 0}, "retain_s"),
        ({"prompt": "warm me", "priority": 1, "retain_s": -1}, "retain_s"),
        ({"prompt": "warm me", "priority": 1, "retain_s": "30"}, "retain_s"),
        (b'{"prompt": "warm me", "priority": 1, "retain_s": Infinity}', "retain_s"),
        (b'{"prompt": "warm me", "priority": 1, "retain_s": NaN}', "retain_s"),
        ({"prompt": "warm me", "namespace": "other"}, "namespace"),
        ({"prompt": "warm me", "tools": []}, "tools"),
        ({"prompt": [1, 10**9]}, "prompt"),
        ({"messages": [], "priority": 1}, "messages"),
        ({"priority": 1}, "messages"),
    ],
)
def test_bad_prefill_bodies_are_400_in_openai_shape_and_touch_nothing(make_app, body, param: str) -> None:
    runner = scripted(1024)
    app = make_app(runner)
    before = snapshot(runner.cache, [runner.namespace_key(None)])
    (response,) = post_all(app, [("POST", "/v1/cache/prefill", body)])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}
    assert snapshot(runner.cache, [runner.namespace_key(None)]) == before
    assert runner.cache.stats().cached_tokens == 0


def test_unknown_paths_and_wrong_methods_answer_in_openai_shape(make_app) -> None:
    app = make_app(scripted(1024))
    missing, wrong_method = post_all(app, [("POST", "/v1/embeddings", {}), ("GET", "/v1/chat/completions", None)])
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "message": "Not Found: POST /v1/embeddings",
            "type": "not_found_error",
            "param": None,
            "code": "not_found",
        }
    }
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    error = wrong_method.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "method_not_allowed", None)


def test_health_and_metrics_stay_open_with_api_keys_while_v1_needs_a_key(make_app, tmp_path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("key-a\n")
    app = make_app(scripted(1024), api_keys=ApiKeys.from_file(keys))
    health, metrics, models, warm = post_all(
        app,
        [
            ("GET", "/health", None),
            ("GET", "/metrics", None),
            ("GET", "/v1/models", None),
            ("POST", "/v1/cache/prefill", {"prompt": "warm me"}),
        ],
    )
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert metrics.status_code == 200 and "prefixcache_hit_rate" in metrics.text
    assert (models.status_code, warm.status_code) == (401, 401)
    (with_key,) = post_all(app, [("GET", "/v1/models", None)], headers={"Authorization": "Bearer key-a"})
    assert with_key.status_code == 200


def test_an_empty_conversation_is_refused_in_process_and_over_http(make_app) -> None:
    runner = scripted(1024)
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        runner.chat([])
    assert_quiescent(runner.cache)
    assert runner.cache.stats().cached_tokens == 0
    app = make_app(runner)
    (response,) = post_all(app, [("POST", "/v1/chat/completions", {"model": "scripted", "messages": []})])
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_requests_that_run_out_of_pool_together_are_preempted_not_failed(make_app) -> None:
    # Each request fits the pool alone (capacity check passes), but two admitted together fill it with their
    # prompts, so the first decode block cannot be had: the later one is preempted (its blocks freed, its computed
    # tokens cached) and resumes once the other is done, so both answer 200 with what they answer alone.
    from prefixcache.models import build_model

    model = build_model("tiny")
    runner = PrefixCachingRunner(model, cache_tokens=4 * BLOCK, block_size=BLOCK)
    app = make_app(runner, model_name="tiny")
    engine = app.state.engine
    gate = threading.Event()
    engine.call_soon(gate.wait)  # holds the engine thread until both requests are queued

    bodies = [
        {"model": "tiny", "prompt": [first] + [65] * (2 * BLOCK - 1), "max_tokens": 8, "temperature": 0}
        for first in (1, 2)
    ]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            sends = [asyncio.create_task(http.post("/v1/completions", json=body)) for body in bodies]
            while engine.num_pending < 3:
                await asyncio.sleep(0.01)
            gate.set()
            return await asyncio.gather(*sends)

    responses = asyncio.run(main())
    assert engine.wait_idle(30)
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    roomy = make_app(PrefixCachingRunner(model, cache_tokens=64 * BLOCK, block_size=BLOCK), model_name="tiny")
    alone = post_all(roomy, [("POST", "/v1/completions", body) for body in bodies])  # one after another
    assert [r.json()["choices"] for r in responses] == [r.json()["choices"] for r in alone]
    assert engine.preempted_requests >= 1
    (metrics,) = post_all(app, [("GET", "/metrics", None)])
    assert f"prefixcache_preempted_requests_total {float(engine.preempted_requests)}" in metrics.text
    assert_quiescent(runner.cache)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}, {"function": {"name": 3}}]}, "tools[1]"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0]"),
    ],
)
def test_stream_options_without_a_stream_and_malformed_tools_are_400(make_app, extra: dict, param: str) -> None:
    runner = scripted(4096)
    app = make_app(runner)
    before = snapshot(runner.cache, [runner.namespace_key(None)])
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], **extra}
    (response,) = post_all(app, [("POST", "/v1/chat/completions", body)])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert snapshot(runner.cache, [runner.namespace_key(None)]) == before
    assert_quiescent(runner.cache)


def test_an_error_naming_a_lone_surrogate_is_a_400_in_openai_shape_not_a_500(make_app) -> None:
    # JSON's \ud800 escape decodes to a lone surrogate, which UTF-8 cannot encode: the error body escapes it again.
    runner = scripted(1024)
    body = b'{"model": "scripted", "\\ud800": 1, "messages": [{"role": "user", "content": "x"}]}'
    (response,) = post_all(make_app(runner), [("POST", "/v1/chat/completions", body)])
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "unsupported parameter: \ud800",
        "type": "invalid_request_error",
        "param": "\ud800",
        "code": None,
    }
    assert_quiescent(runner.cache)
    assert runner.cache.stats().query_tokens == 0


@pytest.mark.parametrize("n", [True, 17, 0, "1"])
def test_n_outside_one_to_sixteen_is_refused(make_app, n) -> None:
    body = {"model": "scripted", "messages": [{"role": "user", "content": "x"}], "n": n}
    (response,) = post_all(make_app(scripted(1024)), [("POST", "/v1/chat/completions", body)])
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
