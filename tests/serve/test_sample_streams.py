"""The merge of ``n`` samples' SSE streams (``prefixcache.serve.samples``), on hand-written streams: choice indexes,
the usage said once and summed, an error that ends every stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from prefixcache.serve.samples import merged_streams, summed_usage


def usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def line(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def chunk(text: str | None, finish: str | None = None, used: dict | None = None) -> str:
    body: dict = {"object": "chat.completion.chunk", "choices": []}
    if text is not None:
        body["choices"] = [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]
    if used is not None:
        body["usage"] = used
    return line(body)


async def sample(lines: list[str], closed: list[int], number: int, pause_s: float = 0.0) -> AsyncIterator[str]:
    try:
        for text in lines:
            await asyncio.sleep(pause_s)
            yield text
    finally:
        closed.append(number)


def merge(streams: list[AsyncIterator[str]], **options) -> list[str]:
    async def collect() -> list[str]:
        return [text async for text in merged_streams(streams, **options)]

    return asyncio.run(collect())


def test_the_usage_sums_the_samples_completions_and_counts_the_prompt_once() -> None:
    assert summed_usage([usage(10, 3), usage(10, 4), usage(10, 0)]) == usage(10, 7)


def test_each_choice_is_indexed_and_the_usage_chunk_comes_once_at_the_end() -> None:
    closed: list[int] = []
    streams = [
        sample(
            [chunk("a"), chunk("b", "stop"), chunk(None, used=usage(5, 2)), "data: [DONE]\n\n"], closed, i, 0.001 * i
        )
        for i in range(3)
    ]
    out = merge(streams)
    assert out[-1] == "data: [DONE]\n\n" and out.count("data: [DONE]\n\n") == 1
    chunks = [json.loads(text.removeprefix("data: ")) for text in out[:-1]]
    texts: dict[int, str] = {}
    for body in chunks[:-1]:
        [choice] = body["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["delta"]["content"]
    assert texts == {0: "ab", 1: "ab", 2: "ab"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage(5, 6)
    assert all("usage" not in body for body in chunks[:-1])
    assert sorted(closed) == [0, 1, 2]


def test_without_include_usage_only_the_last_finishing_chunk_carries_the_sum() -> None:
    closed: list[int] = []
    streams = [sample([chunk("x"), chunk("", "length", usage(4, 1 + i))], closed, i, 0.002 * i) for i in range(2)]
    chunks = [json.loads(text.removeprefix("data: ")) for text in merge(streams)[:-1]]
    finishing = [body for body in chunks if body["choices"][0]["finish_reason"]]
    assert ["usage" in body for body in finishing] == [False, True]
    assert finishing[-1]["usage"] == usage(4, 3)


def test_an_error_in_one_sample_ends_the_stream_and_closes_the_others() -> None:
    closed: list[int] = []
    error = line({"error": {"message": "boom", "type": "server_error"}})
    failing = sample([chunk("a"), error, "data: [DONE]\n\n"], closed, 0)
    endless = sample([chunk(str(k)) for k in range(1000)], closed, 1, 0.01)
    out = merge([failing, endless])
    assert out[-2:] == [error, "data: [DONE]\n\n"]
    assert len(out) < 10 and sorted(closed) == [0, 1]


def test_a_client_leaving_after_a_sample_has_ended_logs_no_error(caplog) -> None:
    # The merge is closed (client gone) while one sample's stream has just ended (its pending read holds a
    # StopAsyncIteration): that is an end, not a failure to log with a traceback.
    closed: list[int] = []
    forever = asyncio.Event()

    async def waiting() -> AsyncIterator[str]:
        try:
            await forever.wait()
            yield chunk("never")
        finally:
            closed.append(1)

    async def leave_after_the_first_line() -> str:
        merged = merged_streams([sample([chunk("a", "stop")], closed, 0), waiting()])
        first = await anext(merged)
        for _ in range(10):  # sample 0's next read runs to its end meanwhile
            await asyncio.sleep(0)
        await merged.aclose()
        return first

    with caplog.at_level("ERROR", logger="prefixcache.serve.samples"):
        first = asyncio.run(leave_after_the_first_line())
    assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"] == {"content": "a"}
    assert sorted(closed) == [0, 1]
    assert [record.getMessage() for record in caplog.records] == []
