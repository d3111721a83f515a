"""``bench serve``'s decode table: its client in a process of its own, and the window its per-token times come from."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from prefixcache.testing import require_extra as require

require("fastapi", "server")
require("httpx", "server")

from prefixcache import PrefixCachingRunner  # noqa: E402
from prefixcache.bench import serve_client, serve_decode  # noqa: E402
from prefixcache.errors import InvalidArgumentError  # noqa: E402
from prefixcache.serve import create_app, start_background  # noqa: E402


@pytest.fixture
def bench_app(tiny):
    """An app over a fresh runner on the ``tiny`` model (4,096 tokens) served as ``bench``; its engine closed after."""
    app = create_app(PrefixCachingRunner(tiny, cache_tokens=4096), model_name="bench")
    yield app
    app.state.engine.close()


def test_a_stream_admitted_late_is_timed_only_while_every_stream_decodes() -> None:
    # Stream a decodes a token every 10 ms, but its third gap holds b's prefill (40 ms); b starts at 0.050 s and ends
    # before a.  Inside the window [0.050, 0.080] both decode every 10 ms; the engine CPU clock moves 8 ms a token.
    a = [(t, t * 0.8) for t in (0.000, 0.010, 0.050, 0.060, 0.070, 0.080, 0.090, 0.100)]
    b = [(t, t * 0.8) for t in (0.050, 0.060, 0.070, 0.080)]
    (a_wall, a_cpu), (b_wall, b_cpu) = serve_decode._per_token_ms([a, b])
    assert a_wall == pytest.approx(10.0) and b_wall == pytest.approx(10.0)
    assert a_cpu == pytest.approx(8.0) and b_cpu == pytest.approx(8.0)
    # One stream alone: its whole run, the prefill's gap included only if it lies between its tokens.
    assert serve_decode._per_token_ms([a])[0][0] == pytest.approx(100.0 / 7)


def test_streams_that_barely_overlap_are_refused_rather_than_timed() -> None:
    a = [(0.00, 0.0), (0.01, 0.0), (0.02, 0.0)]
    b = [(0.02, 0.0), (0.03, 0.0), (0.04, 0.0)]
    with pytest.raises(RuntimeError, match="decoded together for 1 token"):
        serve_decode._per_token_ms([a, b])


def test_the_engine_cpu_reader_reads_a_thread_s_run_time_and_none_for_a_missing_thread() -> None:
    if not os.path.exists(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat"):
        pytest.skip("no /proc/<pid>/task/<tid>/schedstat here (not Linux)")
    read = serve_client.engine_cpu_reader(os.getpid(), threading.get_native_id())
    before = read()
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:  # 50 ms of this thread's CPU time
        pass
    after = read()
    assert before is not None and after is not None
    assert 0.04 <= after - before < 5.0
    assert serve_client.engine_cpu_reader(os.getpid(), 2**22 + 12345)() is None


def test_the_client_process_streams_every_token_and_reports_a_refused_body(bench_app) -> None:
    app = bench_app
    engine = app.state.engine
    with start_background(app, "127.0.0.1", 0) as server:
        engine_thread = engine.call_soon(threading.get_native_id).result()
        client = serve_decode._ClientProcess(server.host, server.port, os.getpid(), engine_thread)
        try:
            bodies = [serve_decode._body(serve_decode._prompt(salt), 12) for salt in (1, 2)]
            streams = client.run(bodies)
            assert len(streams) == 2
            for stamps in streams:
                # One event per token (the ASCII-only bias), then the finishing chunk's.
                assert len(stamps) == 13
                walls = [wall for wall, _ in stamps]
                assert walls == sorted(walls) and walls[-1] - walls[0] < 60
                cpus = [cpu for _, cpu in stamps]
                if sys.platform.startswith("linux"):
                    assert all(cpu is not None for cpu in cpus) and cpus == sorted(cpus)
            # The client's own CPU time in the run: some, and less than the run's wall time on its two threads.
            assert 0 < client.cpu_s < 2 * max(stamps[-1][0] - stamps[0][0] for stamps in streams) + 1
            # A body the server refuses (400) is the run's error; the client then serves the next run.
            bad = serve_decode._body(serve_decode._prompt(3), 12) | {"max_tokens": -1}
            with pytest.raises(RuntimeError, match="HTTP 400"):
                client.run([bad])
            assert len(client.run(bodies[:1])[0]) == 13
        finally:
            client.close()
        assert client._process.returncode == 0


def test_a_client_that_died_is_an_error_not_a_hang_and_closes_quietly() -> None:
    client = serve_decode._ClientProcess("127.0.0.1", 9, os.getpid(), 1)
    client._process.kill()
    client._process.wait()
    with pytest.raises(RuntimeError, match="client exited with"):
        client.run([serve_decode._body([65, 66], 2)])
    client.close()  # the unsent line still buffered for the dead client is dropped, not raised
    client.close()
    with pytest.raises(RuntimeError, match="client was closed"):
        client.run([serve_decode._body([65, 66], 2)])


def test_the_client_process_imports_neither_the_package_nor_torch() -> None:
    probe = serve_client.LAUNCH.replace(
        "sys.exit(module.main(sys.argv[2:]))",
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prefixcache', 'torch', 'fastapi')))",
    )
    assert probe != serve_client.LAUNCH
    out = subprocess.run(
        [sys.executable, "-c", probe, serve_client.__file__], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def _canned_server(chunks: list[bytes], byte_by_byte: bool) -> tuple[int, threading.Thread]:
    """A one-connection HTTP server on 127.0.0.1 that answers 200 with ``chunks`` as a chunked body, then closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener, listener.accept()[0] as conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            head, _, body = request.partition(b"\r\n\r\n")
            length = int(
                next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            )
            while len(body) < length:
                body += conn.recv(65536)
            answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            answer += b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks)
            # The client stops reading at [DONE] and closes: the rest of a byte-by-byte answer may meet a reset.
            with contextlib.suppress(ConnectionError):
                for piece in (answer[i : i + 1] for i in range(len(answer))) if byte_by_byte else (answer,):
                    conn.sendall(piece)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


