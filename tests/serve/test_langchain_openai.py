"""LangChain's ``ChatOpenAI`` against ``prefixcache serve`` on 127.0.0.1: ``with_structured_output(Model)`` with its
default method (a strict ``json_schema`` response format) returns a validated object from a random-weight model,
through chat completions and through the Responses API (``use_responses_api=True``), and the second call hits the
first's prompt."""

from __future__ import annotations

import os

import pydantic
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.models.llama import build_model
from prefixcache.serve import start_background
from prefixcache.testing import assert_quiescent

if os.environ.get("CI") != "true":  # CI installs every extra: there a missing one fails
    pytest.importorskip("langchain_openai", reason="needs: pip install 'prefixcache[langchain]'")
    pytest.importorskip("llguidance", reason="needs: pip install 'prefixcache[structured]'")

from langchain_openai import ChatOpenAI  # noqa: E402


class Forecast(pydantic.BaseModel):
    """Tomorrow's weather in one city."""

    city: str = pydantic.Field(max_length=8)
    sunny: bool


@pytest.mark.parametrize("responses", [False, True])
def test_with_structured_output_returns_the_validated_object_and_hits_the_cache(make_app, responses) -> None:
    runner = PrefixCachingRunner(build_model("tiny", device="cpu"), cache_tokens=8192)
    with start_background(make_app(runner, model_name="tiny"), "127.0.0.1", 0) as server:
        llm = ChatOpenAI(
            model="tiny", base_url=server.url + "/v1", api_key="none", max_retries=0, use_responses_api=responses
        )
        structured = llm.with_structured_output(Forecast, include_raw=True)
        question = "Forecast for Paris tomorrow?"
        first, second = structured.invoke(question), structured.invoke(question)
    for out in (first, second):
        assert out["parsing_error"] is None and isinstance(out["parsed"], Forecast)
    usage = second["raw"].usage_metadata
    assert usage["input_token_details"]["cache_read"] == usage["input_tokens"] - 1
    assert_quiescent(runner.cache)
