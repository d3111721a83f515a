"""The ``serve`` benchmark (``prefixcache bench serve``): what the HTTP layer costs, and that it loses no cache hits.

1. Overhead per request: the same one-token chat request on the ``tiny`` model, in-process (``runner.chat``) and
   through a uvicorn server on 127.0.0.1 (``httpx``, one connection kept alive); the p50 difference is what the HTTP
   layer, JSON, the event loop and the model-thread hand-off add.  Goal: < 2 ms p50.
2. tau-bench through HTTP: 16 concurrent streaming clients, each replaying its own conversations turn by turn (the
   prompt is the transcript so far, with the tools; one token generated), against the same requests sent in-process
   one at a time (only the first turns of each conversation: prefill on the tiny model bounds the size).  With a
   cache large enough that nothing is evicted, the number of prompt tokens served from the cache does not depend on
   the order of the requests, so the two hit rates must agree (up to requests overlapping in time, see the table's
   note) and no request may fail.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import httpx

from prefixcache.bench.common import BenchResult, Table
from prefixcache.bench.policy import DATA_DIR
from prefixcache.engine.runner import PrefixCachingRunner
from prefixcache.models.llama import build_model
from prefixcache.replay.scenarios import default_tools_for, load_scenario
from prefixcache.serve.app import create_app
from prefixcache.serve.server import start_background

__all__ = ["run"]

GOAL_OVERHEAD_MS = 2.0
CLIENTS = 16
TAU_BENCH = DATA_DIR / "tau_bench_airline_gpt4o.jsonl"
MESSAGES = [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Hi"}]


def _overhead(num_requests: int) -> dict[str, float]:
    model = build_model("tiny", device="cpu")
    runner = PrefixCachingRunner(model, cache_tokens=1 << 14)
    in_process = []
    for _ in range(num_requests):
        start = time.perf_counter()
        runner.chat(MESSAGES, max_new_tokens=1)
        in_process.append(time.perf_counter() - start)
    app = create_app(PrefixCachingRunner(model, cache_tokens=1 << 14), model_name="tiny")
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}
    over_http = []
    with start_background(app) as server, httpx.Client(base_url=server.url) as http:
        for _ in range(num_requests + 5):
            start = time.perf_counter()
            response = http.post("/v1/chat/completions", json=body)
            over_http.append(time.perf_counter() - start)
            response.raise_for_status()
    app.state.worker.close()
    del over_http[:5]  # connection setup and first-request warm-up
    in_p50, http_p50 = statistics.median(in_process) * 1e3, statistics.median(over_http) * 1e3
    return {
        "requests": num_requests,
        "in_process_p50_ms": in_p50,
        "http_p50_ms": http_p50,
        "overhead_p50_ms": http_p50 - in_p50,
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


def _tau_bench(num_conversations: int, max_turns: int | None) -> dict[str, Any] | None:
    if not TAU_BENCH.is_file():
        return None
    scenario = load_scenario(TAU_BENCH, tools=default_tools_for(TAU_BENCH))
    per_conversation = _turns(scenario.conversations[:num_conversations], max_turns)
    model = build_model("tiny", device="cpu")
    runner = PrefixCachingRunner(model, cache_tokens=1)
    # Every cached sequence is a prompt, a prefix of its conversation's last prompt: their sum (plus a block each)
    # holds everything, so nothing is evicted and the hit count does not depend on the order of the requests.
    render = runner.tokenizer.render_chat
    total_tokens = sum(len(render(*turns[-1])) + 16 * len(turns) for turns in per_conversation if turns)
    runner = PrefixCachingRunner(model, cache_tokens=total_tokens)
    start = time.perf_counter()
    local = [runner.chat(m, t, max_new_tokens=1).usage.to_openai() for turns in per_conversation for m, t in turns]
    in_process_s = time.perf_counter() - start

    app = create_app(PrefixCachingRunner(model, cache_tokens=total_tokens), model_name="tiny")
    remote: list[dict] = []

    async def replay(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=None) as http:
            shares = [per_conversation[i::CLIENTS] for i in range(CLIENTS)]
            await asyncio.gather(*(_client(http, share, remote) for share in shares))

    with start_background(app) as server:
        start = time.perf_counter()
        asyncio.run(replay(server.url))
        http_s = time.perf_counter() - start
    evictions = app.state.runner.cache.stats().evictions
    app.state.worker.close()
    local_hits, local_tokens = _hit_rate(local)
    remote_hits, remote_tokens = _hit_rate(remote)
    return {
        "conversations": len(per_conversation),
        "requests": len(local),
        "http_requests_ok": len(remote),
        "prompt_tokens": local_tokens,
        "in_process_hit_tokens": local_hits,
        "http_hit_tokens": remote_hits,
        "in_process_hit_rate": local_hits / local_tokens,
        "http_hit_rate": remote_hits / remote_tokens if remote_tokens else 0.0,
        "in_process_s": in_process_s,
        "http_s": http_s,
        "evictions": evictions,
    }


def run(quick: bool = False) -> BenchResult:
    """Run both measurements: 300 requests, and 32 tau-bench conversations of at most 6 turns (``quick``: 30 requests,
    16 conversations of at most 2 turns)."""
    overhead = _overhead(30 if quick else 300)
    tau = _tau_bench(16 if quick else 32, 2 if quick else 6)
    verdict = "met" if overhead["overhead_p50_ms"] < GOAL_OVERHEAD_MS else "not met"
    tables = [
        Table(
            "serve: HTTP overhead per request (tiny model, one-token chat, 127.0.0.1)",
            ("requests", "in-process p50 ms", "HTTP p50 ms", "overhead p50 ms", f"goal < {GOAL_OVERHEAD_MS} ms"),
            (
                (
                    overhead["requests"],
                    overhead["in_process_p50_ms"],
                    overhead["http_p50_ms"],
                    overhead["overhead_p50_ms"],
                    verdict,
                ),
            ),
        )
    ]
    if tau is not None:
        notes = (
            "hit tokens differ only when a request arrives while another sharing its prefix is still in flight: a "
            "prompt is inserted into the tree when its request finishes (SGLang inserts it right after prefill)",
        )
        tables.append(
            Table(
                f"serve: tau-bench through HTTP, {CLIENTS} concurrent streaming clients vs in-process, one at a time",
                (
                    "conversations",
                    "requests",
                    "ok over HTTP",
                    "prompt tokens",
                    "hit rate in-process",
                    "hit rate HTTP",
                    "hit tokens diff",
                    "in-process s",
                    "HTTP s",
                ),
                (
                    (
                        tau["conversations"],
                        tau["requests"],
                        tau["http_requests_ok"],
                        tau["prompt_tokens"],
                        tau["in_process_hit_rate"],
                        tau["http_hit_rate"],
                        tau["http_hit_tokens"] - tau["in_process_hit_tokens"],
                        tau["in_process_s"],
                        tau["http_s"],
                    ),
                ),
                notes,
            )
        )
    return BenchResult("serve", tuple(tables), {"overhead": overhead, "tau_bench": tau})