def _event(text: str) -> bytes:
    return b'data: {"id":"cmpl-1","choices":[{"text":%s}]}\n\n' % json.dumps(text).encode()


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_the_client_counts_each_event_once_however_its_bytes_arrive(byte_by_byte) -> None:
    # A token whose text spells an event start is escaped by JSON, so it is not an event start.
    chunks = [_event("a"), _event('data: {"id"'), _event("c"), b"data: [DONE]\n\n"]
    port, thread = _canned_server(chunks, byte_by_byte)
    clock = iter(range(1000))
    assert len(serve_client.stream("127.0.0.1", port, {"prompt": [1]}, lambda: next(clock))) == 3
    thread.join(5)


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([_event("a"), b'data: {"error": {"message": "engine stopped"}}\n\n', b"data: [DONE]\n\n"], "failed after 1"),
        ([_event("a"), _event("b")], "ended after 2 event\\(s\\), before its \\[DONE\\]"),
        ([], "ended after 0 event"),
        # A token whose text spells the end is not the end: markers count only at the start of a line.
        ([_event("a"), _event("data: [DONE]")], "ended after 2 event"),
        ([b"x" * (2 * serve_client.MAX_LINE_BYTES)], "a line of over 1,048,576 bytes"),
    ],
)
def test_a_stream_that_fails_or_stops_short_is_an_error_not_a_figure(chunks, message) -> None:
    port, thread = _canned_server(chunks, byte_by_byte=False)
    with pytest.raises(RuntimeError, match=message):
        serve_client.stream("127.0.0.1", port, {"prompt": [1]}, time.perf_counter)
    thread.join(5)


def test_a_stream_with_fewer_tokens_than_asked_is_refused() -> None:
    body = serve_decode._body([65, 66], 4)
    stamps = [(float(i), 0.0) for i in range(5)]
    assert serve_decode._tokens(stamps, body) == stamps[:4]
    with pytest.raises(RuntimeError, match="made 3 of its 4 tokens"):
        serve_decode._tokens(stamps[:3], body)
    # Served, the finishing chunk's event follows the last token's: four events are three tokens and the finish.
    assert serve_decode._tokens(stamps, body, 1) == stamps[:4]
    with pytest.raises(RuntimeError, match="made 3 of its 4 tokens"):
        serve_decode._tokens(stamps[:4], body, 1)


@pytest.mark.parametrize("sizes", [{"runs": 1}, {"new_tokens": 1}, {"runs": 2.5}, {"new_tokens": True}])
def test_decode_figures_refuses_sizes_it_cannot_time_before_building_anything(sizes) -> None:
    with pytest.raises(InvalidArgumentError, match="must be an int of at least 2"):
        serve_decode.decode_figures(model=object(), **sizes)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["127.0.0.1", "80", "1"],
        ["127.0.0.1", "http", "1", "2"],
        ["h", "1", "2", "-3"],
        ["h", "1", "\u00b2", "1"],  # a digit to str.isdigit, not to int()
        ["h", "\u0661\u0662", "1", "1"],  # Arabic-Indic digits
        ["h", "70000", "1", "1"],  # no such port
        ["h", "80", "99999999999999999999", "1"],
    ],
)
def test_wrong_arguments_get_a_usage_line_and_exit_status_2(argv: list[str], capsys) -> None:
    assert serve_client.main(argv) == 2
    assert "usage: serve_client HOST PORT SERVER_PID ENGINE_THREAD_ID" in capsys.readouterr().err
