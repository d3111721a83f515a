"""Per-token decode time served against in-process (``prefixcache bench serve``'s third table).

Streamed ``/v1/completions`` requests of one shape (greedy, ``ignore_eos``, so every run makes all its tokens; a
64-token prompt that differs from the recent runs', see :func:`_prompt`) run on one server's
:class:`~prefixcache.engine.batching.BatchEngine`, alternating between two ways:

- in-process: the body parsed and its completion prepared as the server does, then :func:`submit_chat` straight to
  the engine, each token timed as its text delta is made on the engine thread;
- served: over HTTP on 127.0.0.1 by a client in its own process (:mod:`prefixcache.serve.bench_client`; an HTTP
  client is another process in any deployment, and in this one its threads would take the GIL from the engine's),
  each token timed as its SSE event reaches the client.

A stream's per-token time is the mean gap between its tokens in milliseconds, counted only while every stream of the
run is decoding (see :func:`_per_token_ms`: a request that reaches the server a few milliseconds after another is
prefilled in the other's steps, which is prefill time, not decode time); a row's figure is the median over the runs,
for one stream at a time and for a few concurrent streams (one batched decode step per token).  Goal (issue 30):
served within 3% of in-process.

On a shared machine the wall-time ratio is as noisy as the load from other tenants (the quartiles of the per-pair
ratios say how much, and the fastest runs' ratio comes with them), so two CPU-time figures come with it: the CPU time
of the engine's own thread per token (read at the same tokens: through its POSIX CPU clock in-process, through Linux's
``/proc/<pid>/task/<tid>/schedstat`` from the client), and the CPU time the server's process adds per token served
(event loop, HTTP, engine).  Neither is proof against a memory bus shared with other tenants: a stalled load costs
CPU time too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from prefixcache.engine.chat import prepare_completion, submit_chat
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.llama import build_model
from prefixcache.serve import bench_client
from prefixcache.serve.app import create_app
from prefixcache.serve.protocol import parse_completion_request
from prefixcache.serve.server import start_background

__all__ = ["GOAL_RATIO", "decode_figures"]

GOAL_RATIO = 1.03
"""Served per-token time / in-process per-token time must stay below this."""

PROMPT_TOKENS = 64

ASCII_ONLY = {token: -100.0 for token in range(128, 259)}
"""A logit bias that keeps the ``small`` preset's byte tokenizer to ASCII (and off its special ids): every token is
one text delta, so the client can tell tokens apart by their SSE events."""


class _Clocks:
    """Two clocks read at every in-process token: wall time and the CPU time of the engine's thread (through its POSIX
    CPU clock)."""

    def __init__(self, engine: Any) -> None:
        self._engine_cpu = time.pthread_getcpuclockid(engine.call_soon(threading.get_ident).result())

    def stamp(self) -> tuple[float, float]:
        return time.perf_counter(), time.clock_gettime(self._engine_cpu)


def _per_token_ms(run: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """(wall, engine CPU) ms per token of each stream of one ``run`` (its streams' stamps, one per token): the mean gap
    between the stamps inside the window where every stream is decoding, from the last stream's first token to the
    first stream's last.  A stream admitted a little later (an HTTP request arrives some milliseconds after another)
    has its prompt prefilled in the others' steps; outside the window, that prefill counts in no stream's decode time.
    Raises ``RuntimeError`` if the streams overlap by fewer than two tokens."""
    start, end = max(stamps[0][0] for stamps in run), min(stamps[-1][0] for stamps in run)
    figures = []
    for stamps in run:
        inside = [stamp for stamp in stamps if start <= stamp[0] <= end]
        if len(inside) < 2:
            raise RuntimeError(f"the streams decoded together for {len(inside)} token(s): too few to time")
        gaps = len(inside) - 1
        figures.append(tuple((inside[-1][k] - inside[0][k]) / gaps * 1e3 for k in (0, 1)))
    return figures  # type: ignore[return-value]


def _prompt(salt: int) -> list[int]:
    # One of 95 prompts: salts less than 95 apart give prompts that differ from their first token (13 is coprime to
    # 95), and salts equal modulo 95 the same one.  A run whose prompt was used before mostly finds it evicted (a full
    # run found one cached, in its untimed warm-up pair); one found cached would only skip its prefill, which is not
    # timed: every run decodes from the same length.
    return [32 + (7 * i + 13 * salt) % 95 for i in range(PROMPT_TOKENS)]


def _body(prompt: list[int], new_tokens: int) -> dict[str, Any]:
    """The streamed ``/v1/completions`` body of one run's stream: both ways run bodies of this shape."""
    body: dict[str, Any] = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "stream": True}
    body["ignore_eos"] = True
    body["logit_bias"] = {str(token): bias for token, bias in ASCII_ONLY.items()}
    return body


