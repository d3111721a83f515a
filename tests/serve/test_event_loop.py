"""One large request does not freeze the server: ``/health`` answers within 100 ms while a 60 MB body and prompts of
a million tokens are being processed, by a real ``prefixcache serve`` on 127.0.0.1.

A client sends ``GET /health`` every 50 ms on a fixed schedule, each probe on its own (not waiting for the ones
before it), and a probe's latency counts from when it was due, as a load balancer probing on its own clock sees
it: a stalled event loop makes every probe due during the stall late.  The 60 MB body (chunked, so the server reads
up to its 32 MiB limit before refusing it) is answered 413; the million-token prompts (three chat transcripts of
20,000 turns, five token-id prompts for completions: bodies of 1.9 and 4.9 MB, under the limit) are parsed,
checked, rendered and tokenized, then refused as longer than the tiny model's 32,768 positions, all off the event
loop.  On a loaded machine a probe may wait for a core, so the test asserts the order (probes keep being answered
while the large requests are in flight) and the latency of the median probe, and prints every figure.  Today's
main fails it (median 138-212 ms at load 3 on 2 cores: the checks and the rendering ran on the loop); this
branch's median was 13-27 ms.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest

PROBE_EVERY_S = 0.050
BOUND_S = 0.100
PROMPT_TOKENS = 1_000_000
BIG_BODY_BYTES = 60_000_000


@pytest.fixture
def server_url():
    """``prefixcache serve`` (the tiny model, 8,192 tokens of KV, the default 32 MiB body limit) in its own process
    on 127.0.0.1 at a free port, so that the probing client never competes with it for Python's lock."""
    command = [sys.executable, "-m", "prefixcache", "serve", "--port", "0", "--cache-tokens", "8192"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        yield re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line).group(1)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)


async def _probing(url: str, stop: threading.Event, probes: list[tuple[float, float]]) -> None:
    """Send ``GET /health`` every ``PROBE_EVERY_S`` until ``stop``, each on its own without waiting for the ones
    before it: each probe's (due time, done time)."""

    async def probe(due: float) -> None:
        response = await client.get("/health", timeout=120)
        assert response.status_code == 200 and response.json()["status"] == "ok"
        probes.append((due, time.perf_counter()))

    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=256)) as client:
        tasks, due = [], time.perf_counter()
        while not stop.is_set():
            tasks.append(asyncio.ensure_future(probe(due)))
            due += PROBE_EVERY_S
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
        await asyncio.gather(*tasks)


def _chunks(payload: bytes, size: int = 1 << 20):
    for start in range(0, len(payload), size):
        yield payload[start : start + size]


def test_health_answers_within_100_ms_while_a_60_mb_body_and_million_token_prompts_are_processed(server_url) -> None:
    url = server_url
    # An agent's transcript of 20,000 turns, a million tokens with the byte tokenizer (one token a byte).
    turn = "the weather in Paris is mild today, said the tool "
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": f"{turn}{i:05d}"} for i in range(PROMPT_TOKENS // 50)]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 1}
    ids = {"model": "tiny", "prompt": [i % 250 for i in range(PROMPT_TOKENS)], "max_tokens": 1}
    big = json.dumps({**chat, "messages": [{"role": "user", "content": "x" * BIG_BODY_BYTES}]}).encode()
    requests = {  # name -> (path, body), built before anything is timed
        "60 MB body": ("/v1/chat/completions", big),
        **{f"1M-token chat {i}": ("/v1/chat/completions", json.dumps(chat).encode()) for i in range(3)},
        **{f"1M-token completion {i}": ("/v1/completions", json.dumps(ids).encode()) for i in range(5)},
    }
    answers: dict[str, tuple[float, float, int, str]] = {}

    def send(name: str, path: str, body: bytes) -> None:
        started = time.perf_counter()
        content = _chunks(body) if name == "60 MB body" else body
        answer = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=300)
        answers[name] = (started, time.perf_counter(), answer.status_code, answer.text)

    probes: list[tuple[float, float]] = []
    stop = threading.Event()
    prober = threading.Thread(target=lambda: asyncio.run(_probing(url, stop, probes)))
    prober.start()
    time.sleep(0.2)  # a baseline of probes before the load
    senders = [threading.Thread(target=send, args=(name, *request)) for name, request in requests.items()]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(300)
    stop.set()
    prober.join(60)

    assert answers["60 MB body"][2] == 413, answers["60 MB body"][3]
    for name in requests:
        if name != "60 MB body":
            status, message = answers[name][2], answers[name][3]
            assert status == 400 and "exceed the model's maximum of 32768 positions" in message, (name, message)
    metrics = httpx.get(url + "/metrics").text
    assert re.search(r"^prefixcache_cached_tokens 0\.0$", metrics, re.M), "a refused request reached the cache"
    begin = min(started for started, *_ in answers.values())
    end = max(done for _, done, *_ in answers.values())
    completed = [done - due for due, done in probes if due >= begin and done <= end]
    late = sorted(done - due for due, done in probes if begin <= due <= end)
    figures = (
        f"{len(late)} probes due while the large requests were in flight ({end - begin:.2f} s), {len(completed)} "
        f"answered before they ended; latency from when due: median {1000 * statistics.median(late):.1f} ms, "
        f"p90 {1000 * late[int(0.9 * (len(late) - 1))]:.1f} ms, max {1000 * late[-1]:.1f} ms; "
        + ", ".join(f"{name} {done - started:.2f} s" for name, (started, done, *_) in answers.items())
    )
    print(figures)
    assert len(completed) >= 5, f"the event loop stalled: {figures}"
    assert statistics.median(late) <= BOUND_S, f"/health was slow while large requests were processed: {figures}"
