"""One timed completion against either server of ``bench llamacpp``, the prompt given as token ids, not streamed.

- llama.cpp's ``POST /completion``: ``prompt`` a list of ids (taken as they are: no BOS added), ``n_predict``,
  ``temperature: 0`` (greedy), ``ignore_eos``; the answer carries ``tokens_predicted`` and ``timings``
  (``prompt_n``, ``predicted_n``, the server's own milliseconds);
- prefixcache's ``POST /v1/completions``: ``prompt`` a list of ids, ``max_tokens``, ``temperature: 0``,
  ``ignore_eos`` (vLLM's field); the answer's ``usage``.

Both are timed alike on the client's wall clock (:func:`time.perf_counter`, request sent to answer read) over an
``http.client`` connection with TCP_NODELAY, so the figures are the servers', not a client library's.  Not streamed:
both servers hold back a token whose text ends inside a UTF-8 character and send it with the next, so the events of
a stream do not tell which token was made when; ``bench llamacpp`` takes a decode step's time as the difference of
two requests on the same cached context (``n`` tokens and one) instead.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass

from prefixcache.errors import InvalidArgumentError

__all__ = ["LLAMA_CPP", "PREFIXCACHE", "REQUEST_TIMEOUT_S", "Completion", "timed_completion"]

REQUEST_TIMEOUT_S = 600.0
LLAMA_CPP = "llama.cpp"
PREFIXCACHE = "prefixcache"


@dataclass(frozen=True, slots=True)
class Completion:
    """A timed completion: ``seconds`` (request sent to answer read), ``tokens`` generated and ``prompt_tokens`` as
    the server counted them, ``cached_tokens`` of the prompt it reused where it says (llama.cpp's ``cache_n``,
    prefixcache's ``cached_tokens``), and llama.cpp's own ``server_timings`` (None for prefixcache)."""

    seconds: float
    tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None = None
    server_timings: dict | None = None


def request_body(kind: str, prompt: list[int], max_tokens: int) -> tuple[str, dict]:
    """``(path, body)`` of a greedy completion of ``max_tokens`` tokens (end of sequence ignored) for the server of
    ``kind``.  Raises InvalidArgumentError for another kind."""
    if kind == LLAMA_CPP:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True}
        return "/completion", {**body, "cache_prompt": True, "stream": False}
    if kind == PREFIXCACHE:
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        return "/v1/completions", body
    raise InvalidArgumentError(f"unknown server kind {kind!r}; choose {LLAMA_CPP!r} or {PREFIXCACHE!r}")


def timed_completion(kind: str, port: int, prompt: list[int], max_tokens: int) -> Completion:
    """Send ``prompt`` (token ids) to the server of ``kind`` (``"llama.cpp"`` or ``"prefixcache"``) on 127.0.0.1
    ``port`` for ``max_tokens`` greedy tokens and time it.

    Raises InvalidArgumentError: an unknown kind, an answer other than 200 (its body in the message), or another
    number of tokens than asked for."""
    path, body = request_body(kind, prompt, max_tokens)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.connect()
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = json.dumps(body).encode()
        start = time.perf_counter()
        connection.request("POST", path, payload, {"Content-Type": "application/json"})
        response = connection.getresponse()
        raw = response.read()
        seconds = time.perf_counter() - start
    finally:
        connection.close()
    if response.status != 200:
        raise InvalidArgumentError(f"{kind} answered {response.status}: {raw[:500]!r}")
    answer = json.loads(raw)
    if kind == LLAMA_CPP:
        timings = answer.get("timings") or {}
        tokens, prompt_tokens, cached = (
            answer.get("tokens_predicted", -1),
            timings.get("prompt_n"),
            timings.get("cache_n"),
        )
        done = Completion(seconds, tokens, prompt_tokens, cached, timings)
    else:
        usage = answer.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        done = Completion(seconds, usage.get("completion_tokens", -1), usage.get("prompt_tokens"), cached)
    if done.tokens != max_tokens:
        raise InvalidArgumentError(f"{kind} generated {done.tokens} tokens where {max_tokens} were asked for")
    return done
