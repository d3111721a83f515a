"""The ``serve`` benchmark (``prefixcache bench serve``): what the HTTP layer costs, and that it loses no cache hits.

1. Overhead per request: the same one-token chat request on the ``tiny`` model, in-process (rendered and submitted
   to the server's own :class:`~prefixcache.engine.batching.BatchEngine` with :func:`submit_chat`, waiting on its
   future: the server's path minus HTTP) and through a uvicorn server on 127.0.0.1 (a keep-alive ``http.client``
   connection with TCP_NODELAY, so the figure is the server's cost, not a client library's), interleaved in one
   process (in-process, HTTP, HTTP, in-process, ...) so that load on the machine hits both alike.  The overhead is
   the median of the per-pair differences, in wall time and in CPU time of the whole process (every thread: client,
   event loop, engine); the CPU figure is the one to trust on a loaded machine, where wall time adds every wait for
   a core.  The 1-minute load average is printed with it.  Goal: < 2 ms p50.
2. tau-bench through HTTP: 16 concurrent streaming clients, each replaying its own conversations turn by turn (the
   prompt is the transcript so far, with the tools; one token generated), against the same 16 clients in-process
   (threads submitting the same chat requests with :func:`submit_chat` to a batching engine with the server's
   settings, no HTTP), and against one client in-process (serial ``runner.chat``).  With a cache large enough that
   nothing is evicted, the hit tokens differ only through requests overlapping in time (see the table's note); HTTP
   and in-process at the same concurrency must agree up to timing, and no request may fail.
3. Per-token decode time served against in-process: long greedy streams on the ``small`` preset, one at a time and
   a few together (:mod:`prefixcache.bench.serve_decode`), and (full run, where ``../shared`` holds the Qwen config)
   on an embedded model of Qwen2.5-0.5B's 24 layers with the ``small`` preset's vocabulary (the shape of issue 30's
   profile, where a token took 312 ms served against 270 in-process, without the 151,936-row LM head, which the byte
   tokenizer cannot decode).  Each model is measured twice: with the engine on a thread of the server's process
   (``create_app`` over a runner, ``serve --no-engine-process``) and with the engine in a process of its own
   (``prefixcache serve``'s default, :class:`~prefixcache.engine.process.EngineProcess`), where the event loop's work
   per token no longer holds the engine's GIL.  Goal: served within 3% of in-process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import torch

from prefixcache.bench.common import BenchResult, Table, verdict
from prefixcache.bench.policy import DATA_DIR
from prefixcache.bench.serve_decode import GOAL_RATIO, decode_figures
from prefixcache.engine.batching import BatchEngine
from prefixcache.engine.chat import prepare_chat, submit_chat
from prefixcache.engine.chat_decoder import ChatCompletion
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.models.llama import PRESETS, build_model
from prefixcache.replay.scenarios import default_tools_for, load_scenario
from prefixcache.serve.app import create_app
from prefixcache.serve.server import start_background

__all__ = ["run"]

GOAL_OVERHEAD_MS = 2.0
CLIENTS = 16
WARM_UP = 10
TAU_BENCH = DATA_DIR / "tau_bench_airline_gpt4o.jsonl"
MESSAGES = [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Hi"}]
ENGINE_PROCESS = "engine in its own process"
"""How the decode tables with the engine in a process of its own name it."""


def _timed(call) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process) of ``call()``."""
    cpu, wall = time.process_time(), time.perf_counter()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def _overhead(num_requests: int) -> dict[str, float]:
    model = build_model("tiny", device="cpu")
    app = create_app(PrefixCachingRunner(model, cache_tokens=1 << 14), model_name="tiny")
    engine, tokenizer = app.state.engine, app.state.runner.tokenizer
    body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    load_before = os.getloadavg()[0]
    with start_background(app) as server:
        connection = http.client.HTTPConnection(server.host, server.port, timeout=60)
        connection.connect()
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def over_http() -> None:
            connection.request("POST", "/v1/chat/completions", body, headers)
            response = connection.getresponse()
            answer = json.loads(response.read())
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {answer}")

        def in_process() -> None:
            submit_chat(engine, prepare_chat(tokenizer, MESSAGES, max_new_tokens=1))[1].result()

        local, remote = [], []
        for i in range(num_requests + WARM_UP):
            # Alternate the order (ABBA) so that neither side always runs right after the other's wake-ups.
            pair = (in_process, over_http) if i % 2 == 0 else (over_http, in_process)
            times = {call: _timed(call) for call in pair}
            if i >= WARM_UP:
                local.append(times[in_process])
                remote.append(times[over_http])
        connection.close()
    engine.close()

    def p50_ms(values) -> float:
        return statistics.median(values) * 1e3

    return {
        "requests": num_requests,
        "load_average_1m": (load_before + os.getloadavg()[0]) / 2,
        "in_process_p50_ms": p50_ms(w for w, _ in local),
        "http_p50_ms": p50_ms(w for w, _ in remote),
        "overhead_p50_ms": p50_ms(r[0] - lo[0] for lo, r in zip(local, remote, strict=True)),
        "in_process_cpu_p50_ms": p50_ms(c for _, c in local),
        "http_cpu_p50_ms": p50_ms(c for _, c in remote),
        "overhead_cpu_p50_ms": p50_ms(r[1] - lo[1] for lo, r in zip(local, remote, strict=True)),
    }


