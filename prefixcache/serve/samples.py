"""``n`` > 1 streamed: the ``n`` samples' event streams merged into one, in OpenAI's shape.

Each sample is its own engine request and its own stream of SSE lines (``data: {chunk}``), written as a stream of one
choice would be (:mod:`prefixcache.serve.completion_routes`).  The merge forwards each line as it comes, the sample's
choice given its ``index``, so each choice's deltas arrive in order and the choices interleave as their tokens come out
(OpenAI streams ``n`` choices the same way).  What describes the whole response is said once, at the end: the usage-only
chunk of ``stream_options.include_usage`` (the samples' usages summed, :func:`summed_usage`) and ``[DONE]``.  Without
``include_usage`` the usage rides on a finishing chunk, as for ``n = 1``: the summed usage on the last choice to
finish, none on the others (with ``continuous_usage_stats`` every chunk keeps its own choice's usage so far, the last
finishing one the sum).  A sample's error event ends the whole stream: the others are cancelled, their blocks freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

__all__ = ["first_events", "merged_streams", "summed_usage"]

logger = logging.getLogger(__name__)

_DONE = "data: [DONE]\n\n"
_JSON = json.JSONEncoder(ensure_ascii=False)


def summed_usage(usages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The usage of a response of ``n`` samples (OpenAI's ``usage`` objects, sample 0 first): the prompt counted once
    (sample 0's prompt, cached and prefill counts), the completion tokens of all samples, the total of the two."""
    generated = sum(usage["completion_tokens"] for usage in usages)
    first = usages[0]
    return {**first, "completion_tokens": generated, "total_tokens": first["prompt_tokens"] + generated}


async def first_events(jobs: Sequence[AsyncIterator[Any]]) -> list[Any]:
    """The first event of every job, the jobs started together (the engine admits the samples in one step, and
    prefix-aware admission prefills their prompt once).  Cancelled, it cancels every job's wait."""
    if len(jobs) == 1:
        return [await anext(jobs[0])]
    return list(await asyncio.gather(*(anext(job) for job in jobs)))


async def merged_streams(
    streams: Sequence[AsyncIterator[str]], *, continuous_usage: bool = False
) -> AsyncIterator[str]:
    """The SSE lines of one response of ``len(streams)`` choices from the streams of its samples (see the module
    docstring); ``continuous_usage``: the chunks carry their choice's usage so far.  Every stream is closed however the
    merge ends (finished, failed, or the client gone)."""
    n = len(streams)
    waits: dict[asyncio.Future[str], int] = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    finished: dict[int, dict[str, Any]] = {}  # each sample's usage, from its finishing chunk
    reported: dict[int, dict[str, Any]] = {}  # each sample's usage-only chunk
    try:
        while waits:
            ready, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in sorted(ready, key=waits.__getitem__):
                sample = waits.pop(wait)
                try:
                    line = wait.result()
                except StopAsyncIteration:
                    continue
                waits[asyncio.ensure_future(anext(streams[sample]))] = sample
                if line == _DONE:
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    yield line
                    yield _DONE
                    return
                choices = chunk.get("choices") or []
                if not choices and "usage" in chunk:
                    reported[sample] = chunk
                    continue
                for choice in choices:
                    choice["index"] = sample
                if any(choice.get("finish_reason") is not None for choice in choices):
                    usage = chunk.pop("usage", None)
                    finished[sample] = usage
                    if usage is not None and len(finished) == n and all(u is not None for u in finished.values()):
                        chunk["usage"] = summed_usage([finished[i] for i in range(n)])
                    elif usage is not None and continuous_usage:
                        chunk["usage"] = usage
                yield f"data: {_JSON.encode(chunk)}\n\n"
        if reported:
            last = reported[max(reported)]
            last["usage"] = summed_usage([reported[i]["usage"] for i in sorted(reported)])
            yield f"data: {_JSON.encode(last)}\n\n"
        yield _DONE
    finally:
        for wait in waits:
            wait.cancel()
        for wait in waits:
            try:
                await wait
            except (asyncio.CancelledError, StopAsyncIteration):  # cancelled here, or a sample that had just ended
                pass
            except Exception:  # noqa: BLE001 - the response has ended; close the other samples all the same
                logger.exception("a sample's stream failed as the merged stream closed")
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
