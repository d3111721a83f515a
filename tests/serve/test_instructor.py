"""instructor against the server on 127.0.0.1, in its TOOLS mode (a named ``tool_choice``: the grammar constrains the
call's arguments to the response model's schema), JSON_SCHEMA mode (a strict ``json_schema`` response format) and JSON
mode (``json_object``, the schema only in the prompt: a random-weight model cannot follow it, so a scripted model
answers): each returns a validated object, and each turn of a conversation finds the previous turn cached.

instructor is not among the extras: its one release that accepts openai 3 (1.17.0) caps ``jiter<0.15`` while every
openai from 3.3.1 needs ``jiter>=0.16``, so pip would downgrade openai below what the other clients need.  It works
with the newer jiter: ``pip install --no-deps instructor==1.17.0`` (its other requirements come with the extras)."""

from __future__ import annotations

import pydantic
import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.serve import start_background
from prefixcache.testing import ScriptedModel, assert_quiescent

instructor = pytest.importorskip(
    "instructor", reason="needs: pip install --no-deps instructor==1.17.0 (not an extra: its jiter cap)"
)
openai = pytest.importorskip("openai", reason="needs: pip install 'prefixcache[server]'")

QUESTIONS = ("Forecast for Paris?", "And Rome?", "And Oslo?")


class Forecast(pydantic.BaseModel):
    """Tomorrow's weather in one city."""

    city: str = pydantic.Field(max_length=8)
    sunny: bool


def _conversation(url: str, model: str, mode: object) -> list[object]:
    """Ask ``QUESTIONS`` in one conversation through instructor in ``mode``; the raw completion of each turn."""
    client = instructor.from_openai(openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), mode=mode)
    messages: list[dict[str, object]] = []
    completions = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        forecast, completion = client.chat.completions.create_with_completion(
            model=model, response_model=Forecast, messages=messages, max_tokens=200, temperature=0, max_retries=0
        )
        assert isinstance(forecast, Forecast) and len(forecast.city) <= 8
        message = completion.choices[0].message
        reply: dict[str, object] = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            reply["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        messages.append(reply)
        for call in message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "noted"})
        completions.append(completion)
    return completions


def _assert_each_turn_hits_the_last(completions: list[object]) -> None:
    for before, after in zip(completions, completions[1:], strict=False):
        # All of the previous turn is cached but its last answer token, whose K/V no forward has computed.
        previous = before.usage.prompt_tokens + before.usage.completion_tokens - 1
        assert after.usage.prompt_tokens_details.cached_tokens == previous


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_a_constrained_mode_returns_the_validated_object_from_a_random_model(served_tiny, mode) -> None:
    runner, url, _ = served_tiny
    _assert_each_turn_hits_the_last(_conversation(url, "tiny", getattr(instructor.Mode, mode)))
    assert_quiescent(runner.cache)


def test_json_mode_parses_the_answer_and_each_turn_hits_the_last(make_app) -> None:
    answers = [
        '{"city": "Paris", "sunny": true}',
        '{"city": "Rome", "sunny": true}',
        '{"city": "Oslo", "sunny": false}',
    ]
    runner = PrefixCachingRunner(ScriptedModel.from_texts(answers), cache_tokens=16384)
    with start_background(make_app(runner), "127.0.0.1", 0) as server:
        completions = _conversation(server.url, "scripted", instructor.Mode.JSON)
    assert [c.choices[0].message.content for c in completions] == answers
    _assert_each_turn_hits_the_last(completions)
    assert_quiescent(runner.cache)
