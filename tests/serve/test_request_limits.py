"""The server's request body limit over a real socket on 127.0.0.1: a body over ``max_request_bytes`` is a 413 in
OpenAI's error shape whether it declares its length or streams it chunked, and touches nothing; a body under it is
answered, a large one parsed off the event loop all the same."""

from __future__ import annotations

import httpx
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import build_model
from prefixcache.serve import create_app, start_background
from prefixcache.testing import assert_quiescent

LIMIT = 200_000


@pytest.fixture(scope="module")
def tiny_model():
    return build_model("tiny", device="cpu")


def _body(words: int) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "weather " * words}], "max_tokens": 1}


def test_a_body_over_the_limit_is_413_declared_or_chunked_and_one_under_it_is_served(tiny_model) -> None:
    runner = PrefixCachingRunner(tiny_model, cache_tokens=1 << 17)
    app = create_app(runner, model_name="tiny", max_request_bytes=LIMIT)
    with start_background(app, "127.0.0.1", 0) as server:
        url = server.url + "/v1/chat/completions"
        declared = httpx.post(url, json=_body(40_000), timeout=60)  # ~320 KB with a Content-Length
        assert declared.status_code == 413
        error = declared.json()["error"]
        assert error["code"] == "request_too_large" and "200,000 bytes" in error["message"]
        payload = httpx.Request("POST", url, json=_body(40_000)).content

        def chunks():
            for start in range(0, len(payload), 16_384):
                yield payload[start : start + 16_384]

        chunked = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=60)
        assert chunked.status_code == 413
        assert runner.cache.stats().query_tokens == 0  # nothing of either reached the cache
        # ~100 KB of JSON (a 3,000-token prompt padded by an unused field): parsed on a worker thread.
        large = httpx.post(url, json={**_body(3_000), "metadata": {"pad": "x" * 80_000}}, timeout=120)
        assert large.status_code == 200, large.text
        assert large.json()["usage"]["prompt_tokens"] > 20_000
    app.state.engine.close()
    assert_quiescent(runner.cache)


@pytest.mark.parametrize("limit", [0, -1, True, 1.5])
def test_a_limit_that_is_not_a_positive_int_is_refused(tiny_model, limit) -> None:
    with pytest.raises(InvalidArgumentError, match="max_request_bytes"):
        create_app(PrefixCachingRunner(tiny_model, cache_tokens=1024), max_request_bytes=limit)
