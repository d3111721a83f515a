"""Per-token decode time served against in-process (``prefixcache bench serve``'s third table).

Streamed ``/v1/completions`` requests of one shape (greedy, ``ignore_eos``, so every run makes all its tokens; a
64-token prompt that differs from the recent runs', see :func:`_prompt`) run on one server's
:class:`~prefixcache.engine.batching.BatchEngine`, alternating between two ways:

- in-process: the body parsed and its completion prepared as the server does, then :func:`submit_chat` straight to
  the engine, each token timed as its text delta is made on the engine thread;
- served: over HTTP on 127.0.0.1 by a client in its own process (:mod:`prefixcache.bench.serve_client`; an HTTP
  client is another process in any deployment, and in this one its threads would take the GIL from the engine's),
  each token timed as its SSE event reaches the client.

A stream's per-token time is the mean gap between its tokens in milliseconds, counted only while every stream of the
run is decoding (see :func:`_per_token_ms`: a request that reaches the server a few milliseconds after another is
prefilled in the other's steps, which is prefill time, not decode time); a row's figure is the median over the runs,
for one stream at a time and for a few concurrent streams (one batched decode step per token).  Goal (issue 30):
served within 3% of in-process.

On a shared machine the wall-time ratio is as noisy as the load from other tenants (the quartiles of the per-pair
ratios say how much, and the fastest runs' ratio comes with them), so CPU-time figures come with it: the CPU time
of the engine's own thread per token (read at the same tokens: through its POSIX CPU clock in-process, through Linux's
``/proc/<pid>/task/<tid>/schedstat`` from the client), and the served runs' event loop and client CPU per token, with
the same two for a bare ASGI app streaming at the same pace (:func:`bare_stream_app`, the floor).  None is proof
against a memory bus shared with other tenants: a stalled load costs CPU time too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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

from prefixcache.bench import serve_client
from prefixcache.engine.chat import prepare_completion, submit_chat
from prefixcache.engine.process import EngineProcess
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.errors import InvalidArgumentError
from prefixcache.models.base import ModelConfig
from prefixcache.models.llama import LlamaModel, build_model
from prefixcache.serve.app import create_app
from prefixcache.serve.protocol import completion_response, parse_completion_request
from prefixcache.serve.server import start_background

__all__ = ["GOAL_RATIO", "bare_stream_app", "decode_figures"]

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
    """The served runs' client (:mod:`prefixcache.bench.serve_client`) in its own process, started once: each run
    sends it the request bodies and reads back every stream's (wall, engine CPU) stamps (the engine's thread
    ``engine_thread_id`` of process ``engine_pid``)."""

    def __init__(self, host: str, port: int, engine_pid: int, engine_thread_id: int) -> None:
        command = [sys.executable, "-c", serve_client.LAUNCH, serve_client.__file__, host, str(port)]
        command += [str(engine_pid), str(engine_thread_id)]
        self._process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.cpu_s = math.nan
        """The client process's own CPU time (seconds, all its threads) in the last run."""

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
        self.cpu_s = answer["cpu_s"]
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


def _thread_cpu_reader(thread_id: int) -> Callable[[], float]:
    """The CPU time (seconds) thread ``thread_id`` of this process has run, NaN where Linux's schedstat is missing."""
    read = serve_client.engine_cpu_reader(os.getpid(), thread_id)
    return lambda: math.nan if (seconds := read()) is None else seconds


def _summary(key: str, local: list[Any], remote: list[Any]) -> dict[str, Any]:
    """The figures of one row from its pairs of (wall ms, engine CPU ms, event loop CPU ms, client CPU ms) per
    token."""
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
        f"{key}_loop_cpu_ms": statistics.median(r[2] for r in remote),
        f"{key}_client_cpu_ms": statistics.median(r[3] for r in remote),
        f"{key}_best_ratio": min(r[0] for r in remote) / min(lo[0] for lo in local),
        f"{key}_pairs_ms": [(lo[0], r[0]) for lo, r in pairs],
    }


