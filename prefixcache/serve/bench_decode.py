"""Per-token decode time served against in-process (``prefixcache bench serve``'s third table).

The same long greedy generations (``ignore_eos``, so every run makes all its tokens) run on one server's
:class:`~prefixcache.engine.batching.BatchEngine`, interleaved in one process: in-process (submitted to the engine
directly, each token timed in ``on_token`` on the engine thread) and served (a streamed ``/v1/completions`` request
over HTTP on 127.0.0.1, each token timed as its SSE event reaches the client).  A run's per-token time is the mean gap
between its first and last token (the prefill and the first token left out), in milliseconds; the figure is the
median over runs, for one stream at a time and for a few concurrent streams (one batched decode step per token).
The client is a plain ``http.client`` connection per stream reading lines, so its own cost per token stays small
against the server's.  Goal (issue 30): served within 3% of in-process.

On a loaded machine the wall-time ratio is as noisy as the load (the quartiles of the per-pair ratios say how
much), so two load-proof figures come with it: the CPU time of the engine's own thread per token, read through its
POSIX CPU clock at the same tokens (what the server adds to the engine's steps: detokenizing, posting the events,
handing the GIL over), and the CPU time the whole process adds per token served (event loop, client, engine).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.engine.sampling import SamplingParams
from prefixcache.models.llama import build_model
from prefixcache.serve.app import create_app
from prefixcache.serve.server import start_background

__all__ = ["GOAL_RATIO", "decode_figures"]

GOAL_RATIO = 1.03
"""Served per-token time / in-process per-token time must stay below this."""

PROMPT_TOKENS = 64

ASCII_ONLY = {token: -100.0 for token in range(128, 259)}
"""A logit bias that keeps the ``small`` preset's byte tokenizer to ASCII (and off its special ids): every token is
one text delta, so the client can tell tokens apart by their SSE events."""


class _Clocks:
    """Two clocks read at every token: wall time and the CPU time of the engine's thread (readable from any thread
    through its POSIX CPU clock, so the client's threads read it too)."""

    def __init__(self, engine: Any) -> None:
        self._engine_cpu = time.pthread_getcpuclockid(engine.call_soon(threading.get_ident).result())

    def stamp(self) -> tuple[float, float]:
        return time.perf_counter(), time.clock_gettime(self._engine_cpu)


def _per_token_ms(stamps: list[tuple[float, float]]) -> tuple[float, float]:
    """(wall, engine CPU) ms per token: the mean gap between the first and the last of ``stamps``."""
    gaps = len(stamps) - 1
    return tuple((stamps[-1][k] - stamps[0][k]) / gaps * 1e3 for k in (0, 1))  # type: ignore[return-value]


def _prompt(vocab_size: int, salt: int) -> list[int]:
    # A different prompt every run: nothing cached, each run prefills its own prompt and decodes from the same length.
    return [32 + (7 * i + 13 * salt) % 95 for i in range(PROMPT_TOKENS)]


def _in_process(engine: Any, clocks: _Clocks, prompts: list[list[int]], new_tokens: int) -> list[tuple[float, float]]:
    """Per-token (wall, engine CPU) ms of each of ``prompts`` submitted together to ``engine``, timed on the engine
    thread."""
    handles, stamps = [], []
    for prompt in prompts:
        times: list[tuple[float, float]] = []
        stamps.append(times)
        sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, logit_bias=ASCII_ONLY)
        handles.append(engine.submit(prompt, sampling, on_token=lambda _, t=times: t.append(clocks.stamp())))
    for handle in handles:
        handle.future.result()
    return [_per_token_ms(times) for times in stamps]


def _served_one(
    host: str, port: int, clocks: _Clocks, prompt: list[int], new_tokens: int, stamps: list[tuple[float, float]]
) -> None:
    body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "stream": True, "ignore_eos": True}
    body["logit_bias"] = {str(token): bias for token, bias in ASCII_ONLY.items()}
    connection = http.client.HTTPConnection(host, port, timeout=120)
    connection.connect()
    connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        for line in response:
            if line.startswith(b'data: {"id"'):
                stamps.append(clocks.stamp())
    finally:
        connection.close()


