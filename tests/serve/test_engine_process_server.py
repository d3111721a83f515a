"""A server over an :class:`~prefixcache.engine.process.EngineProcess` (``create_app(engine_process)``, ``prefixcache
serve --engine-process``): it streams what a server over an in-thread engine streams, reports health and metrics from
the child, answers 503 in OpenAI's error shape once the child is gone, and the CLI's engine child ends with it.  A
stopped child never freezes it (``/health`` within a second throughout, every waiting request a 503 at once, running
streams ended with an error event), and echo with logprobs sends records across the socket, not logits."""

from __future__ import annotations

import functools
import os
import pickle
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from prefixcache import SamplingParams
from prefixcache.engine import process as engine_process_module
from prefixcache.engine.process import EngineProcess
from prefixcache.errors import EngineDeadError
from prefixcache.serve import create_app, start_background
from prefixcache.testing import tiny_runner

FACTORY = functools.partial(tiny_runner, 4096)
QUESTION = [{"role": "system", "content": "Answer briefly. " * 6}, {"role": "user", "content": "What is a cache?"}]
WAIT_S = 120  # a bound on waiting (a hung test fails instead of hanging), never asserted as a duration


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, str, EngineProcess]]:
    """``(url over an engine process, url over an in-thread engine, the engine process)``, both on 127.0.0.1 at free
    ports over identically built runners."""
    process = EngineProcess(FACTORY)
    app = create_app(process, model_name="tiny")
    assert app.state.engine is process and app.state.runner is process
    reference = create_app(FACTORY(), model_name="tiny")
    try:
        with start_background(app, "127.0.0.1", 0) as remote, start_background(reference, "127.0.0.1", 0) as local:
            yield remote.url, local.url, process
    finally:
        reference.state.engine.close()
        process.close()
    assert not process.alive  # the app's shutdown closed it


def streamed_chat(url: str, **options: Any) -> tuple[str, Any, Any]:
    chunks = list(
        client(url).chat.completions.create(
            model="tiny", messages=QUESTION, stream=True, stream_options={"include_usage": True}, **options
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, reasons, chunks[-1].usage


def test_streamed_chat_and_completion_equal_the_in_thread_servers(servers) -> None:
    remote, local, _ = servers
    for options in ({"max_tokens": 20}, {"max_tokens": 20, "logprobs": True, "top_logprobs": 2}):
        text, reasons, usage = streamed_chat(remote, **options)
        expected_text, expected_reasons, expected_usage = streamed_chat(local, **options)
        assert text == expected_text and len(text) > 0
        assert reasons == expected_reasons == ["length"]
        assert usage.completion_tokens == expected_usage.completion_tokens == 20
        assert usage.prompt_tokens == expected_usage.prompt_tokens
        assert usage.prompt_tokens_details.cached_tokens == expected_usage.prompt_tokens_details.cached_tokens

    def completion(url: str, **options: Any) -> tuple[str, list[Any]]:
        stream = client(url).completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=16, stream=True, **options
        )
        chunks = list(stream)
        return "".join(c.choices[0].text for c in chunks if c.choices), [c.choices[0].finish_reason for c in chunks]

    text, reasons = completion(remote)
    assert (text, reasons) == completion(local) and len(text) > 0
    # Two printable ASCII characters (a byte token each) first found past the answer's first third.
    cut_at = next(
        i
        for i in range(len(text) // 3, len(text) - 2)
        if text.index(text[i : i + 2]) == i and all(c.isascii() and c.isprintable() for c in text[i : i + 2])
    )
    stop = text[cut_at : cut_at + 2]
    cut = completion(remote, stop=[stop])
    assert cut == completion(local, stop=[stop])
    assert cut[0] == text[: text.index(stop)] and cut[1][-1] == "stop"


def test_a_plain_answer_equals_the_in_thread_servers(servers) -> None:
    remote, local, _ = servers
    answer = client(remote).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=12)
    expected = client(local).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=12)
    assert answer.choices[0].message.content == expected.choices[0].message.content
    assert answer.choices[0].finish_reason == expected.choices[0].finish_reason
    assert answer.usage.completion_tokens == expected.usage.completion_tokens == 12