def bench_runner(model: Any, cache_tokens: int) -> PrefixCachingRunner:
    """The runner of a decode table: ``model`` a preset name or a :class:`~prefixcache.models.base.ModelConfig`
    (seeded random weights), a pool of ``cache_tokens``.  Module-level, so that an engine process builds it."""
    built = build_model(model, device="cpu") if isinstance(model, str) else LlamaModel(model, device="cpu")
    return PrefixCachingRunner(built, cache_tokens=cache_tokens)


def decode_figures(
    quick: bool = False,
    model: Any = None,
    *,
    runs: int | None = None,
    new_tokens: int | None = None,
    engine_process: bool = False,
) -> dict[str, Any]:
    """Per-token decode ms in-process and served, one stream and ``concurrent`` streams, with their ratios, on the
    embedded ``small`` preset (or ``model``: a model, a preset name or a ``ModelConfig``): ``quick`` 6 pairs of 48
    new tokens, else 24 pairs of 96.  Short runs, many pairs: load from other processes drifts over seconds, and a
    pair of short runs sees the same load.  ``runs`` (at least 2) and ``new_tokens`` (at least 2) override the sizes.
    With ``engine_process`` the server's engine runs in its own process
    (:class:`~prefixcache.engine.process.EngineProcess`; ``model`` then a preset name or a config, built there), and
    the in-process runs are submitted there, straight to its engine.  Raises ``InvalidArgumentError`` for smaller
    sizes or a model object with ``engine_process``, and ``RuntimeError`` when the concurrent streams shared fewer
    than two tokens (too few new tokens for the steps between their arrivals) or the client failed."""
    runs = runs if runs is not None else 6 if quick else 24
    new_tokens = new_tokens if new_tokens is not None else 48 if quick else 96
    for name, value in (("runs", runs), ("new_tokens", new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise InvalidArgumentError(f"{name} must be an int of at least 2, got {value!r}")
    model = model if model is not None else "small"
    concurrent = 4
    cache_tokens = (PROMPT_TOKENS + new_tokens + 32) * concurrent * 2
    built_here = isinstance(model, (str, ModelConfig))
    if engine_process and not built_here:
        raise InvalidArgumentError("an engine process builds its model: give a preset name or a ModelConfig")
    if engine_process:
        served: Any = EngineProcess(functools.partial(bench_runner, model, cache_tokens))
    elif built_here:
        served = bench_runner(model, cache_tokens)
    else:
        served = PrefixCachingRunner(model, cache_tokens=cache_tokens)
    app = create_app(served, model_name="bench")
    engine = app.state.engine
    if engine_process:  # the in-process runs are submitted in the engine process, straight to its engine
        engine_pid, engine_thread = served.pid, served.engine_thread_id

        def in_process(bodies: list[dict[str, Any]]) -> list[tuple[float, float]]:
            return served.query(_in_process_here, bodies, timeout_s=600.0)

    else:
        engine_pid, engine_thread = os.getpid(), engine.call_soon(threading.get_native_id).result()

        def in_process(bodies: list[dict[str, Any]]) -> list[tuple[float, float]]:
            return _in_process_here(engine, bodies)

    load_before = os.getloadavg()[0]
    out: dict[str, Any] = {"new_tokens": new_tokens, "runs": runs, "concurrent": concurrent}
    out["engine_process"] = engine_process
    try:
        with start_background(app) as server:
            client = _ClientProcess(server.host, server.port, engine_pid, engine_thread)
            loop_cpu = _thread_cpu_reader(server.thread.native_id)
            try:
                for streams, key in ((1, "single"), (concurrent, "concurrent")):

                    def measure(mode: str, run: int, streams: int = streams) -> tuple[float, ...]:
                        salt = 1000 * streams + 10 * run + (mode == "served") * 500
                        bodies = [_body(_prompt(salt + j), new_tokens) for j in range(streams)]
                        loop = loop_cpu()
                        if mode == "local":
                            per_stream, client_cpu = in_process(bodies), 0.0
                        else:
                            per_stream, client_cpu = _served(client, bodies), client.cpu_s
                        per_token_ms = 1e3 / (streams * new_tokens)
                        spent = (loop_cpu() - loop, client_cpu)
                        wall, engine_cpu = (statistics.mean(figures[k] for figures in per_stream) for k in (0, 1))
                        return wall, engine_cpu, *(seconds * per_token_ms for seconds in spent)

                    out.update(_summary(key, *_pairs(runs, measure)))
            finally:
                client.close()
        out.update(_bare_stream(out["single_in_process_ms"], new_tokens, 3 if quick else 8))
    finally:
        engine.close()
    out["load_average_1m"] = (load_before + os.getloadavg()[0]) / 2
    return out


def _in_process_here(engine: Any, bodies: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """:func:`_in_process` on ``engine``, in whichever process it steps (an engine process runs it through
    :meth:`EngineProcess.query`)."""
    return _in_process(engine, engine.runner.tokenizer, _Clocks(engine), bodies)


def bare_stream_app(interval_s: float, event: bytes, finish: bytes) -> Callable[..., Any]:
    """A bare ASGI app (no FastAPI, no engine) that answers every request, whatever its path, with a stream of
    ``max_tokens`` (from its JSON body; 400 unless an int in 0..2**20) copies of ``event``, one every ``interval_s``
    seconds, then ``finish``: the pace set by a thread that hands each event to the event loop as the engine's
    mailbox does (one ``call_soon_threadsafe`` and a queue).  What uvicorn, the loop and a streaming client cost per
    event with no server code at all: the floor under a served token."""

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"].removeprefix("lifespan.")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            count = json.loads(body)["max_tokens"]
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= 1 << 20:
                raise ValueError(count)
        except (ValueError, KeyError, TypeError):
            await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": b"max_tokens: an int in 0..2**20", "more_body": False})
            return
        loop, ready = asyncio.get_running_loop(), asyncio.Queue()

        def pace() -> None:
            due = time.perf_counter()
            for i in range(count + 1):
                due += interval_s
                time.sleep(max(0.0, due - time.perf_counter()))
                try:
                    loop.call_soon_threadsafe(ready.put_nowait, event if i < count else None)
                except RuntimeError:  # the server stopped (its loop closed) before the stream ended
                    return

        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        threading.Thread(target=pace, name="bare-stream-pace", daemon=True).start()
        while (item := await ready.get()) is not None:
            await send({"type": "http.response.body", "body": item, "more_body": True})
        await send({"type": "http.response.body", "body": finish, "more_body": False})

    return app


def _bare_stream(interval_ms: float, new_tokens: int, runs: int) -> dict[str, float]:
    """The event loop's and the client's CPU per event (ms) streaming from :func:`bare_stream_app`, one event every
    ``interval_ms`` (the in-process token time), events as large as a served token's: medians of ``runs`` runs of
    ``new_tokens`` events, one stream each."""
    request_id = "cmpl-" + "0" * 32
    event = f"data: {json.dumps(completion_response(request_id, 'bench', 'x', None, None))}\n\n".encode()
    finish = completion_response(request_id, "bench", "", "length", None)
    finish_bytes = f"data: {json.dumps(finish)}\n\ndata: [DONE]\n\n".encode()
    loop_figures, client_figures = [], []
    with start_background(bare_stream_app(interval_ms / 1e3, event, finish_bytes)) as server:  # type: ignore[arg-type]
        client = _ClientProcess(server.host, server.port, os.getpid(), server.thread.native_id)
        loop_cpu = _thread_cpu_reader(server.thread.native_id)
        try:
            for _ in range(runs + 1):  # the first run warms up
                before = loop_cpu()
                _tokens(client.run([_body([65], new_tokens)])[0], {"max_tokens": new_tokens}, 1)
                loop_figures.append((loop_cpu() - before) / new_tokens * 1e3)
                client_figures.append(client.cpu_s / new_tokens * 1e3)
        finally:
            client.close()
    return {
        "bare_loop_cpu_ms": statistics.median(loop_figures[1:]),
        "bare_client_cpu_ms": statistics.median(client_figures[1:]),
        "bare_interval_ms": interval_ms,
    }
