"""Fixtures for the server tests: apps over a runner, and the real OpenAI client talking to an app in-process."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from prefixcache.testing import require_extra as require  # noqa: E402

require("fastapi", "server")
httpx = require("httpx", "server")
openai = require("openai", "server")

from prefixcache import PrefixCachingRunner  # noqa: E402
from prefixcache.models.llama import build_model  # noqa: E402
from prefixcache.serve import ApiKeys, create_app, start_background  # noqa: E402


@pytest.fixture
def make_app() -> Iterator[Callable[..., object]]:
    """``make_app(runner, model_name="scripted", api_keys=None)``; every app's engine is closed afterwards."""
    apps = []

    def make(runner: PrefixCachingRunner, model_name: str = "scripted", api_keys: ApiKeys | None = None):
        app = create_app(runner, model_name=model_name, api_keys=api_keys)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.state.engine.close()


@pytest.fixture
def asgi_client() -> Callable[..., object]:
    """``asgi_client(app, api_key="none")``: an ``openai.AsyncOpenAI`` on httpx's ASGI transport (no socket)."""

    def make(app, api_key: str = "none"):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
        return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=api_key, http_client=http, max_retries=0)

    return make


@pytest.fixture(scope="module")
def tiny_model():
    """The embedded ``tiny`` model on the CPU, shared by a module's tests."""
    return build_model("tiny", device="cpu")


@pytest.fixture
def served_tiny(make_app, tiny_model):
    """``(runner, url, client)``: a fresh runner over ``tiny_model`` (8,192 tokens) served as ``tiny`` on 127.0.0.1 at
    a free port, and a sync ``openai.OpenAI`` client for it."""
    runner = PrefixCachingRunner(tiny_model, cache_tokens=8192)
    with start_background(make_app(runner, model_name="tiny"), "127.0.0.1", 0) as server:
        yield runner, server.url, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