def _served(
    host: str, port: int, clocks: _Clocks, prompts: list[list[int]], new_tokens: int
) -> list[tuple[float, float]]:
    """Per-token (wall, engine CPU) ms of each of ``prompts`` streamed at once over HTTP, one client thread each,
    timed on arrival."""
    stamps: list[list[tuple[float, float]]] = [[] for _ in prompts]
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            _served_one(host, port, clocks, prompts[i], new_tokens, stamps[i])
        except BaseException as error:  # noqa: BLE001 - raised after the run
            errors.append(error)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    # The last event with text is the finishing chunk's predecessor: keep one stamp per generated token.
    return [_per_token_ms(times[:new_tokens]) for times in stamps]


def _pairs(runs: int, measure: Callable[[str, int], Any]) -> tuple[list[Any], list[Any]]:
    """``runs`` interleaved pairs (ABBA order) of ``measure(mode, run)``, one warm-up pair first."""
    local, remote = [], []
    for i in range(runs + 1):
        order = ("local", "served") if i % 2 == 0 else ("served", "local")
        figures = {mode: measure(mode, i) for mode in order}
        if i > 0:
            local.append(figures["local"])
            remote.append(figures["served"])
    return local, remote


def decode_figures(
    quick: bool = False, model: Any = None, *, runs: int | None = None, new_tokens: int | None = None
) -> dict[str, Any]:
    """Per-token decode ms in-process and served, one stream and ``concurrent`` streams, with their ratios, on the
    embedded ``small`` preset (or ``model``): ``quick`` 6 pairs of 48 new tokens, else 24 pairs of 96.  Short runs,
    many pairs: load from other processes drifts over seconds, and a pair of short runs sees the same load.  ``runs``
    (at least 2) and ``new_tokens`` (at least 2) override the sizes."""
    model = model if model is not None else build_model("small", device="cpu")
    concurrent = 4
    runs = runs if runs is not None else 6 if quick else 24
    new_tokens = new_tokens if new_tokens is not None else 48 if quick else 96
    runner = PrefixCachingRunner(model, cache_tokens=(PROMPT_TOKENS + new_tokens + 32) * concurrent * 2)
    app = create_app(runner, model_name="bench")
    engine = app.state.engine
    vocab = runner.tokenizer.vocab_size
    load_before = os.getloadavg()[0]
    out: dict[str, Any] = {"new_tokens": new_tokens, "runs": runs, "concurrent": concurrent}
    clocks = _Clocks(engine)
    with start_background(app) as server:
        for streams, key in ((1, "single"), (concurrent, "concurrent")):

            def measure(mode: str, run: int, streams: int = streams) -> tuple[float, float, float]:
                prompts = [
                    _prompt(vocab, 1000 * streams + 10 * run + j + (mode == "served") * 500) for j in range(streams)
                ]
                cpu = time.process_time()
                if mode == "local":
                    per_stream = _in_process(engine, clocks, prompts, new_tokens)
                else:
                    per_stream = _served(server.host, server.port, clocks, prompts, new_tokens)
                cpu_per_token_ms = (time.process_time() - cpu) / (streams * new_tokens) * 1e3
                wall, engine_cpu = (statistics.mean(figures[k] for figures in per_stream) for k in (0, 1))
                return wall, engine_cpu, cpu_per_token_ms

            local, remote = _pairs(runs, measure)
            pairs = list(zip(local, remote, strict=True))
            out[f"{key}_in_process_ms"] = statistics.median(lo[0] for lo in local)
            out[f"{key}_served_ms"] = statistics.median(r[0] for r in remote)
            ratios = sorted(r[0] / lo[0] for lo, r in pairs)
            out[f"{key}_ratio"] = statistics.median(ratios)
            out[f"{key}_ratio_quartiles"] = tuple(statistics.quantiles(ratios, n=4, method="inclusive")[::2])
            out[f"{key}_engine_cpu_in_process_ms"] = statistics.median(lo[1] for lo in local)
            out[f"{key}_engine_cpu_served_ms"] = statistics.median(r[1] for r in remote)
            out[f"{key}_engine_cpu_ratio"] = statistics.median(r[1] / lo[1] for lo, r in pairs)
            out[f"{key}_added_cpu_ms"] = statistics.median(r[2] - lo[2] for lo, r in pairs)
    engine.close()
    out["load_average_1m"] = (load_before + os.getloadavg()[0]) / 2
    return out
