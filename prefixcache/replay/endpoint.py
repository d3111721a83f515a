"""The client side of ``replay --endpoint``: a replay's requests sent to any OpenAI-compatible server, streamed, with
the server's own counts read back.

Each call is one streamed request (``stream_options.include_usage``), ``temperature`` 0 and a small ``max_tokens``:
chat completions for a chat-shaped request, completions for a prompt of text or token ids.  What comes back per
request is an :class:`EndpointResult`: the prompt tokens as the server counted them, its cached tokens
(``usage.prompt_tokens_details.cached_tokens``, or llama.cpp's ``timings.cache_n`` when only that is there; ``None``
when the server reports neither) and the time to the first streamed chunk (TTFT, seconds).

:func:`send_all` keeps the replay's order: requests start in that order, at most ``concurrency`` at a time, and a
conversation's next turn waits for its previous one (a user sends the next message after reading the answer).  It
talks to the URL it is given only; the API key goes in the ``Authorization`` header and nowhere else.

Needs ``httpx`` (the ``server`` extra), imported only when a request is sent, so that the rest of ``replay`` works
without it.  No torch here: the command line's argument definitions import this module.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prefixcache.errors import EndpointError, InvalidArgumentError, install_command

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "EndpointCall",
    "EndpointResult",
    "add_endpoint_arguments",
    "api_key_from_env",
    "base_url",
    "fetch_model",
    "percentile",
    "send_all",
]

DEFAULT_MAX_TOKENS = 1
"""Tokens the endpoint generates per request unless ``--max-tokens`` says otherwise: the audit measures the prompt's
cache hits and the time to the first token, not the answer."""
CONNECT_TIMEOUT_S = 10.0
"""Seconds to open a connection before the endpoint counts as unreachable."""
READ_TIMEOUT_S = 600.0
"""Seconds to wait for the next bytes of an answer (a long prompt's prefill on a slow server)."""


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``replay --endpoint`` options, as one argument group of the ``replay`` parser."""
    group = parser.add_argument_group("auditing an OpenAI-compatible endpoint")
    group.add_argument(
        "--endpoint",
        metavar="URL",
        help="send the replay's requests to this server (its base URL, e.g. http://127.0.0.1:8000/v1) and report "
        "its cached tokens beside the ideal and the simulation at --cache-tokens",
    )
    group.add_argument(
        "--api-key-env", metavar="VAR", help="with --endpoint: the environment variable with the API key"
    )
    group.add_argument(
        "--concurrency",
        type=int,
        default=1,
        metavar="N",
        help="with --endpoint: requests in flight at once (default 1)",
    )
    group.add_argument(
        "--endpoint-model", metavar="NAME", help="with --endpoint: the model (default: the first listed)"
    )
    group.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        default=DEFAULT_MAX_TOKENS,
        help=f"with --endpoint: tokens generated per request (default {DEFAULT_MAX_TOKENS})",
    )
    group.add_argument(
        "--no-stream",
        action="store_true",
        help="with --endpoint: ask for whole responses, for a server whose streams carry no usage (llama-cpp-python); "
        "the time then is the whole request's, not the first token's",
    )


@dataclass(frozen=True, slots=True)
class EndpointCall:
    """One request to send: ``path`` (``"/chat/completions"`` or ``"/completions"``, under the base URL), the body
    without the model and sampling fields (those are the same for every call), ``key`` (the conversation it belongs
    to: a call waits for the previous call with the same key) and ``where`` (how errors name it)."""

    path: str
    body: Mapping[str, Any]
    key: str
    where: str


@dataclass(frozen=True, slots=True)
class EndpointResult:
    """What the endpoint said about one request: ``prompt_tokens`` as the server counted them (``None`` if its stream
    carried no usage), ``cached_tokens`` (``None`` if it reports none), ``cache_field`` (where those came from:
    ``"usage.prompt_tokens_details.cached_tokens"``, ``"timings.cache_n"`` or ``None``), ``ttft_s`` (seconds from
    sending to the first streamed chunk with a choice) and ``latency_s`` (seconds to the end of the stream)."""

    prompt_tokens: int | None
    cached_tokens: int | None
    cache_field: str | None
    ttft_s: float
    latency_s: float


def base_url(url: str) -> str:
    """The API base of ``url``: as given (an OpenAI client's ``base_url``), or with ``/v1`` added when it has no path.

    Raises:
        InvalidArgumentError: not an ``http://`` or ``https://`` URL with a host.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgumentError(
            f"--endpoint {url!r}: give an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1"
        )
    base = url.strip().rstrip("/")
    return base if parts.path.strip("/") else base + "/v1"


def api_key_from_env(variable: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The API key in the environment variable ``variable`` (``None``: no key is sent).

    Raises:
        InvalidArgumentError: the variable is not set or empty.
    """
    if variable is None:
        return None
    key = environ.get(variable, "")
    if not key.strip():
        raise InvalidArgumentError(f"--api-key-env {variable}: the environment variable {variable} is not set or empty")
    return key.strip()


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """The ``fraction`` quantile (0..1) of ``values``, linearly interpolated between the closest ranks (NumPy's
    default); ``None`` for no values.  O(n log n)."""
    if not values:
        return None
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _httpx():
    try:
        import httpx
    except ImportError:
        raise InvalidArgumentError(f"--endpoint needs httpx: {install_command('server')}") from None
    return httpx


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _http_problem(status: int, text: str) -> str:
    """The server's own error message from an error body (OpenAI's ``{"error": {"message": ...}}``), cut short."""
    message = text.strip()
    try:
        body = json.loads(text)
        error = body.get("error", body) if isinstance(body, dict) else body
        message = str(error.get("message", error) if isinstance(error, dict) else error)
    except ValueError:
        pass
    return f"HTTP {status}: {message[:300] or '(empty body)'}"


def fetch_model(url: str, api_key: str | None) -> str:
    """The first model the endpoint lists at ``GET {url}/models``.

    Raises:
        EndpointError: the endpoint is unreachable, answers with an HTTP error, or lists no model (then
            ``--endpoint-model`` names one).
    """
    httpx = _httpx()
    try:
        response = httpx.get(
            f"{url}/models", headers=_headers(api_key), timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        )
    except httpx.HTTPError as error:
        raise EndpointError(f"{url}: cannot reach the endpoint: {error or type(error).__name__}") from None
    if response.status_code != 200:
        problem = _http_problem(response.status_code, response.text)
        raise EndpointError(f"{url}/models: {problem}; --endpoint-model NAME skips the listing")
    try:
        models = response.json()["data"]
        return str(models[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise EndpointError(f"{url}/models lists no model; give one with --endpoint-model NAME") from None


def send_all(
    url: str,
    calls: Sequence[EndpointCall],
    *,
    model: str,
    api_key: str | None = None,
    concurrency: int = 1,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    stream: bool = True,
    on_done: Callable[[int], None] | None = None,
) -> list[EndpointResult]:
    """Send ``calls`` to the endpoint at ``url`` (a base URL, :func:`base_url`) and return one result per call, in
    the calls' order.  Calls start in order, at most ``concurrency`` in flight, each after the previous call of its
    ``key`` has finished.  ``on_done(i)`` is told as call ``i`` finishes (progress).  ``stream`` ``False`` asks for
    whole responses (``ttft_s`` is then the whole request's time).

    Raises:
        InvalidArgumentError: ``concurrency`` or ``max_tokens`` below 1; httpx is not installed.
        EndpointError: a call could not be sent or read, or the server answered it with an HTTP or stream error;
            the message names the call (the calls still in flight are cancelled).
    """
    if concurrency < 1:
        raise InvalidArgumentError(f"--concurrency {concurrency}: give 1 or more")
    if max_tokens < 1:
        raise InvalidArgumentError(f"--max-tokens {max_tokens}: give 1 or more")
    httpx = _httpx()
    sampling: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        sampling["stream_options"] = {"include_usage": True}
    return asyncio.run(_send_all(httpx, url, calls, sampling, api_key, concurrency, on_done))


async def _send_all(
    httpx: Any,
    url: str,
    calls: Sequence[EndpointCall],
    sampling: dict[str, Any],
    api_key: str | None,
    concurrency: int,
    on_done: Callable[[int], None] | None,
) -> list[EndpointResult]:
    results: list[EndpointResult | None] = [None] * len(calls)
    slots = asyncio.Semaphore(concurrency)
    previous: dict[str, asyncio.Task] = {}
    tasks: list[asyncio.Task] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)

    async def run(index: int, call: EndpointCall) -> None:
        try:
            results[index] = await _stream_one(httpx, client, url, call, {**call.body, **sampling}, api_key)
        finally:
            slots.release()
        if on_done is not None:
            on_done(index)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        try:
            for index, call in enumerate(calls):
                before = previous.get(call.key)
                if before is not None:
                    await asyncio.wait([before])
                await slots.acquire()
                failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
                if failed is not None:
                    slots.release()
                    break
                task = asyncio.create_task(run(index, call))
                tasks.append(task)
                previous[call.key] = task
            if tasks:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
            if failed is not None:
                raise failed.exception()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return [result for result in results if result is not None]


async def _stream_one(
    httpx: Any, client: Any, url: str, call: EndpointCall, body: dict[str, Any], api_key: str | None
) -> EndpointResult:
    """One streamed request; its usage (the last chunk that has one) and timings read from the stream."""
    target = f"{url}{call.path}"
    start = time.perf_counter()
    first: float | None = None
    usage: Any = None
    timings: Any = None
    try:
        if not body["stream"]:
            response = await client.post(target, json=body, headers=_headers(api_key))
            if response.status_code != 200:
                raise EndpointError(f"{call.where}: {target}: {_http_problem(response.status_code, response.text)}")
            try:
                answer = response.json()
            except ValueError:
                raise EndpointError(
                    f"{call.where}: {target}: the response is not JSON: {response.text[:200]!r}"
                ) from None
            latency = time.perf_counter() - start
            answer = answer if isinstance(answer, dict) else {}
            prompt_tokens, cached, field = _counts(answer.get("usage"), answer.get("timings"))
            return EndpointResult(prompt_tokens, cached, field, latency, latency)
        async with client.stream("POST", target, json=body, headers=_headers(api_key)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                raise EndpointError(f"{call.where}: {target}: {_http_problem(response.status_code, text)}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise EndpointError(
                        f"{call.where}: {target}: a streamed chunk is not JSON: {data[:200]!r}"
                    ) from None
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk:
                    raise EndpointError(f"{call.where}: {target}: the stream ended on an error: {chunk['error']}")
                if first is None and chunk.get("choices"):
                    first = time.perf_counter() - start
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
    except httpx.HTTPError as error:
        raise EndpointError(f"{call.where}: {target}: {error or type(error).__name__}") from None
    latency = time.perf_counter() - start
    prompt_tokens, cached, field = _counts(usage, timings)
    return EndpointResult(prompt_tokens, cached, field, latency if first is None else first, latency)


def _counts(usage: Any, timings: Any) -> tuple[int | None, int | None, str | None]:
    """``(prompt_tokens, cached_tokens, cache_field)`` from a response's ``usage`` and llama.cpp's ``timings``."""
    prompt_tokens = cached = field = None
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            cached, field = details["cached_tokens"], "usage.prompt_tokens_details.cached_tokens"
    if cached is None and isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        cached, field = timings["cache_n"], "timings.cache_n"
        if prompt_tokens is None and isinstance(timings.get("prompt_n"), int):
            # llama.cpp's prompt_n counts the tokens it evaluated, the cached ones not among them.
            prompt_tokens = timings["prompt_n"] + cached
    return prompt_tokens, cached, field
