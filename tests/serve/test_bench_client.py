"""``bench serve``'s decode table: its client in a process of its own, and the window its per-token times come from."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from prefixcache import PrefixCachingRunner
from prefixcache.errors import InvalidArgumentError
from prefixcache.serve import bench_client, bench_decode
from prefixcache.serve.server import start_background


def test_a_stream_admitted_late_is_timed_only_while_every_stream_decodes() -> None:
    # Stream a decodes a token every 10 ms, but its third gap holds b's prefill (40 ms); b starts at 0.050 s and ends
    # before a.  Inside the window [0.050, 0.080] both decode every 10 ms; the engine CPU clock moves 8 ms a token.
    a = [(t, t * 0.8) for t in (0.000, 0.010, 0.050, 0.060, 0.070, 0.080, 0.090, 0.100)]
    b = [(t, t * 0.8) for t in (0.050, 0.060, 0.070, 0.080)]
    (a_wall, a_cpu), (b_wall, b_cpu) = bench_decode._per_token_ms([a, b])
    assert a_wall == pytest.approx(10.0) and b_wall == pytest.approx(10.0)
    assert a_cpu == pytest.approx(8.0) and b_cpu == pytest.approx(8.0)
    # One stream alone: its whole run, the prefill's gap included only if it lies between its tokens.
    assert bench_decode._per_token_ms([a])[0][0] == pytest.approx(100.0 / 7)


def test_streams_that_barely_overlap_are_refused_rather_than_timed() -> None:
    a = [(0.00, 0.0), (0.01, 0.0), (0.02, 0.0)]
    b = [(0.02, 0.0), (0.03, 0.0), (0.04, 0.0)]
    with pytest.raises(RuntimeError, match="decoded together for 1 token"):
        bench_decode._per_token_ms([a, b])


def test_the_engine_cpu_reader_reads_a_thread_s_run_time_and_none_for_a_missing_thread() -> None:
    if not os.path.exists(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat"):
        pytest.skip("no /proc/<pid>/task/<tid>/schedstat here (not Linux)")
    read = bench_client.engine_cpu_reader(os.getpid(), threading.get_native_id())
    before = read()
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:  # 50 ms of this thread's CPU time
        pass
    after = read()
    assert before is not None and after is not None
    assert 0.04 <= after - before < 5.0
    assert bench_client.engine_cpu_reader(os.getpid(), 2**22 + 12345)() is None


def test_the_client_process_streams_every_token_and_reports_a_refused_body(make_app, tiny_model) -> None:
    runner = PrefixCachingRunner(tiny_model, cache_tokens=4096)
    app = make_app(runner, model_name="bench")
    engine = app.state.engine
    with start_background(app, "127.0.0.1", 0) as server:
        engine_thread = engine.call_soon(threading.get_native_id).result()
        client = bench_decode._ClientProcess(server.host, server.port, engine_thread)
        try:
            bodies = [bench_decode._body(bench_decode._prompt(0, salt), 12) for salt in (1, 2)]
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
            # A body the server refuses (400) is the run's error; the client then serves the next run.
            bad = bench_decode._body(bench_decode._prompt(0, 3), 12) | {"max_tokens": -1}
            with pytest.raises(RuntimeError, match="HTTP 400"):
                client.run([bad])
            assert len(client.run(bodies[:1])[0]) == 13
        finally:
            client.close()
        assert client._process.returncode == 0


def test_a_client_that_died_is_an_error_not_a_hang() -> None:
    client = bench_decode._ClientProcess("127.0.0.1", 9, 1)
    client._process.kill()
    client._process.wait()
    with pytest.raises(RuntimeError, match="client exited with"):
        client.run([bench_decode._body([65, 66], 2)])


@pytest.mark.parametrize("sizes", [{"runs": 1}, {"new_tokens": 1}, {"runs": 2.5}, {"new_tokens": True}])
def test_decode_figures_refuses_sizes_it_cannot_time_before_building_anything(sizes) -> None:
    with pytest.raises(InvalidArgumentError, match="must be an int of at least 2"):
        bench_decode.decode_figures(model=object(), **sizes)