def _in_process(
    engine: Any, tokenizer: Any, clocks: _Clocks, bodies: list[dict[str, Any]]
) -> list[tuple[float, float]]:
    """Per-token (wall, engine CPU) ms of each of ``bodies`` submitted together to ``engine`` as the server would (the
    body parsed, its completion prepared, :func:`submit_chat` with a text delta per token), timed on the engine
    thread as each delta is made."""
    handles, stamps = [], []
    for body in bodies:
        times: list[tuple[float, float]] = []
        stamps.append(times)
        request = parse_completion_request(body, tokenizer.vocab_size)
        prepared = prepare_completion(tokenizer, request.prompt, stop=request.stop, **request.sampling)
        handles.append(submit_chat(engine, prepared, on_delta=lambda _, t=times: t.append(clocks.stamp())))
    for _, future in handles:
        future.result()
    return _per_token_ms([_tokens(times, body) for times, body in zip(stamps, bodies, strict=True)])


class _ClientProcess:
    """The served runs' client (:mod:`prefixcache.serve.bench_client`) in its own process, started once: each run
    sends it the request bodies and reads back every stream's (wall, engine CPU) stamps."""

    def __init__(self, host: str, port: int, engine_thread_id: int) -> None:
        command = [sys.executable, "-c", bench_client.LAUNCH, bench_client.__file__, host, str(port)]
        command += [str(os.getpid()), str(engine_thread_id)]
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, bodies: list[dict[str, Any]]) -> list[list[tuple[float, float | None]]]:
        """Each body's stamps, streamed at once.  Raises ``RuntimeError`` if the client failed, died or was closed."""
        assert self._process.stdin is not None and self._process.stdout is not None
        if self._process.stdin.closed:
            raise RuntimeError("the benchmark's client was closed")
        try:
            self._process.stdin.write(json.dumps({"bodies": bodies}) + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            line = ""
        else:
            line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the benchmark's client exited with {self._process.wait()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the benchmark's client failed: {answer['error']}")
        return [[tuple(stamp) for stamp in stamps] for stamps in answer["stamps"]]

    def close(self) -> None:
        """End the client (EOF on its stdin; killed if it has not exited 10 s later).  Idempotent."""
        assert self._process.stdin is not None and self._process.stdout is not None
        with contextlib.suppress(BrokenPipeError):  # a run's line still buffered for a client that died
            self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process.stdout.close()


def _served(client: _ClientProcess, bodies: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Per-token (wall, engine CPU) ms of each of ``bodies`` streamed at once over HTTP by ``client``, timed on
    arrival (engine CPU NaN where the client cannot read it)."""
    run = []
    for stamps, body in zip(client.run(bodies), bodies, strict=True):
        run.append([(wall, math.nan if cpu is None else cpu) for wall, cpu in _tokens(stamps, body, 1)])
    return _per_token_ms(run)


def _tokens(stamps: list[Any], body: dict[str, Any], finish_events: int = 0) -> list[Any]:
    """The first ``max_tokens`` of a stream's stamps, one per token, where ``finish_events`` more must follow (a
    served stream's finishing chunk).  Raises ``RuntimeError`` for fewer."""
    if len(stamps) < body["max_tokens"] + finish_events:
        raise RuntimeError(f"a stream made {len(stamps) - finish_events} of its {body['max_tokens']} tokens")
    return stamps[: body["max_tokens"]]


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


def _summary(key: str, local: list[Any], remote: list[Any]) -> dict[str, Any]:
    """The figures of one row from its pairs of (wall ms, engine CPU ms, process CPU ms) per token."""
    pairs = list(zip(local, remote, strict=True))
    ratios = sorted(r[0] / lo[0] for lo, r in pairs)
    return {
        f"{key}_in_process_ms": statistics.median(lo[0] for lo in local),
        f"{key}_served_ms": statistics.median(r[0] for r in remote),
        f"{key}_ratio": statistics.median(ratios),
        f"{key}_ratio_quartiles": tuple(statistics.quantiles(ratios, n=4, method="inclusive")[::2]),
        f"{key}_engine_cpu_in_process_ms": statistics.median(lo[1] for lo in local),
        f"{key}_engine_cpu_served_ms": statistics.median(r[1] for r in remote),
        f"{key}_engine_cpu_ratio": statistics.median(r[1] / lo[1] for lo, r in pairs),
        f"{key}_added_cpu_ms": statistics.median(r[2] - lo[2] for lo, r in pairs),
        f"{key}_best_ratio": min(r[0] for r in remote) / min(lo[0] for lo in local),
        f"{key}_pairs_ms": [(lo[0], r[0]) for lo, r in pairs],
    }


def decode_figures(
    quick: bool = False, model: Any = None, *, runs: int | None = None, new_tokens: int | None = None
) -> dict[str, Any]:
    """Per-token decode ms in-process and served, one stream and ``concurrent`` streams, with their ratios, on the
    embedded ``small`` preset (or ``model``): ``quick`` 6 pairs of 48 new tokens, else 24 pairs of 96.  Short runs,
    many pairs: load from other processes drifts over seconds, and a pair of short runs sees the same load.  ``runs``
    (at least 2) and ``new_tokens`` (at least 2) override the sizes.  Raises ``InvalidArgumentError`` for smaller
    ones, and ``RuntimeError`` when the concurrent streams shared fewer than two tokens (too few new tokens for the
    steps between their arrivals) or the client failed."""
    runs = runs if runs is not None else 6 if quick else 24
    new_tokens = new_tokens if new_tokens is not None else 48 if quick else 96
    for name, value in (("runs", runs), ("new_tokens", new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise InvalidArgumentError(f"{name} must be an int of at least 2, got {value!r}")
    model = model if model is not None else build_model("small", device="cpu")
    concurrent = 4
    runner = PrefixCachingRunner(model, cache_tokens=(PROMPT_TOKENS + new_tokens + 32) * concurrent * 2)
    app = create_app(runner, model_name="bench")
    engine = app.state.engine
    load_before = os.getloadavg()[0]
    out: dict[str, Any] = {"new_tokens": new_tokens, "runs": runs, "concurrent": concurrent}
    try:
        clocks = _Clocks(engine)
        with start_background(app) as server:
            client = _ClientProcess(server.host, server.port, engine.call_soon(threading.get_native_id).result())
            try:
                for streams, key in ((1, "single"), (concurrent, "concurrent")):

                    def measure(mode: str, run: int, streams: int = streams) -> tuple[float, float, float]:
                        salt = 1000 * streams + 10 * run + (mode == "served") * 500
                        bodies = [_body(_prompt(salt + j), new_tokens) for j in range(streams)]
                        cpu = time.process_time()
                        if mode == "local":
                            per_stream = _in_process(engine, runner.tokenizer, clocks, bodies)
                        else:
                            per_stream = _served(client, bodies)
                        cpu_per_token_ms = (time.process_time() - cpu) / (streams * new_tokens) * 1e3
                        wall, engine_cpu = (statistics.mean(figures[k] for figures in per_stream) for k in (0, 1))
                        return wall, engine_cpu, cpu_per_token_ms

                    out.update(_summary(key, *_pairs(runs, measure)))
            finally:
                client.close()
    finally:
        engine.close()
    out["load_average_1m"] = (load_before + os.getloadavg()[0]) / 2
    return out
