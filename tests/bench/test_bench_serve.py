"""``prefixcache bench serve`` at its smallest: every request succeeds and the figures it prints are consistent."""

from __future__ import annotations

import math

import pytest

from prefixcache.testing import require_extra as require

require("fastapi", "server")
require("httpx", "server")

from prefixcache.bench import serve as bench  # noqa: E402
from prefixcache.errors import InvalidArgumentError  # noqa: E402


def test_overhead_pairs_report_wall_and_cpu_medians() -> None:
    figures = bench._overhead(4)
    assert figures["requests"] == 4
    for key in ("in_process_p50_ms", "http_p50_ms", "in_process_cpu_p50_ms", "http_cpu_p50_ms"):
        assert figures[key] > 0, key
    assert math.isfinite(figures["overhead_p50_ms"]) and math.isfinite(figures["overhead_cpu_p50_ms"])
    assert figures["load_average_1m"] >= 0


def test_the_three_replays_serve_every_turn_and_count_the_same_prompt_tokens() -> None:
    system = {"role": "system", "content": "You answer questions about flights. " * 8}
    conversations = []
    for i in range(20):
        first = [system, {"role": "user", "content": f"Question {i}?"}]
        second = [*first, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And then?"}]
        conversations.append([(first, None), (second, None)])
    figures = bench._replay_three_ways(conversations)
    assert figures["requests"] == 40 and figures["http_requests_ok"] == 40
    assert figures["evictions"] == 0
    # Second turns always find their own first turn; first turns can only race each other for the system prompt.
    for mode in ("serial", "in_process", "http"):
        assert 0 < figures[f"{mode}_hit_tokens"] <= figures["serial_hit_tokens"], mode


def test_the_serial_replay_reuses_everything_but_each_prompt_s_new_part() -> None:
    system = {"role": "system", "content": "You answer questions about flights. " * 8}
    conversations = [[([system, {"role": "user", "content": f"Question {i}?"}], None)] for i in range(3)]
    figures = bench._replay_three_ways(conversations)
    assert figures["serial_hit_rate"] > 0.5
    assert figures["serial_hit_tokens"] >= 2 * len(system["content"])


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine thread", "engine process"])
def test_the_decode_pairs_time_every_token_both_ways(engine_process: bool) -> None:
    from prefixcache.bench.serve_decode import decode_figures
    from prefixcache.models.llama import build_model

    # 32 tokens: four HTTP requests reach the engine some steps apart, and only the steps they share are timed.
    model = "tiny" if engine_process else build_model("tiny", device="cpu")  # an engine process builds its own
    figures = decode_figures(model=model, runs=2, new_tokens=32, engine_process=engine_process)
    assert figures["runs"] == 2 and figures["new_tokens"] == 32 and figures["engine_process"] is engine_process
    keys = ("single", "concurrent")
    for key in keys:
        assert figures[f"{key}_in_process_ms"] > 0 and figures[f"{key}_served_ms"] > 0, key
        low, high = figures[f"{key}_ratio_quartiles"]
        assert 0 < low <= figures[f"{key}_ratio"] <= high, key
        assert [len(pair) for pair in figures[f"{key}_pairs_ms"]] == [2, 2], key
        fastest = min(p[1] for p in figures[f"{key}_pairs_ms"]) / min(p[0] for p in figures[f"{key}_pairs_ms"])
        assert figures[f"{key}_best_ratio"] == pytest.approx(fastest), key
        # Linux: the served runs' uvicorn thread and the client process did work at every token.
        assert 0 < figures[f"{key}_loop_cpu_ms"] < figures[f"{key}_served_ms"], key
        assert 0 < figures[f"{key}_client_cpu_ms"] < figures[f"{key}_served_ms"], key
        # The engine thread's CPU is read in whichever process it runs, both ways.
        assert 0 < figures[f"{key}_engine_cpu_in_process_ms"] and 0 < figures[f"{key}_engine_cpu_served_ms"], key
    assert figures["bare_interval_ms"] == figures["single_in_process_ms"]
    assert figures["bare_loop_cpu_ms"] > 0 and figures["bare_client_cpu_ms"] > 0
    table = bench._decode_table(figures, "tiny preset")
    assert "(tiny preset, 32 new tokens" in table.title
    floor = figures["bare_loop_cpu_ms"] + figures["bare_client_cpu_ms"]
    assert f"{floor:.3f} ms in all: {floor / figures['bare_interval_ms']:.1%}" in table.notes[-1]
    assert ("only competes with the engine for a core" in table.notes[-1]) is engine_process
    assert [row[0] for row in table.rows] == [1, figures["concurrent"]]
    goal = next(i for i, column in enumerate(table.headers) if column.startswith("goal"))
    assert [row[goal] for row in table.rows] == ["met" if figures[f"{k}_ratio"] < 1.03 else "not met" for k in keys]
    # A --quick run's figures are not judged: its goal cells stay empty.
    assert [row[goal] for row in bench._decode_table(figures, "tiny preset", quick=True).rows] == ["", ""]


def test_the_second_decode_row_has_qwen_s_24_layers_and_the_byte_vocabulary() -> None:
    from prefixcache.models.llama import PRESETS

    config = bench.qwen_layers_config()
    if config is None:
        pytest.skip("../shared/data/tokenizers/qwen2.5-0.5b-instruct/config.json is absent (a user's clone)")
    sizes = (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.intermediate_size)
    assert sizes == (24, 896, 14, 2, 4864)
    assert config.vocab_size == PRESETS["small"].vocab_size == 512


def test_the_bare_stream_sends_max_tokens_events_at_its_pace_then_the_finish() -> None:
    import json
    import time

    import httpx

    from prefixcache.bench.serve_decode import bare_stream_app
    from prefixcache.serve.server import start_background

    app = bare_stream_app(0.01, b'data: {"id": 1}\n\n', b"data: [DONE]\n\n")
    with start_background(app) as server:  # type: ignore[arg-type]
        started = time.perf_counter()
        answer = httpx.post(f"{server.url}/anything", content=json.dumps({"max_tokens": 5}), timeout=30)
        took = time.perf_counter() - started
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
    assert answer.text == 'data: {"id": 1}\n\n' * 5 + "data: [DONE]\n\n"
    assert took >= 0.06  # six intervals of 10 ms (five events, then the finish): paced, not sent at once
    with start_background(app) as server:  # type: ignore[arg-type]
        for body in (b"", b"[]", b'{"max_tokens": "3"}', b'{"max_tokens": -1}', b'{"max_tokens": 1e18}'):
            refused = httpx.post(f"{server.url}/v1/completions", content=body, timeout=30)
            assert refused.status_code == 400 and refused.text.startswith("max_tokens"), body


def test_a_clone_without_the_shared_data_says_which_tables_it_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefixcache.bench.serve_decode import decode_figures
    from prefixcache.models.llama import build_model

    figures = decode_figures(model=build_model("tiny", device="cpu"), runs=2, new_tokens=32)
    overhead = bench._overhead(2)
    monkeypatch.setattr(bench, "_overhead", lambda num_requests: overhead)
    monkeypatch.setattr(bench, "_tau_bench", lambda *args: None)  # what a clone without ../shared gets
    monkeypatch.setattr(bench, "qwen_layers_config", lambda: None)
    monkeypatch.setattr(bench, "decode_figures", lambda quick=False, **kwargs: figures)
    tables = bench.run().tables
    notes = [note for table in tables for note in table.notes]
    assert f"skipped {bench.TAU_BENCH.name}: not found in {bench.DATA_DIR}" in notes
    assert any(note.startswith("skipped the 24-layer tables: config.json not found in ") for note in notes)
    assert [len(table.rows) for table in tables] == [1, 0, 2, 2, 0]
    # A quick run never has the 24-layer table, so it says nothing of it.
    assert not any("24-layer" in note for table in bench.run(quick=True).tables for note in table.notes)


def test_an_engine_process_decode_table_refuses_a_model_object_before_starting_anything() -> None:
    from prefixcache.bench.serve_decode import decode_figures
    from prefixcache.models.llama import build_model

    with pytest.raises(InvalidArgumentError, match="an engine process builds its model"):
        decode_figures(model=build_model("tiny", device="cpu"), runs=2, new_tokens=2, engine_process=True)