def _turns(conversations: Sequence[Any], max_turns: int | None) -> list[list[tuple[list[dict], list | None]]]:
    """Per conversation, the (prompt messages, tools) of each assistant turn, at most ``max_turns`` of them."""
    out = []
    for conversation in conversations:
        turns = [(list(conversation.messages[:i]), conversation.tools) for i in conversation.assistant_turns]
        out.append(turns[:max_turns])
    return out


async def _client(http: httpx.AsyncClient, conversations: list, usage: list[dict]) -> None:
    for turns in conversations:
        for messages, tools in turns:
            body = {"model": "tiny", "messages": messages, "max_tokens": 1, "stream": True}
            body |= {"stream_options": {"include_usage": True}} | ({"tools": tools} if tools else {})
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise RuntimeError(chunk["error"]["message"])
                        if chunk.get("usage"):
                            usage.append(chunk["usage"])


def _hit_rate(usages: Sequence[Any]) -> tuple[int, int]:
    return sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages), sum(u["prompt_tokens"] for u in usages)


def _in_process_concurrent(runner: PrefixCachingRunner, per_conversation: list) -> tuple[list[dict], float]:
    """The HTTP replay without HTTP: ``CLIENTS`` threads, each submitting its conversations' turns one after another
    to one :class:`BatchEngine` with the server's settings (what the server does with each request, streamed text
    included), one token each."""
    engine = BatchEngine(runner)
    engine.start()
    usages: list[dict] = []
    errors: list[BaseException] = []

    def ask(messages: list[dict], tools: list | None) -> ChatCompletion:
        prepared = prepare_chat(runner.tokenizer, messages, tools, max_new_tokens=1)
        return submit_chat(engine, prepared, on_delta=lambda text: None)[1].result()

    def client(share: list) -> None:
        try:
            for turns in share:
                for messages, tools in turns:
                    usages.append(ask(messages, tools).usage.to_openai())
        except BaseException as error:  # noqa: BLE001 - reported after the replay
            errors.append(error)

    threads = [threading.Thread(target=client, args=(per_conversation[i::CLIENTS],)) for i in range(CLIENTS)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    engine.close()
    if errors:
        raise errors[0]
    return usages, elapsed


def _tau_bench(num_conversations: int, max_turns: int | None) -> dict[str, Any] | None:
    if not TAU_BENCH.is_file():
        return None
    scenario = load_scenario(TAU_BENCH, tools=default_tools_for(TAU_BENCH))
    return _replay_three_ways(_turns(scenario.conversations[:num_conversations], max_turns))


def _replay_three_ways(per_conversation: list[list[tuple[list[dict], list | None]]]) -> dict[str, Any]:
    """Replay ``per_conversation`` (per conversation, its turns' (messages, tools)) serially in-process, with
    ``CLIENTS`` threads in-process, and with ``CLIENTS`` streaming HTTP clients; each on a fresh cache that holds
    everything.  Raises what a request raised."""
    model = build_model("tiny", device="cpu")
    runner = PrefixCachingRunner(model, cache_tokens=1)
    # Every cached sequence is a prompt, a prefix of its conversation's last prompt: their sum (plus a block each)
    # holds everything, so nothing is evicted and the hit count depends only on which requests overlap in time.
    render = runner.tokenizer.render_chat
    total_tokens = sum(len(render(*turns[-1])) + 16 * len(turns) for turns in per_conversation if turns)

    def fresh() -> PrefixCachingRunner:
        return PrefixCachingRunner(model, cache_tokens=total_tokens)

    serial = fresh()
    start = time.perf_counter()
    local = [serial.chat(m, t, max_new_tokens=1).usage.to_openai() for turns in per_conversation for m, t in turns]
    serial_s = time.perf_counter() - start
    concurrent, concurrent_s = _in_process_concurrent(fresh(), per_conversation)

    app = create_app(fresh(), model_name="tiny")
    remote: list[dict] = []

    async def replay(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=None) as http_client:
            shares = [per_conversation[i::CLIENTS] for i in range(CLIENTS)]
            await asyncio.gather(*(_client(http_client, share, remote) for share in shares))

    with start_background(app) as server:
        start = time.perf_counter()
        asyncio.run(replay(server.url))
        http_s = time.perf_counter() - start
    evictions = app.state.runner.cache.stats().evictions
    app.state.engine.close()
    prompt_tokens = _hit_rate(local)[1]
    return {
        "conversations": len(per_conversation),
        "requests": len(local),
        "http_requests_ok": len(remote),
        "prompt_tokens": prompt_tokens,
        "serial_hit_tokens": _hit_rate(local)[0],
        "in_process_hit_tokens": _hit_rate(concurrent)[0],
        "http_hit_tokens": _hit_rate(remote)[0],
        "serial_hit_rate": _hit_rate(local)[0] / prompt_tokens,
        "in_process_hit_rate": _hit_rate(concurrent)[0] / prompt_tokens,
        "http_hit_rate": _hit_rate(remote)[0] / prompt_tokens,
        "serial_s": serial_s,
        "in_process_s": concurrent_s,
        "http_s": http_s,
        "evictions": evictions,
    }


def run(quick: bool = False) -> BenchResult:
    """Run the three measurements: 300 request pairs, 32 tau-bench conversations of at most 6 turns, and 24 pairs of
    96-token decodes (``quick``: 30 pairs, 16 conversations of at most 2 turns, 6 pairs of 48 tokens)."""
    overhead = _overhead(30 if quick else 300)
    tau = _tau_bench(16 if quick else 32, 2 if quick else 6)
    # Each model twice: the engine on a thread of the server's process (create_app over a runner), then in a process
    # of its own (serve's default), where the event loop never holds the engine's GIL.
    decodes = [("small preset", decode_figures(quick))]
    decodes.append((f"small preset, {ENGINE_PROCESS}", decode_figures(quick, engine_process=True)))
    qwen_layers = None if quick else qwen_layers_config()
    if qwen_layers is not None:  # seeded random weights, 1.4 GB, built where the engine runs
        decodes.append((qwen_layers.name, decode_figures(model=qwen_layers, runs=20, new_tokens=24)))
        figures = decode_figures(model=qwen_layers, runs=20, new_tokens=24, engine_process=True)
        decodes.append((f"{qwen_layers.name}, {ENGINE_PROCESS}", figures))
    overhead_verdict = verdict(overhead["overhead_p50_ms"] < GOAL_OVERHEAD_MS, quick)
    tables = [
        Table(
            "serve: HTTP overhead per request (tiny model, one-token chat, 127.0.0.1, interleaved pairs)",
            (
                "requests",
                "load avg 1m",
                "in-process p50 ms",
                "HTTP p50 ms",
                "overhead p50 ms",
                "CPU in-process ms",
                "CPU HTTP ms",
                "CPU overhead ms",
                f"goal < {GOAL_OVERHEAD_MS} ms",
            ),
            (
                (
                    overhead["requests"],
                    overhead["load_average_1m"],
                    overhead["in_process_p50_ms"],
                    overhead["http_p50_ms"],
                    overhead["overhead_p50_ms"],
                    overhead["in_process_cpu_p50_ms"],
                    overhead["http_cpu_p50_ms"],
                    overhead["overhead_cpu_p50_ms"],
                    overhead_verdict,
                ),
            ),
            (
                "overhead = median of per-pair differences; CPU = process CPU time (all threads, the client's "
                f"included) per request; with a load average above the {os.cpu_count()} cores, wall time adds a "
                "wait for a core at every thread hand-off",
            ),
        )
    ]
    if tau is None:
        title = f"serve: tau-bench, {CLIENTS} concurrent streaming clients over HTTP vs {CLIENTS} in-process vs serial"
        tables.append(Table(title, ("conversations",), (), (f"skipped {TAU_BENCH.name}: not found in {DATA_DIR}",)))
    else:
        notes = (
            "HTTP and in-process x16 run on batching engines with the server's settings (prefix-aware admission: a "
            "prompt is cached once prefilled, and a request sharing a prefix still being prefilled waits for it); "
            "what concurrency still loses (a partial block, a prefill that overlaps) only arrival timing separates",
        )
        tables.append(
            Table(
                f"serve: tau-bench, {CLIENTS} concurrent streaming clients over HTTP vs {CLIENTS} in-process vs serial",
                (
                    "conversations",
                    "requests",
                    "ok over HTTP",
                    "prompt tokens",
                    "hit tokens serial",
                    f"hit tokens in-process x{CLIENTS}",
                    f"hit tokens HTTP x{CLIENTS}",
                    "hit rate serial / in-process / HTTP",
                    "serial s",
                    "in-process s",
                    "HTTP s",
                ),
                (
                    (
                        tau["conversations"],
                        tau["requests"],
                        tau["http_requests_ok"],
                        tau["prompt_tokens"],
                        tau["serial_hit_tokens"],
                        tau["in_process_hit_tokens"],
                        tau["http_hit_tokens"],
                        " / ".join(f"{tau[k + '_hit_rate']:.3%}" for k in ("serial", "in_process", "http")),
                        tau["serial_s"],
                        tau["in_process_s"],
                        tau["http_s"],
                    ),
                ),
                notes,
            )
        )
    tables.extend(_decode_table(decode, label, quick) for label, decode in decodes)
    if not quick and qwen_layers is None:
        from prefixcache.bench.engine_setup import QWEN_DIR

        title = "serve: per-token decode, in-process vs streamed over HTTP (Qwen2.5-0.5B's 24 layers)"
        tables.append(
            Table(title, ("streams",), (), (f"skipped the 24-layer tables: config.json not found in {QWEN_DIR}",))
        )
    figures = {"overhead": overhead, "tau_bench": tau, "decode": decodes[0][1], "decode_engine_process": decodes[1][1]}
    figures["decode_qwen_layers"] = decodes[2][1] if len(decodes) > 2 else None
    figures["decode_qwen_layers_engine_process"] = decodes[3][1] if len(decodes) > 3 else None
    return BenchResult("serve", tuple(tables), figures)


def qwen_layers_config():
    """The config of the second decode table's model: Qwen2.5-0.5B's 24 layers (``../shared``'s config) with the
    ``small`` preset's vocabulary (512 ids: the byte tokenizer's 259 and padding), or None where ``../shared`` lacks
    the Qwen config."""
    from prefixcache.bench.engine_setup import QWEN_DIR
    from prefixcache.bench.floor_shape import embedded_config

    if not (QWEN_DIR / "config.json").is_file():
        return None
    config = embedded_config(QWEN_DIR, 24)
    name = "Qwen2.5-0.5B's 24 layers, 512-token vocabulary"
    return dataclasses.replace(config, name=name, vocab_size=PRESETS["small"].vocab_size)


def _decode_table(decode: dict[str, Any], label: str, quick: bool = False) -> Table:
    rows = []
    for key, streams in (("single", 1), ("concurrent", decode["concurrent"])):
        ratio = decode[f"{key}_ratio"]
        judged = verdict(ratio < GOAL_RATIO, quick)
        rows.append(
            (
                streams,
                decode[f"{key}_in_process_ms"],
                decode[f"{key}_served_ms"],
                ratio,
                "{:.3f} - {:.3f}".format(*decode[f"{key}_ratio_quartiles"]),
                decode[f"{key}_best_ratio"],
                judged,
                decode[f"{key}_engine_cpu_in_process_ms"],
                decode[f"{key}_engine_cpu_served_ms"],
                decode[f"{key}_engine_cpu_ratio"],
                decode[f"{key}_loop_cpu_ms"],
                decode[f"{key}_client_cpu_ms"],
                decode["runs"],
            )
        )
    return Table(
        f"serve: per-token decode, in-process vs streamed over HTTP ({label}, "
        f"{decode['new_tokens']} new tokens, "
        f"greedy, load avg 1m {decode['load_average_1m']:.2f})",
        (
            "streams",
            "in-process ms/token",
            "served ms/token",
            "served / in-process (pair median)",
            "ratio quartiles",
            "fastest served / fastest in-process",
            f"goal < {GOAL_RATIO}",
            "engine CPU ms/token in-process",
            "engine CPU ms/token served",
            "engine CPU served / in-process",
            "event loop CPU ms/token",
            "client CPU ms/token",
            "pairs",
        ),
        tuple(rows),
        (
            "streamed /v1/completions requests of one shape both ways; per-token = mean gap between a stream's "
            "tokens while every stream of the run decodes (timed on the engine thread in-process, as each SSE event "
            "reaches the client, in its own process, when served); medians over interleaved pairs; ratio (the "
            "goal's) = median of per-pair ratios",
            "engine CPU = CPU time of the engine's thread per token (proof against CPU load, not against a shared "
            "memory bus); event loop and client CPU = the served runs' uvicorn thread and client process, per token "
            "of a stream; the pair median is not the ratio of the two medians beside it: on a shared host a pair's "
            "two runs see the same load, the medians of all runs do not",
            _floor_note(decode),
        ),
    )


def _floor_note(decode: dict[str, Any]) -> str:
    """What a served token costs with no server code at all (:func:`~prefixcache.bench.serve_decode.bare_stream_app`),
    against the in-process token time: the part of the gap no change to the server can remove on this machine."""
    floor_ms = decode["bare_loop_cpu_ms"] + decode["bare_client_cpu_ms"]
    return (
        f"floor: a bare ASGI app on the same uvicorn, streaming one event of a token's size every "
        f"{decode['bare_interval_ms']:.2f} ms to the same client, costs {decode['bare_loop_cpu_ms']:.3f} ms of event "
        f"loop CPU and {decode['bare_client_cpu_ms']:.3f} ms of client CPU an event, {floor_ms:.3f} ms in all: "
        f"{floor_ms / decode['bare_interval_ms']:.1%} of the in-process token time: what any HTTP stream costs on "
        f"this host ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads), "
        + (
            "the event loop's part in the server's process, where it only competes with the engine for a core"
            if decode.get("engine_process")
            else "the event loop's part spent holding the GIL the engine's thread needs"
        )
    )