def test_health_and_metrics_come_from_the_child(servers) -> None:
    remote, _, process = servers
    assert httpx.get(remote + "/health").json() == {"status": "ok", "model": "tiny", "pending_requests": 0}
    client(remote).completions.create(model="tiny", prompt="Metrics, please", max_tokens=2)
    client(remote).completions.create(model="tiny", prompt="Metrics, please", max_tokens=2)
    metrics = httpx.get(remote + "/metrics").text
    rate = re.search(r"^prefixcache_hit_rate (\S+)$", metrics, re.MULTILINE)
    assert rate is not None
    stats = process.cache.stats()
    assert stats.hit_tokens > 0
    assert float(rate.group(1)) == pytest.approx(stats.hit_rate, rel=1e-6)
    assert f"prefixcache_pool_used_blocks {float(stats.used_blocks)}" in metrics


def test_a_killed_engine_child_makes_the_server_answer_503_in_openais_shape() -> None:
    process = EngineProcess(FACTORY)
    app = create_app(process, model_name="tiny")
    with start_background(app, "127.0.0.1", 0) as server:
        url = server.url
        assert httpx.get(url + "/health").status_code == 200
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S) as stream:
            lines = stream.iter_lines()
            events.append(next(line for line in lines if line.startswith("data:")))  # it runs
            os.kill(process.pid, signal.SIGKILL)
            events += [line for line in lines if line.startswith("data:")]
        assert stream.status_code == 200
        assert '"error"' not in events[0]
        assert events[-1] == "data: [DONE]"
        assert '"type": "server_error"' in events[-2] and "exit code -9" in events[-2]
        with pytest.raises(EngineDeadError):
            process.submit([1, 2, 3])
        metrics = httpx.get(url + "/metrics", timeout=WAIT_S)  # the server's own metrics, the engine marked down
        assert metrics.status_code == 200 and "prefixcache_engine_up 0.0" in metrics.text
        assert 'prefixcache_requests_total{endpoint="/v1/completions",status="503"} 1.0' in metrics.text
        for method, path, json in (
            ("GET", "/health", None),
            ("POST", "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 3}),
            ("POST", "/v1/chat/completions", {"model": "tiny", "messages": QUESTION, "max_tokens": 3}),
        ):
            answer = httpx.request(method, url + path, json=json, timeout=WAIT_S)
            assert answer.status_code == 503, (path, answer.text)
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "server_error" and "exit code -9" in error["message"]
        with pytest.raises(openai.InternalServerError) as raised:
            client(url).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3)
        assert raised.value.status_code == 503
    assert not process.alive
    process.close()  # the app closed it already: idempotent


def test_closing_the_server_cancels_its_engine_process_requests() -> None:
    process = EngineProcess(FACTORY)
    app = create_app(process, model_name="tiny")
    with start_background(app, "127.0.0.1", 0):
        handle = process.submit([1, 2, 3], SamplingParams(max_new_tokens=3000, ignore_eos=True))
    with pytest.raises(CancelledError):
        handle.result(WAIT_S)
    assert not process.alive


def children_of(pid: int) -> dict[int, str]:
    """The live (not zombie) processes whose parent is ``pid``: their ids and command lines, from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(ppid) == pid and state != "Z":
            found[int(entry.name)] = command
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its parent is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_serve_engine_process_answers_and_ends_its_engine_child_on_ctrl_c(cli_processes) -> None:
    command = ["serve", "--engine-process", "--port", "0", "--cache-tokens", "4096", "--max-batch-tokens", "64"]
    process = cli_processes.start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
    assert match is not None, (line, process.stderr.read() if process.poll() is not None else "")
    assert "tokens" in line  # the pool's description, the child's note
    url = match.group(1)
    engines = {pid: cmd for pid, cmd in children_of(process.pid).items() if "process_main" in cmd}
    assert len(engines) == 1, children_of(process.pid)
    (engine_pid,) = engines
    answer = client(url).completions.create(model="tiny", prompt="Hello", max_tokens=4)
    assert answer.usage.completion_tokens == 4
    assert httpx.get(url + "/health").json()["status"] == "ok"
    cli_processes.interrupt(process)
    _, err = process.communicate(timeout=WAIT_S)
    assert process.returncode == 0, err[-2000:]
    assert not running(engine_pid)
    assert not running(process.pid)


def test_a_snapshot_save_stops_waiting_for_an_engine_child_that_stopped_answering(tmp_path: Path, caplog) -> None:
    import asyncio

    from prefixcache.serve.snapshots import SnapshotKeeper
    from prefixcache.testing import require_extra

    require_extra("safetensors", "snapshot")
    process = EngineProcess(FACTORY)
    try:
        keeper = SnapshotKeeper(process, tmp_path / "snap")
        assert asyncio.run(keeper.save(timeout_s=60)) is not None  # a child that answers saves
        os.kill(process.pid, signal.SIGSTOP)
        try:
            with caplog.at_level("ERROR", logger="prefixcache.serve.snapshots"):
                assert asyncio.run(keeper.save(timeout_s=0.5)) is None
        finally:
            os.kill(process.pid, signal.SIGCONT)
        assert keeper.save_errors == 1
        assert any("no answer in 0.5 s; not waiting" in record.getMessage() for record in caplog.records)
    finally:
        process.close()


STOPPED_S = 3.0
"""The answer timeout of the stopped-child tests: the silence after which the child counts as stopped."""


def _error_of(answer: httpx.Response) -> dict[str, Any]:
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_stopped_engine_child_never_freezes_the_server_and_fails_every_waiting_request_at_once() -> None:
    # Issue 44: with the child stopped, a 3 MB prompt blocked the sender holding its lock, /health gave no answer for
    # 90-100 s, a disconnecting client's cancel froze the event loop, three completions got their 503 after 60, 120
    # and 180 s and a running stream got nothing until its client gave up.
    process = EngineProcess(FACTORY, answer_timeout_s=STOPPED_S)
    app = create_app(process, model_name="tiny")
    with start_background(app, "127.0.0.1", 0) as server:
        url = server.url
        streamed: list[str] = []
        streaming = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3000, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        streamed.append(line)
                        streaming.set()
            streamed.append(f"closed after {time.monotonic() - stopped_at:.1f} s")

        answers: dict[str, tuple[float, httpx.Response | None]] = {}

        def post(name: str, body: dict[str, Any], timeout_s: float = WAIT_S) -> None:
            try:
                answer = httpx.post(url + "/v1/completions", json=body, timeout=timeout_s)
            except httpx.TimeoutException:
                answer = None  # the client that gives up and disconnects
            answers[name] = (time.monotonic(), answer)

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        assert streaming.wait(WAIT_S), "the stream never started"
        os.kill(process.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        probes: dict[str, list[tuple[float, int]]] = {"/health": [], "/v1/models": [], "/tokenize": []}
        try:
            big = {"model": "tiny", "prompt": "x" * 3_000_000, "max_tokens": 2}
            small = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
            requests = [(f"big {i}", big) for i in range(2)] + [(f"small {i}", small) for i in range(3)]
            threads = [threading.Thread(target=post, args=request, daemon=True) for request in requests]
            threads.append(threading.Thread(target=post, args=("leaver", small, 0.5), daemon=True))
            for thread in threads:
                thread.start()
            while (any(t.is_alive() for t in threads) or streamer.is_alive()) and time.monotonic() - stopped_at < 30:
                for path in probes:
                    began = time.monotonic()
                    try:
                        if path == "/tokenize":
                            answer = httpx.post(url + path, json={"prompt": "Hello"}, timeout=10)
                        else:
                            answer = httpx.get(url + path, timeout=10)
                        status = answer.status_code
                    except httpx.TimeoutException:
                        status = 0
                    probes[path].append((time.monotonic() - began, status))
                time.sleep(0.1)
            silent_health = httpx.get(url + "/health", timeout=10)
        finally:
            os.kill(process.pid, signal.SIGCONT)
        # /health answered within a second throughout: 200 while the child might be busy, 503 once it was found
        # silent; what needs no engine answered all along.  (1 s bounds a hang; it is not a timing.)
        assert max(seconds for seconds, _ in probes["/health"]) < 1.0, probes["/health"]
        assert {status for _, status in probes["/health"]} <= {200, 503}
        assert silent_health.status_code == 503
        assert "did not answer within 3.0 s" in _error_of(silent_health)["message"]
        for path in ("/v1/models", "/tokenize"):
            # Under one answer_timeout_s: never queued behind a submit waiting on the child (a loaded CI machine has
            # taken 2.5 s to tokenize here while the large bodies were parsed).
            assert max(seconds for seconds, _ in probes[path]) < 3.0, (path, probes[path])
            assert {status for _, status in probes[path]} == {200}
        # Every waiting request failed at once, with the 503 of OpenAI's error shape.
        failed = {name: answers[name] for name, _ in requests}
        for _, answer in failed.values():
            assert answer is not None and answer.status_code == 503, answer and answer.text
            assert _error_of(answer)["type"] == "server_error"
            assert "did not answer within 3.0 s" in _error_of(answer)["message"]
        times = [at for at, _ in failed.values()]
        assert max(times) - min(times) < 1.0, [at - stopped_at for at in times]
        assert max(times) - stopped_at < 3 * STOPPED_S, [at - stopped_at for at in times]
        # The running stream ended with an error event in OpenAI's shape, then [DONE].
        assert streamed[-1].startswith("closed after"), streamed[-3:]
        assert streamed[-2] == "data: [DONE]"
        assert '"type": "server_error"' in streamed[-3] and "did not answer within 3.0 s" in streamed[-3]
        # Continued, the child is heard again and the server serves on.
        deadline = time.monotonic() + WAIT_S
        while httpx.get(url + "/health", timeout=WAIT_S).status_code != 200:
            assert time.monotonic() < deadline, "the continued child was never heard again"
            time.sleep(0.1)
        assert client(url).completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    process.close()


def test_echo_with_logprobs_sends_records_across_the_socket_not_the_prompts_logits(monkeypatch) -> None:
    # Issue 44: the child sent every prompt position's logits ([n, vocab] float32: 869 MB for 1,500 tokens of a
    # 151,936-token vocabulary) though only the top entries of each row were used.
    crossed: list[int] = []

    def counted(conn: Any) -> Any:
        data = conn.recv_bytes()
        crossed.append(len(data))
        return pickle.loads(data)

    monkeypatch.setattr(engine_process_module, "receive_message", counted)
    process = EngineProcess(FACTORY)
    app = create_app(process, model_name="tiny")
    with start_background(app, "127.0.0.1", 0) as server:
        ids = process.tokenizer.encode("The weather in Paris is mild in spring. " * 38)[:1500]
        assert len(ids) == 1500
        crossed.clear()
        body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1}
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
        assert answer.status_code == 200, answer.text
        logprobs = answer.json()["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == 1501
        assert logprobs["token_logprobs"][0] is None and all(v <= 0 for v in logprobs["token_logprobs"][1:])
        logits_bytes = 1500 * 512 * 4  # what crossed before: the tiny model's [1500, 512] float32 logits
        assert sum(crossed) < 150_000 < logits_bytes // 20, sum(crossed)  # ~1,500 records of a token and its top 1
    process.close()


def test_metrics_answer_at_once_while_the_child_is_stopped_and_hold_one_thread_for_its_figures() -> None:
    # A scrape used to wait for the child's cache stats for up to answer_timeout_s on a worker of the event loop's
    # default pool, three round trips in a row; scrapes that came meanwhile each held a worker of their own.
    process = EngineProcess(FACTORY, answer_timeout_s=2 * STOPPED_S)  # not found silent while the scrapes run
    app = create_app(process, model_name="tiny")
    app.state.metrics.figures_timeout_s = 0.5
    with start_background(app, "127.0.0.1", 0) as server:
        url = server.url
        answered = httpx.get(url + "/metrics", timeout=WAIT_S).text
        assert "prefixcache_engine_up 1.0" in answered and "prefixcache_hit_rate" in answered
        before = {thread.ident for thread in threading.enumerate()}
        scrapes: list[tuple[float, httpx.Response]] = []

        def scrape() -> None:
            began = time.monotonic()
            answer = httpx.get(url + "/metrics", timeout=WAIT_S)
            scrapes.append((time.monotonic() - began, answer))

        os.kill(process.pid, signal.SIGSTOP)
        try:
            threads = [threading.Thread(target=scrape, daemon=True) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(WAIT_S)
            workers = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("asyncio_")]
        finally:
            os.kill(process.pid, signal.SIGCONT)
        assert len(scrapes) == 8
        assert max(seconds for seconds, _ in scrapes) < 0.5 + 1.5, scrapes  # a bound on a hang, not a timing
        for _, answer in scrapes:
            assert answer.status_code == 200
            # The server's own counters, and the engine marked down with its figures left out (not stale ones).
            assert "prefixcache_engine_up 0.0" in answer.text and "prefixcache_requests_total" in answer.text
            assert "prefixcache_hit_rate" not in answer.text and "prefixcache_cancelled_requests" not in answer.text
        assert workers == [], workers  # the one worker the first scrape started, shared by all eight
        deadline = time.monotonic() + WAIT_S
        while "prefixcache_engine_up 1.0" not in httpx.get(url + "/metrics", timeout=WAIT_S).text:
            assert time.monotonic() < deadline, "the continued child's figures never came back"
            time.sleep(0.1)
    process.close()
